"""`kvtransfer-decode`: load the model, pair with the prefill peers (and keep pairing), serve Generate."""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2

from decode_server.config import DecodeConfig
from decode_server.peer.handshake import HandshakeRefused
from decode_server.peer.pairing import DecodePairing
from decode_server.peer.peers import DECODE_SERVICE, PrefillPeers
from decode_server.server import DecodeService, create_server
from decode_server.sizing import plan_engine
from kvtransfer.engine.engine import DecodeEngine
from kvtransfer.model.loaded import load, pick_device
from kvtransfer.rpc.compat import local_compat
from kvtransfer.rpc.lifecycle import FatalStop, Stop, shut_down
from kvtransfer.rpc.main import run_main
from kvtransfer.rpc.metrics import start_metrics
from kvtransfer.rpc.security import ClientSecurity, resolve_token
from kvtransfer.rpc.server import new_health, peer_channel_options
from kvtransfer.transport import registry

log = logging.getLogger("kvtransfer.decode")


async def serve(config: DecodeConfig) -> None:
    stop = Stop()
    token = resolve_token(config.auth_token, config.auth_token_file)
    peer = ClientSecurity(config.prefill_tls_ca, config.prefill_tls_cert, config.prefill_tls_key,
                          resolve_token(config.prefill_auth_token, config.prefill_auth_token_file,
                                        "--prefill-auth-token-file"))
    if unused := config.unused_when_colocated():
        log.warning("%s: no effect with --colocated (this worker prefills itself; no prefill peer)", ", ".join(unused))
    device = pick_device(config.device)
    loaded = load(config.spec(device), device, config.deterministic)
    metrics = start_metrics("decode", config.metrics_port, config.metrics_addr)
    metrics.export_peer_up(not config.colocated)  # colocated: no peer, no kvt_peer_up (its 0 reads as a pair down)
    backend = None if config.colocated else registry.resolve(config.transport, device.type)
    if backend is not None and backend.rendezvous is registry.Rendezvous.PROCESS_GROUP:
        from kvtransfer.transport.rendezvous import store_address
        for init in config.dist_inits:
            store_address(init)  # env:// without MASTER_ADDR/PORT: exit 2 now, not after the handshake
    per_peer = 0 if backend is None else config.ipc_slots if backend.name == "cuda_ipc" else 1
    receive_slots = per_peer * len(config.prefill_addrs)
    options, chosen = plan_engine(config, loaded, receive_slots)
    log.info("%s", chosen)
    engine = DecodeEngine(loaded, options, on_step=metrics.stepped, on_fatal=stop.fail)
    peers, health = None, new_health()
    if backend is not None:
        peers = PrefillPeers(config, health, metrics)
        compat = local_compat(loaded.spec, loaded.model, loaded.geometry, config.deterministic,
                              config.batch_invariant)
        for addr, init in zip(config.prefill_addrs, config.dist_inits):
            channel = peer.channel(addr, options=peer_channel_options(config.max_message_bytes,
                                                                      config.peer_keepalive_s))
            peers.add(DecodePairing(config, loaded, backend, compat, channel, peer.metadata(), metrics,
                                    peers.publish, addr, init))
        peers.watch_fatal(stop.fail)
    service = DecodeService(config, engine, peers, metrics, peer.metadata())

    def on_fatal(cause: str) -> None:  # on the loop, at once: probes see NOT_SERVING, requests end INTERNAL
        asyncio.ensure_future(service.health.enter_graceful_shutdown())
        service.fail_all(cause)
    stop.on_fatal = on_fatal
    server, port = await create_server(config, service, token=token, health=health)  # the port is ours from here on
    if peers is not None:
        await peers.publish()  # NOT_SERVING from the first moment the port answers, until paired
    await server.start()
    front = "mTLS" if config.tls_ca else "TLS" if config.tls_cert else "plaintext"
    if peers is not None:  # "" follows the peers: NOT_SERVING until one is paired, and while none is
        log.info("listening on port %d, NOT_SERVING until paired; model loaded on %s; pairing with the prefill "
                 "worker%s at %s (--prefill-addr, %s, --on-failure %s)", port, device,
                 "s" if len(config.prefill_addrs) > 1 else "", ", ".join(config.prefill_addrs), peers.transport,
                 config.on_failure)
        paired = await stop.wait_or(_first_pairing(peers))
    else:
        for name in ("", DECODE_SERVICE):  # as a pair's once paired (peers.publish)
            await service.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        paired = True
    if paired:
        log.info("decode server ready on port %d (%s; front door %s%s)", port,
                 "colocated" if config.colocated else "disaggregated", front, ", token required" if token else "")
        await stop.event.wait()
    await shut_down(server, service.health, service.running, stop, 0.0 if stop.fatal else config.shutdown_grace_s,
                    log, "decode server", service.end_for_shutdown)
    if peers is not None:
        await peers.close()
    engine.close()
    if stop.fatal:
        raise FatalStop(stop.fatal)


async def _first_pairing(peers: PrefillPeers) -> None:
    try:
        await peers.start()
    except HandshakeRefused as e:  # refused, or no answer within --handshake-timeout-s: exit 2, saying why
        raise ValueError(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    run_main(DecodeConfig, argv, "kvtransfer decode worker (the front door)", serve, log, "kvtransfer-decode")


if __name__ == "__main__":
    main()
