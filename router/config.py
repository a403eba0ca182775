"""The router's configuration: one frozen dataclass, validated once, CLI flags map 1:1 (kvtransfer.rpc.configargs).

Why `--worker` is the one flag parsed apart: it is repeated (one per decode worker), which configargs' one-value
flags do not express; `from_args` lets argparse collect it (`action="append"`, each value may also be a
comma-separated list) and everything else stays configargs' own. Why two token flag pairs, as on the decode server:
the router's callers and the decode workers behind it are different trust relationships; a caller's
`authorization` metadata is never forwarded to a worker (the router presents its own, when told to). The same holds
for TLS: `--tls-*` is the front door's (as the decode server's), `--worker-tls-*` the router's side of its
connections to the workers (docs/router.md, "Security").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.rpc.configargs import LOG_LEVELS, Parser, add_arguments, check_choices, flag, one_line
from kvtransfer.rpc.flagchecks import check_address, check_positive, check_seconds
from kvtransfer.rpc.limits import CONTROL_MESSAGE_LIMIT, check_message_limit
from kvtransfer.rpc.metrics import check_metrics_flags
from kvtransfer.rpc.security import check_tls_flags, check_token_flags

POLICIES = ("least_loaded", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    listen: str = flag("127.0.0.1:50050", "the router's front door (gRPC Decode service), HOST:PORT (loopback "
                       "unless told otherwise)")
    worker: tuple = flag((), "a decode worker's front door, HOST:PORT; repeat the flag (or give a comma-separated "
                         "list) for each worker; at least one, here or in --worker-file")
    worker_file: str = flag("", "a file of decode workers, HOST:PORT a line (# starts a comment), beside --worker: "
                            "read at start and again on SIGHUP (a worker added takes requests once a poll finds it "
                            "serving; one removed takes no new request and its requests in flight finish)")
    policy: str = flag("least_loaded", "placement: least_loaded (the fewest context + still-to-generate tokens, with "
                       "prefix affinity) or round_robin (the baseline: healthy workers in turn)", choices=POLICIES)
    load_poll_s: float = flag(0.2, "ask every worker for its Load this often, s (its health follows the answer)")
    load_timeout_s: float = flag(2.0, "a Load poll unanswered this long marks the worker unhealthy, s")
    request_timeout_s: float = flag(120.0, "each request ends before this, s (unless the caller's deadline is "
                                    "sooner); the worker gets what is left of it")
    prefix_affinity: bool = flag(True, "least_loaded: send a prompt to the worker that served the longest known "
                                 "prefix of it (its prefix cache holds that KV), unless that worker is "
                                 "--affinity-slack-tokens more loaded than the least loaded one")
    affinity_slack_tokens: int = flag(4096, "how much more loaded (tokens) the worker holding a prompt's prefix "
                                      "may be than the least loaded worker and still get the prompt")
    affinity_max_keys: int = flag(100_000, "prefix blocks remembered (least recently used dropped first)")
    max_message_bytes: int = flag(CONTROL_MESSAGE_LIMIT, "gRPC send/receive limit, callers and workers")
    shutdown_grace_s: float = flag(20.0, "on SIGTERM/SIGINT: time in-flight requests get to finish, s; the rest "
                                   "end UNAVAILABLE")
    auth_token: str = flag("", "front door: shared secret required as `authorization: Bearer ...` (prefer the file)")
    auth_token_file: str = flag("", "front door: file holding that secret (first line)")
    tls_cert: str = flag("", "front door: serve TLS with this certificate chain (PEM)")
    tls_key: str = flag("", "front door: private key of --tls-cert (PEM)")
    tls_ca: str = flag("", "front door: require client certificates signed by this CA (PEM): mTLS")
    worker_tls_ca: str = flag("", "to the decode workers: TLS, verifying their certificates against this CA (PEM)")
    worker_tls_cert: str = flag("", "to the decode workers: this client certificate (PEM), for their --tls-ca")
    worker_tls_key: str = flag("", "to the decode workers: private key of --worker-tls-cert (PEM)")
    worker_auth_token: str = flag("", "to the decode workers: the token their --auth-token expects")
    worker_auth_token_file: str = flag("", "to the decode workers: file holding that token")
    metrics_port: int = flag(0, "Prometheus /metrics on this port (0: off)")
    metrics_addr: str = flag("127.0.0.1", "where /metrics listens (loopback unless told otherwise)")
    log_level: str = flag("INFO", "log level", choices=LOG_LEVELS)

    def __post_init__(self):
        workers = tuple(a.strip() for item in self.worker for a in str(item).split(",") if a.strip())
        object.__setattr__(self, "worker", workers)
        if len(set(workers)) != len(workers):
            raise ValueError(f"--worker: {', '.join(workers)} names a worker twice")
        for addr in workers:
            check_address("--worker", addr, allow_port_zero=False)
        if not self.workers():  # reads --worker-file: a bad line is a ValueError naming it
            raise ValueError("--worker: give at least one decode worker, HOST:PORT (repeat the flag for more), or "
                             "list them in --worker-file")
        check_address("--listen", self.listen)
        check_positive(self, "load_poll_s", "load_timeout_s", "request_timeout_s", "affinity_max_keys",
                       "max_message_bytes")
        if self.affinity_slack_tokens < 0 or self.shutdown_grace_s < 0:
            raise ValueError("--affinity-slack-tokens and --shutdown-grace-s must be >= 0")
        check_seconds(self, "shutdown_grace_s")
        check_message_limit(self.max_message_bytes, 0)
        check_choices(self)
        check_metrics_flags(self.metrics_port, self.metrics_addr)
        check_token_flags("auth", self.auth_token, self.auth_token_file)
        check_token_flags("worker-auth", self.worker_auth_token, self.worker_auth_token_file)
        check_tls_flags("tls", self.tls_cert, self.tls_key, self.tls_ca, server=True)
        check_tls_flags("worker-tls", self.worker_tls_cert, self.worker_tls_key, self.worker_tls_ca, server=False)

    def one_line(self) -> str:
        return one_line(self)

    def workers(self) -> tuple[str, ...]:
        """Every worker now: --worker's, then --worker-file's as the file reads now (once each, in that order)."""
        listed = read_worker_file(self.worker_file) if self.worker_file else ()
        return tuple(dict.fromkeys([*self.worker, *listed]))


def read_worker_file(path: str) -> tuple[str, ...]:
    """--worker-file's workers: HOST:PORT a line, blank lines and # comments skipped. ValueError when it cannot be
    read, or naming the file and line of a bad address or a worker listed twice."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--worker-file {path}: cannot read it: {e}") from None
    out: list[str] = []
    for n, line in enumerate(lines, 1):
        addr = line.split("#", 1)[0].strip()
        if not addr:
            continue
        try:
            check_address("--worker-file", addr, allow_port_zero=False)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        if addr in out:
            raise ValueError(f"{path}:{n}: {addr} is listed twice")
        out.append(addr)
    return tuple(out)


def from_args(argv: list[str] | None, prog: str = "kvtransfer-router") -> RouterConfig:
    """Flags -> RouterConfig; a bad value exits 2 with one line naming the flag (configargs' Parser)."""
    parser = Parser(prog=prog, description="kvtransfer router: one Decode front door over several decode workers",
                    conflict_handler="resolve")
    add_arguments(parser, RouterConfig)
    parser.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                        help=RouterConfig.__dataclass_fields__["worker"].metadata["help"])
    ns = parser.parse_args(argv)
    try:
        return RouterConfig(**vars(ns))
    except ValueError as e:
        parser.error(str(e))
