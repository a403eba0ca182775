"""Prefill gRPC service: Handshake and Prefill, called by the decode server only.

Why async in front of one device thread: gRPC I/O and validation never wait on the GPU,
while prefills run one at a time in arrival order, which is also the order of the frames
on the data plane.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvtransfer.compat import mismatch
from kvtransfer.serving import GRPC_OPTIONS, add_standard_services, gpu_executor
from kvtransfer.transport import TransferError
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

from .config import PrefillConfig
from .worker import WARMUP_REQUEST_ID, PrefillWorker

log = logging.getLogger("kvtransfer.prefill")

MODES = {pb.MODE_LAYERWISE: "layerwise", pb.MODE_BULK: "bulk"}


class PrefillService(pbg.PrefillServicer):
    def __init__(self, config: PrefillConfig, worker: PrefillWorker, compat: pb.Compat, transport: str):
        self.config, self.worker, self.compat, self.transport = config, worker, compat, transport
        self.gpu = gpu_executor(worker.m.device, "prefill-gpu")
        self.vocab = worker.m.model.config.vocab_size

    async def Handshake(self, request, context):
        problem = mismatch(self.compat, request.compat)
        if problem is None and request.transport != self.transport:
            problem = (f"transport: here {self.transport!r}, peer {request.transport!r}; "
                       "start both workers with the same --transport")
        if problem:
            log.warning("handshake refused: %s", problem)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        return pb.HandshakeResponse(compat=self.compat, transport=self.transport)

    def resolve_mode(self, mode: int, n: int) -> str:
        if mode == pb.MODE_AUTO:
            return "layerwise" if n >= self.config.layerwise_min_tokens else "bulk"
        return MODES[mode]

    async def Prefill(self, request, context):
        n = len(request.token_ids)
        if request.request_id == WARMUP_REQUEST_ID:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id 0 is reserved for the warm-up")
        if n == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt: send at least one token id")
        if n > self.config.max_prompt_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {n} tokens, this server's limit is {self.config.max_prompt_tokens}")
        bad = [t for t in request.token_ids if not 0 <= t < self.vocab]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token id {bad[0]} outside the vocabulary [0, {self.vocab})")
        if request.mode not in MODES and request.mode != pb.MODE_AUTO:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"mode {request.mode} cannot be prefilled remotely; use AUTO, LAYERWISE or BULK")
        mode = self.resolve_mode(request.mode, n)
        loop = asyncio.get_running_loop()
        try:
            r = await loop.run_in_executor(self.gpu, self.worker.run, request.request_id,
                                           list(request.token_ids), mode, request.return_logits_digest)
        except TransferError as e:
            log.error("request %d: transfer failed: %s", request.request_id, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cache transfer failed: {e}")
        log.info("request %d: %d tokens %s prefill %.2f ms sent %.2f ms", request.request_id, n, r.mode,
                 r.prefill_ms, r.send_done_ms)
        return pb.PrefillResponse(first_token=r.first_token, first_logits_digest=r.first_logits_digest,
                                  prefill_ms=r.prefill_ms, send_done_ms=r.send_done_ms, mode=r.mode)


async def create_server(config: PrefillConfig, service: PrefillService, address: str | None = None
                        ) -> tuple[grpc.aio.Server, int]:
    """Build (not start) the server; returns it and the bound port (tests bind port 0)."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pbg.add_PrefillServicer_to_server(service, server)
    health = add_standard_services(server, [pb.DESCRIPTOR.services_by_name["Prefill"].full_name])
    port = server.add_insecure_port(address or config.listen)
    if port == 0:
        raise ValueError(f"cannot bind {address or config.listen}")
    service.health = health
    return server, port
