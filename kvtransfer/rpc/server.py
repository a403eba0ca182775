"""Building a gRPC server both workers share: one proto service, health, reflection, the token check and TLS.

Why one place: the two workers must refuse bad input the same way: malformed bytes answered with
INVALID_ARGUMENT naming the expected message (not gRPC's UNKNOWN), one keepalive policy, one port each.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvtransfer.rpc.security import bind, server_interceptors

log = logging.getLogger("kvtransfer")

DECODE_INSTANCE_KEY = "kvt-decode-instance"  # the decode side's liveness watch names its instance (hex) to the prefill
WATCH_KEY = "kvt-watch"  # each liveness watch carries a token of its own; a handshake names the watch open for it
MAX_WATCH_TOKEN = 64  # characters; a longer one is read as none


def pair_service(decode_instance: int) -> str:
    """The health service name of one prefill/decode pair on the prefill worker (its decode side watches it)."""
    return f"kvtransfer.Pair/{decode_instance:x}"


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


# A server accepts the decode side's keepalive pings as often as once a second, even between calls;
# and owns its port alone (gRPC turns SO_REUSEPORT on by default: two servers would split the calls).
SERVER_KEEPALIVE = [("grpc.so_reuseport", 0), ("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_ping_strikes", 0)]


def peer_channel_options(max_message_bytes: int, keepalive_s: float) -> list[tuple[str, int]]:
    """The decode server's channel to its prefill peer: a link that drops packets for `keepalive_s`, or a peer
    process that answers no ping for max(`keepalive_s`, 10 s), fails every call on it (and the liveness watch) with
    UNAVAILABLE, instead of hanging until a deadline; a peer that comes back is reconnected to within about 2 s."""
    ms = max(int(keepalive_s * 1000), 1000)
    return grpc_options(max_message_bytes) + keepalive_options(ms) + [
        ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 2000)]


PING_ANSWER_MIN_MS = 10_000  # the least a ping's answer is awaited: see keepalive_options


def keepalive_options(ms: int) -> list[tuple[str, int]]:
    """A client channel's pings: one every `ms`, calls or none. A link that drops packets fails the channel's calls
    UNAVAILABLE after `ms` (`grpc.keepalive_timeout_ms`, which gRPC core turns into TCP_USER_TIMEOUT). A peer whose
    process hangs while its kernel still acknowledges TCP (SIGSTOP, a stuck loop) is caught only by a ping left
    unanswered, which recent gRPC core (grpc/grpc#34647) waits for `grpc.http2.ping_timeout_ms`, 60 s by default: a
    new user's pass saw a frozen peer noticed after a minute. Set here to `ms`, but at least PING_ANSWER_MIN_MS: at
    2 s, an xpyd fleet starved of CPU on a loaded 2-core CI machine re-paired mid-load (CI run 76; the likeliest
    cause), and a process that answers no ping for 10 s is as good as gone."""
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", max(ms, PING_ANSWER_MIN_MS)),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


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
