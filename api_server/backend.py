"""The front's one gRPC channel to its decode server: Info (asked once), Generate (one stream per request), health.

Why one channel: every HTTP request becomes one HTTP/2 stream on it, so 32 concurrent requests cost 32 streams
and no connections. The credentials are the ones `kvtransfer-client` uses (kvtransfer.rpc.security.ClientSecurity:
TLS by CA, a client certificate for mTLS, the bearer token as metadata), and the channel pings the server like
the decode server pings its prefill peer, so a server that vanishes fails its calls UNAVAILABLE instead of
leaving them to hang until their deadline. Info is cached for INFO_TTL_S: a model's name and limits do not change
while it serves, but the server behind the address may be restarted with other limits (or a router may answer
from another worker), and a front that kept the first answer forever then filled in defaults the server refuses
(a new-user pass: "max_new_tokens is 4095; use 1..50" for a request that sent none). A refresh that fails keeps
the last answer (the request's own call then says what is wrong). A server that predates Info (UNIMPLEMENTED) is
served without them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from api_server.errors import from_rpc
from kvtransfer.rpc.security import ClientSecurity
from kvtransfer.rpc.server import peer_channel_options
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

log = logging.getLogger("kvtransfer.api")

INFO_TIMEOUT_S = 10.0
INFO_TTL_S = 5.0  # an Info answer is reused this long, then asked again


class Backend:
    def __init__(self, address: str, security: ClientSecurity, max_message_bytes: int, keepalive_s: float,
                 request_timeout_s: float):
        self.address, self.security, self.request_timeout_s = address, security, request_timeout_s
        self._options = peer_channel_options(max_message_bytes, keepalive_s)
        self._channel: grpc.aio.Channel | None = None
        self._info: pb.InfoResponse | None = None
        self._info_at = 0.0  # time.monotonic() of the cached answer
        self._info_lock: asyncio.Lock | None = None

    def open(self) -> None:
        """Made on the server's event loop (grpc.aio binds a channel to the loop it was made on)."""
        self._channel = self.security.channel(self.address, options=self._options)
        self._decode = pbg.DecodeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._info_lock = asyncio.Lock()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def info(self) -> pb.InfoResponse:
        """The decode server's Info, at most INFO_TTL_S old; an empty one from a server without it. Raises ApiError
        when the server cannot be reached (503) or refuses (its status) and no earlier answer is kept."""
        if self._info is not None and time.monotonic() - self._info_at < INFO_TTL_S:
            return self._info
        async with self._info_lock:
            if self._info is None or time.monotonic() - self._info_at >= INFO_TTL_S:
                try:
                    got = await self._decode.Info(pb.InfoRequest(), timeout=INFO_TIMEOUT_S,
                                                  metadata=self.security.metadata())
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                        if self._info is not None:
                            return self._info  # the last answer; the request's Generate call reports the failure
                        raise from_rpc(e, self.address) from None
                    log.warning("the decode server at %s has no Info: serving without its limits", self.address)
                    got = pb.InfoResponse()
                self._info, self._info_at = got, time.monotonic()
        return self._info

    def generate(self, request: pb.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        return self._decode.Generate(request, timeout=self.request_timeout_s, metadata=self.security.metadata())

    async def serving(self, timeout: float) -> bool:
        """The decode server's own health: SERVING, or anything else (unreachable, NOT_SERVING, late) as False."""
        try:
            got = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return got.status == health_pb2.HealthCheckResponse.SERVING
