"""`kvtransfer-decode`: load the model, join the prefill peer, handshake, serve Generate."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc

from kvtransfer.compat import local_compat, mismatch
from kvtransfer.configargs import from_args
from kvtransfer.security import ClientSecurity, resolve_token, server_credentials
from kvtransfer.serving import configure_logging, gpu_executor, grpc_options, load, new_event_loop, pick_device
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

from kvtransfer.transport.links import ADDRESSED, PROCESS_GROUP, receiver_link, resolve

from .config import DecodeConfig
from .engine import DecodeEngine
from .receiver import ReceiveLoop
from .server import DecodeService, create_server

log = logging.getLogger("kvtransfer.decode")


class HandshakeRefused(SystemExit):
    pass


async def handshake(stub: pbg.PrefillStub, compat: pb.Compat, transport: str, timeout_s: float,
                    max_receive_bytes: int = 0, metadata=None, data_address: str = "") -> None:
    """Wait for the prefill peer, then refuse it unless it holds the same model and layout."""
    deadline = time.monotonic() + timeout_s
    request = pb.HandshakeRequest(compat=compat, transport=transport, max_receive_bytes=max_receive_bytes,
                                  data_address=data_address)
    while True:
        try:
            resp = await stub.Handshake(request, timeout=max(min(10.0, deadline - time.monotonic()), 0.1),
                                        wait_for_ready=True, metadata=metadata)
            break
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                raise HandshakeRefused(f"prefill peer refused the handshake: {e.details()}") from None
            if time.monotonic() > deadline:
                raise HandshakeRefused(f"prefill peer did not answer the handshake within {timeout_s} s: "
                                       f"{e.code().name} {e.details()}") from None
    problem = mismatch(compat, resp.compat)
    if problem:
        raise HandshakeRefused(f"prefill peer refused: {problem}")
    log.info("handshake ok: %s %s fingerprint %s", resp.compat.model, resp.compat.dtype,
             resp.compat.weights_fingerprint)


async def serve(config: DecodeConfig) -> None:
    token = resolve_token(config.auth_token, config.auth_token_file)
    peer = ClientSecurity(config.prefill_tls_ca, config.prefill_tls_cert, config.prefill_tls_key,
                          resolve_token(config.prefill_auth_token, config.prefill_auth_token_file,
                                        "--prefill-auth-token-file"))
    device = pick_device(config.device)
    loaded = load(config.spec, device, config.deterministic)
    engine = DecodeEngine(loaded)
    gpu = gpu_executor(device, "decode-gpu")
    receiver = stub = None
    if not config.colocated:
        transport = resolve(config.transport, device)
        if transport in PROCESS_GROUP:
            from kvtransfer.transport.dist import init_pair
            log.info("model loaded on %s; joining process group at %s as rank 1 (%s)", device, config.dist_init,
                     transport)
            await asyncio.to_thread(init_pair, 1, config.dist_init, device, config.dist_timeout_s)
        g = loaded.geometry
        link = receiver_link(transport, device, config.max_receive_bytes, config.data_listen,
                             g.cache_bytes(config.max_prompt_tokens), config.ipc_slots, g.num_layers,
                             server_credentials(config.data_tls_cert, config.data_tls_key, config.data_tls_ca))
        data_address = getattr(link, "address", "") if transport in ADDRESSED else ""
        if data_address:
            log.info("data plane (%s) listening at %s", transport, data_address)
        receiver = ReceiveLoop(link, loaded.geometry, device, finish_timeout_s=config.request_timeout_s)
        receiver.start()
        stub = pbg.PrefillStub(peer.channel(config.prefill_addr, options=grpc_options(config.max_message_bytes)))
        compat = local_compat(config.spec, loaded.model, loaded.geometry, config.deterministic)
        await handshake(stub, compat, transport, config.handshake_timeout_s, config.max_receive_bytes,
                        peer.metadata(), data_address)
    service = DecodeService(config, engine, gpu, receiver, stub, peer.metadata())
    server, port = await create_server(config, service, token=token)
    await server.start()
    from grpc_health.v1 import health_pb2
    await service.health.set("", health_pb2.HealthCheckResponse.SERVING)
    if receiver is not None:  # a dead data plane cannot serve disaggregated requests: say so to probes
        loop = asyncio.get_running_loop()
        receiver.on_stop = lambda: asyncio.run_coroutine_threadsafe(
            service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING), loop)
        if receiver.error is not None:  # it stopped before the callback was in place
            await service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info("decode server ready on port %d (%s; front door %s%s)", port,
             "colocated" if config.colocated else "disaggregated",
             "mTLS" if config.tls_ca else "TLS" if config.tls_cert else "plaintext",
             ", token required" if token else "")
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    config = from_args(DecodeConfig, argv, "kvtransfer decode worker (the front door)")
    configure_logging(config.log_level)
    log.info("config %s", config.one_line())
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve(config))
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # a setting that only shows at start-up (device, certificate, token file, port)
        log.error("cannot start: %s", e)
        sys.exit(2)


if __name__ == "__main__":
    main()
