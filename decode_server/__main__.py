"""`kvtransfer-decode`: load the model, pair with the prefill peer (and keep pairing), serve Generate."""

from __future__ import annotations

import logging

from grpc_health.v1 import health_pb2

from kvtransfer.compat import local_compat
from kvtransfer.lifecycle import Stop, shut_down
from kvtransfer.security import ClientSecurity, resolve_token
from kvtransfer.serving import load, new_health, peer_channel_options, pick_device, run_main, start_metrics
from kvtransfer.transport import registry

from .config import DecodeConfig
from .engine import DecodeEngine, EngineOptions
from .handshake import HandshakeRefused
from .pairing import DecodePairing
from .server import DecodeService, create_server

log = logging.getLogger("kvtransfer.decode")


async def serve(config: DecodeConfig) -> None:
    stop = Stop()
    token = resolve_token(config.auth_token, config.auth_token_file)
    peer = ClientSecurity(config.prefill_tls_ca, config.prefill_tls_cert, config.prefill_tls_key,
                          resolve_token(config.prefill_auth_token, config.prefill_auth_token_file,
                                        "--prefill-auth-token-file"))
    device = pick_device(config.device)
    loaded = load(config.spec, device, config.deterministic)
    metrics = start_metrics("decode", config.metrics_port, config.metrics_addr)
    engine = DecodeEngine(loaded, EngineOptions(config.max_batch, config.max_seq_len, config.cuda_graphs,
                                                config.prefill_chunk, config.mixed_prefill, config.mixed_max_rows),
                          on_step=metrics.stepped)
    pairing, health = None, new_health()
    if not config.colocated:
        backend = registry.resolve(config.transport, device.type)
        channel = peer.channel(config.prefill_addr,
                               options=peer_channel_options(config.max_message_bytes, config.peer_keepalive_s))
        pairing = DecodePairing(config, loaded, backend,
                                local_compat(config.spec, loaded.model, loaded.geometry, config.deterministic),
                                channel, peer.metadata(), metrics, health)
    service = DecodeService(config, engine, pairing, metrics, peer.metadata())
    server, port = await create_server(config, service, token=token, health=health)  # the port is ours from here on
    if pairing is not None:
        await pairing.publish()  # NOT_SERVING from the first moment the port answers, until paired
    await server.start()
    front = "mTLS" if config.tls_ca else "TLS" if config.tls_cert else "plaintext"
    if pairing is not None:  # "" follows the peer: NOT_SERVING until paired, and while it is gone
        log.info("listening on port %d, NOT_SERVING until paired; model loaded on %s; pairing with the prefill "
                 "worker at %s (--prefill-addr, %s, --on-failure %s)", port, device, config.prefill_addr,
                 pairing.transport, config.on_failure)
        paired = await stop.wait_or(_first_pairing(pairing))
    else:
        await service.health.set("", health_pb2.HealthCheckResponse.SERVING)
        paired = True
    if paired:
        log.info("decode server ready on port %d (%s; front door %s%s)", port,
                 "colocated" if config.colocated else "disaggregated", front, ", token required" if token else "")
        await stop.event.wait()
    await shut_down(server, service.health, service.inflight, stop, config.shutdown_grace_s, log, "decode server",
                    service.end_for_shutdown)
    engine.close()


async def _first_pairing(pairing: DecodePairing) -> None:
    try:
        await pairing.start()
    except HandshakeRefused as e:  # refused, or no answer within --handshake-timeout-s: exit 2, saying why
        raise ValueError(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    run_main(DecodeConfig, argv, "kvtransfer decode worker (the front door)", serve, log, "kvtransfer-decode")


if __name__ == "__main__":
    main()
