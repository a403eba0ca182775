"""TLS, mutual TLS and a shared bearer token for the two gRPC services.

Why here and why this small: both servers and both kinds of client (the decode server
calling the prefill server, and users calling the decode server) must agree on exactly
one way to present and check credentials. TLS comes from gRPC itself (certificate files
named by flags); the token is checked by one server interceptor that leaves the health
service open, so orchestrators can probe readiness without holding the secret. The data
plane (NCCL/gloo) is not covered by any of this: see docs/security.md.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass

import grpc

log = logging.getLogger("kvtransfer.rpc.security")

AUTH_HEADER = "authorization"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes never need the token


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot read ({e.strerror})") from None


def check_tls_flags(prefix: str, cert: str, key: str, ca: str, server: bool) -> None:
    """Raise ValueError naming the flag when TLS flags are inconsistent or a file is missing.

    Server side: cert+key turn TLS on; ca additionally requires client certificates (mTLS).
    Client side: ca turns TLS on (verifies the server); cert+key add a client certificate.
    """
    if bool(cert) != bool(key):
        raise ValueError(f"--{prefix}-cert and --{prefix}-key go together: give both or neither")
    if server and ca and not cert:
        raise ValueError(f"--{prefix}-ca (require client certificates) needs --{prefix}-cert and --{prefix}-key")
    if not server and cert and not ca:
        raise ValueError(f"--{prefix}-cert (client certificate) needs --{prefix}-ca to verify the server")
    for flag, path in ((f"--{prefix}-cert", cert), (f"--{prefix}-key", key), (f"--{prefix}-ca", ca)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")


def check_token_flags(prefix: str, token: str, token_file: str) -> None:
    if token and token_file:
        raise ValueError(f"--{prefix}-token and --{prefix}-token-file: give one, not both")
    if token_file and not os.path.isfile(token_file):
        raise ValueError(f"--{prefix}-token-file {token_file!r}: no such file")
    if token and (token != token.strip() or not token.isprintable()):
        raise ValueError(f"--{prefix}-token must be printable without surrounding blanks")


def resolve_token(token: str, token_file: str, flag: str = "--auth-token-file") -> str:
    """The token itself: the flag's value, or the file's first line ('' when neither is set)."""
    if not token_file:
        return token
    text = _read(token_file, flag).decode().strip()
    if not text:
        raise ValueError(f"{flag} {token_file!r} is empty")
    return text.splitlines()[0].strip()


def server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials | None:
    """None means plaintext. With `ca`, clients must present a certificate signed by it (mTLS)."""
    if not cert:
        return None
    return grpc.ssl_server_credentials([(_read(key, "--tls-key"), _read(cert, "--tls-cert"))],
                                       root_certificates=_read(ca, "--tls-ca") if ca else None,
                                       require_client_auth=bool(ca))


def bind(server: grpc.aio.Server, address: str, creds: grpc.ServerCredentials | None, token: str) -> int:
    """Bind plaintext or TLS; warn when a non-loopback address is left open. Returns the port (0: failed)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if not _loopback(host) and (creds is None or not token):
        log.warning("listening on %s without %s: anyone who can reach this address can call it "
                    "(see docs/security.md)", address, " and ".join(
                        w for w, off in (("TLS", creds is None), ("a token", not token)) if off))
    return server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every call without `authorization: Bearer <token>` (health checks excepted)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        got = next((v for k, v in (details.invocation_metadata or ()) if k == AUTH_HEADER), None)
        if got is not None and hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED, as without a token
        why = ("missing 'authorization: Bearer <token>' metadata: this server requires the shared token "
               "(client: --auth-token or --auth-token-file)") if got is None else \
            "the bearer token does not match this server's --auth-token; check both sides use the same secret"
        return _refusal(handler, why)


def _refusal(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that reads raw bytes (garbage too) and answers UNAUTHENTICATED."""

    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](refuse)


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    return [TokenInterceptor(token)] if token else []


def channel_credentials(ca: str, cert: str = "", key: str = "", prefix: str = "tls") -> grpc.ChannelCredentials | None:
    """None means plaintext; `ca` verifies the server, cert+key present a client certificate (mTLS)."""
    if not ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, f"--{prefix}-ca"),
        private_key=_read(key, f"--{prefix}-key") if key else None,
        certificate_chain=_read(cert, f"--{prefix}-cert") if cert else None)


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server: TLS when `tls_ca` is set, a client certificate for mTLS, a token."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    auth_token: str = ""

    def channel(self, address: str, options=None) -> grpc.aio.Channel:
        creds = channel_credentials(self.tls_ca, self.tls_cert, self.tls_key)
        if creds is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, creds, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return ((AUTH_HEADER, f"Bearer {self.auth_token}"),) if self.auth_token else None
