"""Prefill gRPC service: Handshake and Prefill, called by the decode server only.

Why async in front of one device thread: gRPC I/O and validation never wait on the GPU,
while prefills run one at a time in arrival order, which is also the order of the frames
on each decode worker's data plane (a worker serves several: pairing.py). Everything that can be refused is refused before the device or the
data plane sees it: a frame, once started, must be sent whole to keep the stream in step.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvtransfer.engine.sampler import sampling_params
from kvtransfer.rpc.compat import mismatch
from kvtransfer.rpc.device_thread import gpu_executor
from kvtransfer.rpc.lifecycle import SHUTTING_DOWN, RunningRequests
from kvtransfer.rpc.limits import ConcurrencyLimit, prompt_problem, request_id_problem, sampling_problem
from kvtransfer.rpc.metrics import Metrics
from kvtransfer.rpc.modes import Mode
from kvtransfer.rpc.security import server_credentials
from kvtransfer.rpc.server import build_server
from kvtransfer.transport import TransferError
from kvtransfer.transport.registry import Rendezvous, Transport
from kvtransfer.transport.status import transfer_status
from prefill_server import policy
from prefill_server.config import PrefillConfig
from prefill_server.pairing import PrefillPairing
from prefill_server.peer_health import PeerHealth
from prefill_server.worker import WARMUP_REQUEST_ID, PrefillWorker
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

log = logging.getLogger("kvtransfer.prefill")

MODES = {pb.MODE_LAYERWISE: Mode.LAYERWISE, pb.MODE_BULK: Mode.BULK}
CLOSE_WAIT_S = 5.0  # at the stop, the longest wait for the device thread to close the data plane


class PrefillService(pbg.PrefillServicer):
    def __init__(self, config: PrefillConfig, worker: PrefillWorker, compat: pb.Compat, backend,
                 connect, metrics: Metrics | None = None, store=None):
        """backend: the registry's descriptor of the data plane; connect(address="") builds its link (to the
        announced address for Rendezvous.ADDRESS); store: the process-group rendezvous store."""
        self.config, self.worker, self.compat, self.backend = config, worker, compat, backend
        self.transport = backend.name
        self.gpu = gpu_executor(worker.m.device, "prefill-gpu")
        self.vocab = worker.m.model.config.vocab_size
        self.admit = ConcurrencyLimit(config.max_inflight)
        self.queued_tokens = 0  # prompt tokens admitted and not yet prefilled and sent (every decode worker's)
        self.peer_max_receive_bytes = 0  # announced by the decode peer at the handshake (0: unknown)
        self.metrics = metrics or Metrics("prefill")
        self.running = RunningRequests(self.metrics)
        self.metrics.inflight.set_function(lambda: self.admit.count)
        self.metrics.buffer_bytes.set_function(lambda: worker.sending_bytes)
        self.pairing = PrefillPairing(config, worker, backend, connect, self.gpu, self.metrics, store)

    async def Handshake(self, request, context):
        problem = mismatch(self.compat, request.compat)
        if problem is None and request.transport != self.transport.proto:
            peer = Transport.from_proto(request.transport)
            problem = (f"transport: here {self.transport.value!r}, peer {peer.value if peer else 'unspecified'!r}; "
                       "start both workers with the same --transport")
        if problem:
            log.warning("handshake refused: %s", problem)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if self.backend.rendezvous is Rendezvous.ADDRESS and not request.data_address:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"transport {self.transport} needs the decode side's data address in the handshake")
        warmup = self.worker.m.geometry.cache_bytes(self.config.warmup_tokens)
        if self.config.warmup_tokens and request.max_receive_bytes and warmup > request.max_receive_bytes:
            problem = (f"this prefill worker's warm-up of {self.config.warmup_tokens} tokens (--warmup-tokens) is "
                       f"{warmup} bytes, over the decode worker's receive limit of {request.max_receive_bytes} bytes "
                       "(its --max-prompt-tokens and --max-receive-bytes): lower --warmup-tokens here or raise those")
            log.warning("handshake refused: %s", problem)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        self.peer_max_receive_bytes = request.max_receive_bytes
        resp = await self.pairing.handshake(request, context)
        resp.compat.CopyFrom(self.compat)
        resp.transport = self.transport.proto
        resp.max_prompt_tokens = self.config.max_prompt_tokens  # the decode side enforces it, cache or not
        return resp

    def resolve_mode(self, mode: int, n: int) -> Mode:
        if mode == pb.MODE_AUTO:
            return Mode(policy.choose(self.transport, self.config.layerwise_min_tokens, n))
        return MODES[mode]

    async def _validate(self, request, context) -> None:
        n = len(request.token_ids)
        problem = request_id_problem(request.request_id, WARMUP_REQUEST_ID) or prompt_problem(
            request.token_ids, self.config.max_prompt_tokens, self.worker.m.model.config.max_position_embeddings,
            self.vocab)  # the decode server's limits (kvtransfer/rpc/limits.py): nothing it would drop is computed
        if problem is None and request.HasField("sampling"):
            s = request.sampling
            problem = sampling_problem(s.temperature, s.top_p if s.HasField("top_p") else None, s.top_k)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.mode not in MODES and request.mode != pb.MODE_AUTO:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"mode {request.mode} cannot be prefilled remotely; use AUTO, LAYERWISE or BULK")
        size, limit = self.worker.m.geometry.cache_bytes(n), self.peer_max_receive_bytes
        if limit and size > limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"a {n}-token cache is {size} bytes; the decode peer accepts at most {limit} "
                                "(its --max-receive-bytes)")

    async def close(self) -> None:
        """At the stop, after the drain: the data plane closed on the device thread (bounded), the thread let go."""
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self.gpu, self.pairing.close),
                                   CLOSE_WAIT_S)
        except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - stopping regardless
            log.warning("closing the data plane: %r", e)
        self.gpu.shutdown(wait=False, cancel_futures=True)

    async def Prefill(self, request, context):
        with self.running.request(context) as r:  # counts the request's one outcome when it ends
            try:
                if self.running.draining:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{SHUTTING_DOWN}; retry elsewhere")
                await self._validate(request, context)
                if not self.admit.try_enter():
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.admit.refusal())
                try:
                    return await self._prefill(request, context)
                finally:
                    self.admit.leave()
            except asyncio.CancelledError:
                if r.ending:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{SHUTTING_DOWN}: --shutdown-grace-s passed "
                                        "before this prefill finished")
                raise

    async def _prefill(self, request, context):
        n = len(request.token_ids)
        mode = self.resolve_mode(request.mode, n)
        s = request.sampling  # the decode server always sets the seed; a direct call without one gets a drawn seed
        sampling = sampling_params(s.temperature, s.top_p if s.HasField("top_p") else None, s.top_k,
                                   s.seed if s.HasField("seed") else None) if request.HasField("sampling") else None
        self.queued_tokens += n
        try:
            r = await self.pairing.request(request.decode_instance, request.request_id, list(request.token_ids), mode,
                                           request.return_logits_digest, sampling)
        except TransferError as e:
            log.error("request %d: transfer failed: %s", request.request_id, e)
            self.metrics.failures.labels(e.cause).inc()
            await context.abort(transfer_status(e), f"cache transfer failed: {e}")
        finally:
            self.queued_tokens -= n
        log.info("request %d: %d tokens %s prefill %.2f ms sent %.2f ms", request.request_id, n, r.mode,
                 r.prefill_ms, r.send_done_ms)
        self.metrics.prefill_ms.labels(r.mode).observe(r.prefill_ms)
        self.metrics.moved(self.worker.m.geometry.cache_bytes(n), r.send_done_ms / 1e3, r.mode)
        return pb.PrefillResponse(first_token=r.first_token, first_logits_digest=r.first_logits_digest,
                                  prefill_ms=r.prefill_ms, send_done_ms=r.send_done_ms, mode=Mode(r.mode).proto,
                                  queued_tokens=self.queued_tokens)


async def create_server(config: PrefillConfig, service: PrefillService, address: str | None = None,
                        token: str = "") -> tuple[grpc.aio.Server, int]:
    """Build (not start) the server; returns it and the bound port (tests bind port 0)."""
    server, port, service.pairing.health = build_server(
        pb.DESCRIPTOR.services_by_name["Prefill"], service, address or config.listen, config.max_message_bytes,
        token, server_credentials(config.tls_cert, config.tls_key, config.tls_ca), PeerHealth())
    return server, port
