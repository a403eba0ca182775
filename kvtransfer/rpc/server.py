"""Pieces both servers share: model + device set-up, the process-group pair, grpc.aio plumbing.

Why one place: the two workers must build the model, the geometry and the data-plane
link the same way, or their caches would not match byte for byte; and they must refuse
bad input the same way: limits checked before any work, malformed bytes answered with
INVALID_ARGUMENT (not gRPC's UNKNOWN), too many requests refused at once, never queued.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvtransfer.determinism import enable_deterministic
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec, load_model
from kvtransfer.rpc.security import bind, server_interceptors

log = logging.getLogger("kvtransfer")

DECODE_INSTANCE_KEY = "kvt-decode-instance"  # the decode side's liveness watch names its instance (hex) to the prefill
CONTROL_MESSAGE_LIMIT = 4 << 20  # default --max-message-bytes: a 32k-token prompt is < 330 KB
BYTES_PER_TOKEN_ID = 10  # worst case of one packed int64 on the wire


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


# A server accepts the decode side's keepalive pings as often as once a second, even between calls;
# and owns its port alone (gRPC turns SO_REUSEPORT on by default: two servers would split the calls).
SERVER_KEEPALIVE = [("grpc.so_reuseport", 0), ("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_ping_strikes", 0)]


def peer_channel_options(max_message_bytes: int, keepalive_s: float) -> list[tuple[str, int]]:
    """The decode server's channel to its prefill peer: a link that stops answering pings for `keepalive_s`
    fails every call on it (and the liveness watch) with UNAVAILABLE, instead of hanging until a deadline;
    a peer that comes back is reconnected to within about 2 s."""
    ms = max(int(keepalive_s * 1000), 1000)
    return grpc_options(max_message_bytes) + [
        ("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms), ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0), ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]


def check_metrics_flags(port: int, addr: str) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port {port}: use 1..65535, or 0 for no metrics endpoint")
    if not addr:
        raise ValueError("--metrics-addr must not be empty (127.0.0.1 keeps it on this host)")


def start_metrics(role: str, port: int, addr: str):
    """The server's Metrics (always, so code records unconditionally), served on addr:port unless port is 0."""
    from kvtransfer.rpc.metrics import Metrics
    metrics = Metrics(role)
    if port:
        try:
            metrics.serve(port, addr)
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {addr}:{port} (--metrics-port/--metrics-addr): {e}") from None
        log.info("metrics on http://%s:%d/metrics", addr, port)
    return metrics


def check_message_limit(max_message_bytes: int, max_prompt_tokens: int) -> None:
    """A prompt the server accepts must also fit in one message; refuse a config where it would not."""
    need = max_prompt_tokens * BYTES_PER_TOKEN_ID + 1024
    if max_message_bytes < need:
        raise ValueError(f"--max-message-bytes {max_message_bytes} is too small for --max-prompt-tokens "
                         f"{max_prompt_tokens}: use at least {need}")


def pick_device(name: str, flag: str = "--device") -> torch.device:
    """The device a server or bench runs on, always with an index on CUDA.

    Why the index: `torch.cuda.set_device` (the scheduler and receive threads call it) refuses an index-less
    `cuda`, and a worker thread that dies at start leaves a server that answers health but serves nothing.
    A CUDA index that does not exist is refused here, naming the flag (the servers exit 2).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {name}: no CUDA device here; use {flag} cpu")
        count = torch.cuda.device_count()
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= count:
            raise ValueError(f"{flag} {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        torch.cuda.set_device(dev)
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """--dtype auto: bfloat16 on CUDA (the kernels and published checkpoints), float32 on CPU (bit-exact against
    the HF forward, which the CPU tests rely on). Both workers resolve it alike on like devices; the handshake
    refuses a mismatch, naming --dtype."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: torch.nn.Module
    geometry: CacheGeometry
    device: torch.device


def load(spec: ModelSpec, device: torch.device, deterministic: bool) -> LoadedModel:
    if deterministic:
        enable_deterministic()
    model = load_model(spec, device)
    return LoadedModel(spec, model, CacheGeometry.from_config(model.config, spec.torch_dtype), device)


def gpu_executor(device: torch.device, name: str) -> ThreadPoolExecutor:
    """One thread owns the device's compute: requests are serialized, CUDA context set once."""
    init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it is a dependency), else the default loop."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.new_event_loop()


class InflightLimit:
    """At most `limit` requests at a time; the next one is refused at once (no queue to grow)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def try_enter(self) -> bool:
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1

    def refusal(self) -> str:
        return f"{self.count} requests in flight (limit {self.limit}, --max-inflight); retry later"


def add_typed_service(server: grpc.aio.Server, service, servicer) -> None:
    """Register `servicer` for the proto service descriptor `service`, parsing requests itself.

    gRPC's own deserializer turns corrupt bytes into UNKNOWN; parsing here answers
    INVALID_ARGUMENT naming the expected message instead.
    """
    handlers = {}
    for m in service.methods:
        fn, cls = getattr(servicer, m.name), GetMessageClass(m.input_type)
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(fn, cls), response_serializer=_serialize)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(_unary(fn, cls), response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _serialize(msg) -> bytes:
    return msg.SerializeToString()


async def _parse(cls, raw: bytes, context):
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request is not a valid {cls.DESCRIPTOR.full_name} ({e}); "
                            "build it from proto/kvtransfer.proto")


def _unary(fn, cls):
    async def handle(raw, context):
        return await fn(await _parse(cls, raw, context), context)
    return handle


def _streaming(fn, cls):
    async def handle(raw, context):
        async for msg in fn(await _parse(cls, raw, context), context):
            yield msg
    return handle


def build_server(descriptor, servicer, address: str, max_message_bytes: int, token: str,
                 creds: grpc.ServerCredentials | None, health=None):
    """Build (not start) a server for one proto service plus health and reflection.

    Returns (server, bound port, health servicer). Raises ValueError when it cannot bind.
    """
    server = grpc.aio.server(options=grpc_options(max_message_bytes) + SERVER_KEEPALIVE,
                             interceptors=server_interceptors(token))
    add_typed_service(server, descriptor, servicer)
    health = add_standard_services(server, [descriptor.full_name], health)
    try:
        port = bind(server, address, creds, token)
    except RuntimeError:  # grpc raises on a port in use or a bad address (older versions return 0)
        port = 0
    if port == 0:
        raise ValueError(f"cannot listen on {address} (--listen): port {address.rsplit(':', 1)[1]} is taken "
                         "(another server?) or the host is not this machine's")
    return server, port, health


def new_health():
    """A health servicer (to flip SERVING/NOT_SERVING), made before its server when its owner needs it first."""
    from grpc_health.v1 import health
    return health.aio.HealthServicer()


def add_standard_services(server: grpc.aio.Server, service_names: list[str], health_servicer=None):
    """Health (returned; `health_servicer` when given, else a new one) and reflection."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    health_servicer = health_servicer or new_health()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                                         reflection.SERVICE_NAME], server)
    return health_servicer


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")


def run_main(config_cls, argv, description: str, serve, logger: logging.Logger, prog: str | None = None) -> None:
    """A server's `main`: flags -> config (validated), logging, one uvloop loop running `serve(config)`.

    A setting that only shows at start-up (device, certificate, token file, port) exits 2
    with one line saying which. `serve` returns after a SIGTERM/SIGINT (kvtransfer.rpc.lifecycle): exit 0.

    Why the process ends with `os._exit` once `serve` is over: by then every request has ended and the
    ports are closed, but threads may still be blocked in a transport (a gloo receive the peer has not
    closed yet, a rendezvous); the interpreter would wait for them at exit (up to --dist-timeout-s), or
    finalize torch under them ("terminate called without an active exception", exit -6).
    """
    import os
    import sys

    from kvtransfer.rpc.configargs import from_args
    from kvtransfer.rpc.lifecycle import EXIT_FATAL, FatalStop
    from kvtransfer.rpc.stacks import enable_stack_dumps
    config = from_args(config_cls, argv, description, prog)
    enable_stack_dumps()  # kill -USR1 PID: every thread's stack in the log
    configure_logging(config.log_level)
    logger.info("config %s", config.one_line())
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    code = 0
    try:
        loop.run_until_complete(serve(config))
    except KeyboardInterrupt:
        pass
    except ValueError as e:
        logger.error("cannot start: %s", e)
        code = 2
    except FatalStop as e:  # its traceback was logged when it happened
        logger.error("exiting %d: %s", EXIT_FATAL, e)
        code = EXIT_FATAL
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
