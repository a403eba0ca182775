"""Decode server configuration: one frozen dataclass, validated once, CLI flags map 1:1.

Why two sets of TLS/token flags: the front door (users, the bench) and the channel to the
prefill worker (a peer inside the deployment) are different trust relationships; each is
configured on its own, and each is plaintext unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.configargs import one_line
from kvtransfer.models import ModelSpec
from kvtransfer.security import check_tls_flags, check_token_flags
from kvtransfer.serving import CONTROL_MESSAGE_LIMIT, check_message_limit, check_metrics_flags
from kvtransfer.transport.registry import options_from

ON_FAILURE = ("fail", "recompute")


@dataclass(frozen=True)
class DecodeConfig:
    listen: str = "127.0.0.1:50051"       # the front door (loopback unless told otherwise)
    prefill_addr: str = "127.0.0.1:50061"  # the prefill worker's control plane
    colocated: bool = False               # no prefill peer: this worker prefills itself (baseline)
    model: str = "tiny"
    dtype: str = "float32"
    seed: int = 0
    device: str = "auto"
    transport: str = "auto"               # auto (nccl on cuda, gloo on cpu), nccl, gloo, grpc, cuda_ipc
    data_listen: str = "127.0.0.1:0"      # grpc / cuda_ipc: where the data plane listens (announced at the handshake)
    data_tls_cert: str = ""               # grpc data plane: serve TLS with this certificate chain
    data_tls_key: str = ""                # grpc data plane: private key of --data-tls-cert
    data_tls_ca: str = ""                 # grpc data plane: require prefill client certificates signed by this CA
    ipc_slots: int = 2                    # cuda_ipc: receive slots of --max-prompt-tokens each
    grpc_listener_workers: int = 64       # grpc: concurrent data streams (>= the peer's channels x requests in flight)
    dist_op_timeout_s: float = 0.0        # nccl/gloo: one group operation's timeout (0: a week on NCCL, --dist-timeout-s on gloo)
    dist_init: str = "env://"
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 4096            # per request
    max_inflight: int = 64                # beyond it: RESOURCE_EXHAUSTED at once
    max_batch: int = 16                   # KV pool slots: requests decoded together (more wait for a slot)
    max_seq_len: int = 4096               # tokens per KV pool slot: prompt + max_new_tokens must fit
    cuda_graphs: bool = True              # capture the decode step as CUDA graphs per batch bucket (CUDA only)
    prefill_chunk: int = 0                # colocated/recompute prefill: tokens per chunk between decode steps (0: whole)
    admission_wait_s: float = 10.0        # longest wait for a free pool slot; then RESOURCE_EXHAUSTED
    stream_buffer_tokens: int = 1024      # tokens a client may leave unread; then its request ends
    max_receive_bytes: int = 64 << 30     # one transfer's receive buffer limit; larger prompts: RESOURCE_EXHAUSTED
    max_message_bytes: int = CONTROL_MESSAGE_LIMIT  # gRPC send/receive limit, both directions and to the peer
    request_timeout_s: float = 120.0      # each request ends before this (unless the client's deadline is sooner)
    on_failure: str = "fail"              # peer or data plane failed a request: fail (UNAVAILABLE) or recompute here
    peer_timeout_s: float = 30.0          # longest wait for the prefill worker's answer + cache; then --on-failure
    peer_keepalive_s: float = 2.0         # ping the prefill worker this often; unanswered as long: the link is down
    handshake_timeout_s: float = 120.0
    dist_timeout_s: float = 120.0
    tls_cert: str = ""                    # front door: PEM certificate chain, serve TLS
    tls_key: str = ""                     # front door: PEM private key of --tls-cert
    tls_ca: str = ""                      # front door: require client certificates signed by this CA (mTLS)
    auth_token: str = ""                  # front door: shared secret required as `authorization: Bearer ...`
    auth_token_file: str = ""             # front door: file holding that secret (first line)
    prefill_tls_ca: str = ""              # to the prefill worker: use TLS, verify its certificate with this CA
    prefill_tls_cert: str = ""            # to the prefill worker: client certificate (when it requires mTLS)
    prefill_tls_key: str = ""             # to the prefill worker: private key of --prefill-tls-cert
    prefill_auth_token: str = ""          # to the prefill worker: the token its --auth-token expects
    prefill_auth_token_file: str = ""     # to the prefill worker: file holding that token
    metrics_port: int = 0                 # Prometheus /metrics on this port (0: off)
    metrics_addr: str = "127.0.0.1"       # where /metrics listens (loopback unless told otherwise)
    deterministic: bool = False
    log_level: str = "INFO"

    def __post_init__(self):
        ModelSpec(self.model, self.dtype, self.seed)
        options_from(self, self.transport)  # the backend's options; refuses another backend's flags
        for name in ("max_prompt_tokens", "max_new_tokens", "max_inflight", "max_receive_bytes",
                     "max_message_bytes", "max_batch", "stream_buffer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_seq_len < 2:
            raise ValueError("--max-seq-len must be >= 2 (a prompt token and a generated one)")
        if self.prefill_chunk < 0:
            raise ValueError("--prefill-chunk must be >= 0 (0: prefill in one piece)")
        if self.admission_wait_s < 0:
            raise ValueError("--admission-wait-s must be >= 0")
        if min(self.request_timeout_s, self.handshake_timeout_s, self.peer_timeout_s, self.peer_keepalive_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"--on-failure {self.on_failure!r}: choose fail (end the request with UNAVAILABLE) or "
                             "recompute (prefill on this worker instead)")
        check_metrics_flags(self.metrics_port, self.metrics_addr)
        if ":" not in self.listen:
            raise ValueError(f"--listen {self.listen!r}: expected HOST:PORT")
        check_message_limit(self.max_message_bytes, self.max_prompt_tokens)
        check_tls_flags("tls", self.tls_cert, self.tls_key, self.tls_ca, server=True)
        check_tls_flags("data-tls", self.data_tls_cert, self.data_tls_key, self.data_tls_ca, server=True)
        check_tls_flags("prefill-tls", self.prefill_tls_cert, self.prefill_tls_key, self.prefill_tls_ca, server=False)
        check_token_flags("auth", self.auth_token, self.auth_token_file)
        check_token_flags("prefill-auth", self.prefill_auth_token, self.prefill_auth_token_file)

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.dtype, self.seed)

    def one_line(self) -> str:
        return one_line(self)
