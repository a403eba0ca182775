"""`kvtransfer-api`: the OpenAI-compatible HTTP front of one decode server (uvicorn serving api_server.app).

Why the socket is bound here and handed to uvicorn: a port already taken, a tokenizer directory that does not
load or a certificate that does not parse then exits 2 with one line naming the flag, as the gRPC servers do
(kvtransfer.rpc.main), instead of a traceback or uvicorn's exit 1. SIGTERM/SIGINT: uvicorn stops accepting,
gives requests in flight --shutdown-grace-s (one still running then is answered 503, or its stream ended with an
error event: api_server/shutdown.py), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import ssl
import sys

from api_server.config import ApiConfig
from kvtransfer.rpc.configargs import from_args
from kvtransfer.rpc.flagchecks import split_address
from kvtransfer.rpc.security import ClientSecurity, resolve_token

log = logging.getLogger("kvtransfer.api")


def bind(listen: str) -> socket.socket:
    host, port = split_address("--listen", listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ValueError(f"--listen {listen}: cannot bind ({e.strerror or e})") from None


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _prepare(config: ApiConfig):
    """Everything that can refuse the start, in the order a reader checks flags; ValueError names the flag."""
    import uvicorn

    from api_server.app import build_app
    from api_server.auth import RequireToken
    from api_server.backend import Backend
    from api_server.metrics import ApiMetrics, CountResponses
    from api_server.shutdown import CutOffAtShutdown, Stopping
    from api_server.slow_clients import guarded_h11
    from api_server.text import TextCodec

    token = resolve_token(config.auth_token, config.auth_token_file)
    security = ClientSecurity(config.backend_tls_ca, config.backend_tls_cert, config.backend_tls_key,
                              resolve_token(config.backend_auth_token, config.backend_auth_token_file,
                                            "--backend-auth-token-file"))
    codec = TextCodec.load(path, "--tokenizer" if config.tokenizer else "--model") \
        if (path := config.tokenizer_dir()) else None
    if codec is None:
        log.warning("no tokenizer (--tokenizer DIR, or --model DIR): only token-id prompts are served")
    backend = Backend(config.backend, security, config.max_message_bytes, config.backend_keepalive_s,
                      config.request_timeout_s)
    metrics = ApiMetrics()
    app = build_app(config, backend, codec, metrics)
    if token:
        app = RequireToken(app, token)
    stopping = asyncio.Event()  # set when the shutdown begins (Stopping); only set and read, never awaited
    app = CutOffAtShutdown(app, stopping)  # at the grace's end, a request in flight is answered 503 / its stream ended
    app = CountResponses(app, metrics)  # outermost: a 500 from Starlette's last-resort handler is counted too
    host, port = split_address("--listen", config.listen)
    uv = uvicorn.Config(app, host=host, port=port, log_level=config.log_level.lower(), lifespan="on",
                        http=guarded_h11(config.header_timeout_s),
                        timeout_graceful_shutdown=config.shutdown_grace_s, ssl_certfile=config.tls_cert or None,
                        ssl_keyfile=config.tls_key or None, ssl_ca_certs=config.tls_ca or None,
                        ssl_cert_reqs=ssl.CERT_REQUIRED if config.tls_ca else ssl.CERT_NONE)
    try:
        uv.load()  # builds the TLS context: a certificate that does not parse is refused here
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--tls-cert/--tls-key/--tls-ca: cannot load ({e})") from None
    sock = bind(config.listen)
    if config.metrics_port:
        log.info("metrics on http://%s:%d/metrics", config.metrics_addr,
                 metrics.serve(config.metrics_port, config.metrics_addr))
    if not _loopback(host) and not (config.tls_cert and token):
        log.warning("listening on %s without %s: anyone who can reach this address can call it", config.listen,
                    " and ".join(w for w, off in (("TLS", not config.tls_cert), ("a token", not token)) if off))
    return Stopping(uv, stopping), sock


def main(argv: list[str] | None = None) -> None:
    config = from_args(ApiConfig, argv, "kvtransfer OpenAI-compatible HTTP front of one decode server",
                       "kvtransfer-api")
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log.info("config %s", config.one_line())
    try:
        server, sock = _prepare(config)
    except ValueError as e:
        log.error("cannot start: %s", e)
        sys.exit(2)
    log.info("serving the OpenAI API on %s://%s:%d for the decode server at %s",
             "https" if config.tls_cert else "http", *sock.getsockname()[:2], config.backend)
    # uvicorn handles SIGTERM/SIGINT itself (graceful stop), then re-raises the signal under the handlers it found
    # at start; these make that last raise a no-op, so a signal stop exits 0 as the gRPC servers' does
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    sys.exit(0 if server.started else 2)


if __name__ == "__main__":
    main()
