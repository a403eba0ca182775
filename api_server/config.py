"""The API front's configuration: one frozen dataclass, validated once, CLI flags map 1:1 (kvtransfer.rpc.configargs).

Why two sets of TLS/token flags, as on the decode server: HTTP clients (the OpenAI API key is the bearer token)
and the gRPC channel to the decode server are different trust relationships, each configured on its own and
plaintext unless told otherwise. The front door's names (`--tls-*`, `--auth-token*`) are the decode server's, so
a deployment secures both the same way; the backend's are `--backend-*`, as the decode server's are `--prefill-*`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtransfer.rpc.configargs import LOG_LEVELS, check_choices, flag, one_line
from kvtransfer.rpc.flagchecks import check_address, check_positive, check_seconds
from kvtransfer.rpc.limits import CONTROL_MESSAGE_LIMIT, check_message_limit
from kvtransfer.rpc.metrics import check_metrics_flags
from kvtransfer.rpc.security import check_tls_flags, check_token_flags

MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt is about 1 MiB as JSON token ids, 0.5 MiB as text
MAX_PROMPTS = 64  # OpenAI's batch form is for a handful; each prompt is a Generate call, all sent at once


@dataclass(frozen=True)
class ApiConfig:
    listen: str = flag("127.0.0.1:8000", "the HTTP front, HOST:PORT (loopback unless told otherwise)")
    backend: str = flag("127.0.0.1:50051", "the decode server's front door (gRPC), HOST:PORT")
    served_model_name: str = flag("", "the model name clients send and /v1/models lists (default: the decode "
                                  "server's Info.model)")
    tokenizer: str = flag("", "local tokenizer directory (no downloads); without it, text prompts and chat are "
                          "refused and token-id prompts still work")
    model: str = flag("", "the local Hugging Face model directory the decode server serves: its tokenizer is used "
                      "when --tokenizer is not given (a preset name is ignored here)")
    request_timeout_s: float = flag(600.0, "deadline of one backend Generate call, s (the decode server's "
                                    "--request-timeout-s may end it sooner)")
    backend_keepalive_s: float = flag(10.0, "ping the decode server this often, s; unanswered as long: its calls "
                                      "fail UNAVAILABLE (503) instead of hanging")
    health_timeout_s: float = flag(2.0, "GET /health: wait this long for the decode server's health answer, s")
    shutdown_grace_s: float = flag(20.0, "on SIGTERM/SIGINT: time requests in flight get to finish, s")
    header_timeout_s: float = flag(10.0, "a request's line and headers must arrive within this, s, from the moment "
                                   "its connection opens or the response before it ends; else 408 and the "
                                   "connection is closed (slow clients)")
    body_timeout_s: float = flag(60.0, "a request's body must arrive within this, s, after its headers; else 408 "
                                 "and the connection is closed")
    max_message_bytes: int = flag(CONTROL_MESSAGE_LIMIT, "gRPC send/receive limit to the decode server; a prompt "
                                  "whose request is larger is refused 400")
    max_body_bytes: int = flag(MAX_BODY_BYTES, "largest HTTP request body, bytes; larger: 413, refused before it is "
                               "read")
    max_prompts_per_request: int = flag(MAX_PROMPTS, "most prompts in one /v1/completions body, each one Generate "
                                        "call, all at once (keep it within the decode server's --max-inflight "
                                        "when that is set); more: 400")
    tls_cert: str = flag("", "HTTP front: PEM certificate chain, serve HTTPS")
    tls_key: str = flag("", "HTTP front: PEM private key of --tls-cert")
    tls_ca: str = flag("", "HTTP front: require client certificates signed by this CA (mTLS)")
    auth_token: str = flag("", "HTTP front: shared secret required as `Authorization: Bearer ...` (the OpenAI API "
                           "key; prefer the file)")
    auth_token_file: str = flag("", "HTTP front: file holding that secret (first line)")
    backend_tls_ca: str = flag("", "to the decode server: use TLS, verify its certificate with this CA")
    backend_tls_cert: str = flag("", "to the decode server: client certificate (when it requires mTLS)")
    backend_tls_key: str = flag("", "to the decode server: private key of --backend-tls-cert")
    backend_auth_token: str = flag("", "to the decode server: the token its --auth-token expects")
    backend_auth_token_file: str = flag("", "to the decode server: file holding that token")
    metrics_port: int = flag(0, "Prometheus /metrics on this port (0: off)")
    metrics_addr: str = flag("127.0.0.1", "where /metrics listens (loopback unless told otherwise)")
    log_level: str = flag("INFO", "log level", choices=LOG_LEVELS)

    def __post_init__(self):
        check_address("--listen", self.listen)
        check_address("--backend", self.backend, allow_port_zero=False)
        check_positive(self, "request_timeout_s", "backend_keepalive_s", "health_timeout_s", "max_body_bytes",
                       "max_prompts_per_request", "header_timeout_s", "body_timeout_s")
        if self.max_message_bytes < 1 or self.shutdown_grace_s < 0:
            raise ValueError("--max-message-bytes must be >= 1 and --shutdown-grace-s >= 0")
        check_seconds(self, "shutdown_grace_s")
        check_message_limit(self.max_message_bytes, 0)
        if self.tokenizer and not os.path.isdir(self.tokenizer):
            raise ValueError(f"--tokenizer {self.tokenizer!r}: no such directory (a local tokenizer directory; "
                             "nothing is downloaded)")
        check_choices(self)
        check_metrics_flags(self.metrics_port, self.metrics_addr)
        check_tls_flags("tls", self.tls_cert, self.tls_key, self.tls_ca, server=True)
        check_tls_flags("backend-tls", self.backend_tls_cert, self.backend_tls_key, self.backend_tls_ca, server=False)
        check_token_flags("auth", self.auth_token, self.auth_token_file)
        check_token_flags("backend-auth", self.backend_auth_token, self.backend_auth_token_file)

    def tokenizer_dir(self) -> str:
        """Where the tokenizer comes from: --tokenizer, else --model when it is a local directory, else none."""
        if self.tokenizer:
            return self.tokenizer
        return self.model if self.model and os.path.isdir(self.model) else ""

    def one_line(self) -> str:
        return one_line(self)
