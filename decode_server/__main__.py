"""`kvtransfer-decode`: load the model, join the prefill peer, handshake, serve Generate."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvtransfer.compat import local_compat, mismatch
from kvtransfer.configargs import from_args
from kvtransfer.serving import GRPC_OPTIONS, configure_logging, gpu_executor, load, new_event_loop, pick_device
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

from .config import DecodeConfig
from .engine import DecodeEngine
from .receiver import ReceiveLoop
from .server import DecodeService, create_server

log = logging.getLogger("kvtransfer.decode")


class HandshakeRefused(SystemExit):
    pass


async def handshake(stub: pbg.PrefillStub, compat: pb.Compat, transport: str, timeout_s: float) -> None:
    """Wait for the prefill peer, then refuse it unless it holds the same model and layout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await stub.Handshake(pb.HandshakeRequest(compat=compat, transport=transport),
                                        timeout=max(min(10.0, deadline - time.monotonic()), 0.1), wait_for_ready=True)
            break
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
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
    device = pick_device(config.device)
    loaded = load(config.spec, device, config.deterministic)
    engine = DecodeEngine(loaded)
    gpu = gpu_executor(device, "decode-gpu")
    receiver = stub = None
    if not config.colocated:
        from kvtransfer.transport.dist import ReceiverLink, init_pair
        transport = config.transport if config.transport != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        log.info("model loaded on %s; joining process group at %s as rank 1 (%s)", device, config.dist_init, transport)
        await asyncio.to_thread(init_pair, 1, config.dist_init, device, config.dist_timeout_s)
        link = ReceiverLink(device, peer=0, max_bytes=config.max_receive_bytes)
        receiver = ReceiveLoop(link, loaded.geometry, device, finish_timeout_s=config.request_timeout_s)
        receiver.start()
        channel = grpc.aio.insecure_channel(config.prefill_addr, options=GRPC_OPTIONS)
        stub = pbg.PrefillStub(channel)
        compat = local_compat(config.spec, loaded.model, loaded.geometry, config.deterministic)
        await handshake(stub, compat, transport, config.handshake_timeout_s)
    service = DecodeService(config, engine, gpu, receiver, stub)
    server, port = await create_server(config, service)
    await server.start()
    from grpc_health.v1 import health_pb2
    await service.health.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("decode server ready on port %d (%s)", port, "colocated" if config.colocated else "disaggregated")
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


if __name__ == "__main__":
    main()
