"""Prefill server configuration: one frozen dataclass, validated once, CLI flags map 1:1.

Why every limit is here: a limit that is not a flag cannot be fitted to a deployment,
and one that is not validated at start fails later, in the middle of a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.model.loaded import resolve_dtype
from kvtransfer.model.spec import ModelSpec
from kvtransfer.rpc.configargs import LOG_LEVELS, check_choices, flag, one_line
from kvtransfer.rpc.flagchecks import check_address, check_device, check_dist_init, check_positive, check_seconds
from kvtransfer.rpc.limits import CONTROL_MESSAGE_LIMIT, MAX_WAITING, check_message_limit
from kvtransfer.rpc.metrics import check_metrics_flags
from kvtransfer.rpc.security import check_tls_flags, check_token_flags
from kvtransfer.transport.registry import options_from


@dataclass(frozen=True)
class PrefillConfig:
    listen: str = flag("127.0.0.1:50061", "gRPC control plane, HOST:PORT (loopback unless told otherwise)")
    model: str = flag("tiny", "a preset (tiny, smollm2-135m, qwen2.5-7b: seeded random weights) or a local "
                      "Hugging Face directory; must match the decode worker's")
    dtype: str = flag("auto", "weights and KV cache dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, "
                      "bfloat16, float16; must match the decode worker's")
    seed: int = flag(0, "seed of a preset's random weights; must match the decode worker's")
    device: str = flag("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    transport: str = flag("auto", "data plane: auto (nccl on cuda, gloo on cpu), nccl, gloo, grpc, cuda_ipc")
    grpc_channels: int = flag(4, "grpc: parallel connections per transfer")
    grpc_chunk_bytes: int = flag(4 << 20, "grpc: payload bytes per message")
    grpc_abort_cancel_s: float = flag(5.0, "grpc: after an abort, cancel streams that have not ended by then, s")
    data_tls_ca: str = flag("", "grpc data plane: use TLS, verify the decode side's certificate with this CA")
    data_tls_cert: str = flag("", "grpc data plane: client certificate (when the decode side requires mTLS)")
    data_tls_key: str = flag("", "grpc data plane: private key of --data-tls-cert")
    checksum: str = flag("xxh3", "grpc: per-layer checksum verified on receive (xxh3 or none)")
    dist_init: str = flag("env://", "nccl/gloo rendezvous this worker hosts: env://, tcp://HOST:PORT or "
                          "file:///PATH")
    layers_per_message: int = flag(1, "nccl/gloo: group layers into one send")
    dist_op_timeout_s: float = flag(0.0, "nccl/gloo: one group operation's timeout, s (0: a week on NCCL, "
                                    "--dist-timeout-s on gloo)")
    ipc_slot_timeout_s: float = flag(30.0, "cuda_ipc: how long a transfer waits for a free receive slot, s")
    layerwise_min_tokens: int = flag(-1, "MODE_AUTO: prompts this long stream layer-wise, shorter bulk; -1: measured "
                                     "per transport (policy.py)")
    max_prompt_tokens: int = flag(32768, "longest prompt accepted; longer: INVALID_ARGUMENT")
    max_inflight: int = flag(MAX_WAITING, "Prefill calls admitted at once, run one by one (a queue: each decode "
                             "worker sends one per request it admits, up to its --max-batch rows at once); beyond: "
                             "RESOURCE_EXHAUSTED")
    max_message_bytes: int = flag(CONTROL_MESSAGE_LIMIT, "gRPC send/receive limit; larger: RESOURCE_EXHAUSTED")
    send_timeout_s: float = flag(60.0, "longest a transfer may take to be sent (and a link to connect), s")
    dist_timeout_s: float = flag(120.0, "nccl/gloo: hosting the rendezvous and joining the process group, s")
    max_pending_pairings: int = flag(16, "nccl/gloo: process groups being joined at once, a thread each until the "
                                     "decode side joins, goes or --dist-timeout-s passes; a handshake from another "
                                     "decode worker beyond: RESOURCE_EXHAUSTED (it retries)")
    shutdown_grace_s: float = flag(20.0, "on SIGTERM/SIGINT: time in-flight requests get to finish, s; the rest "
                                   "end UNAVAILABLE")
    warmup_tokens: int = flag(128, "warm-up at each pairing (0: none); must fit the peer's --max-receive-bytes")
    fail_after_layers: int = flag(-1, "fault injection (tests): hold a transfer after this many layers (-1: off)",
                                  hidden=True)
    fail_stall_s: float = flag(30.0, "fault injection: how long each held transfer stalls before it goes on, s",
                               hidden=True)
    fail_requests: int = flag(1, "fault injection: how many requests (after the warm-up) are held", hidden=True)
    metrics_port: int = flag(0, "Prometheus /metrics on this port (0: off)")
    metrics_addr: str = flag("127.0.0.1", "where /metrics listens (loopback unless told otherwise)")
    tls_cert: str = flag("", "PEM certificate chain: serve TLS")
    tls_key: str = flag("", "PEM private key of --tls-cert")
    tls_ca: str = flag("", "PEM CA bundle: require client certificates signed by it (mTLS)")
    auth_token: str = flag("", "shared secret required as `authorization: Bearer ...` (prefer the file)")
    auth_token_file: str = flag("", "file holding the shared secret (first line)")
    deterministic: bool = flag(False, "deterministic kernels (run-to-run identical logits on GPU; slower)")
    batch_invariant: bool = flag(False, "prefill as the decode worker's --batch-invariant steps do (every prompt "
                                 "row a decode row of batch-invariant ops), so its cache and first token are the "
                                 "bits that decode worker would make; both sides must agree (handshake). CPU "
                                 "and CUDA")
    log_level: str = flag("INFO", "log level", choices=LOG_LEVELS)

    def __post_init__(self):
        ModelSpec(self.model, "float32" if self.dtype == "auto" else self.dtype, self.seed)  # validates both
        options_from(self, self.transport)  # the backend's options; refuses another backend's flags
        for name in ("max_prompt_tokens", "max_inflight", "max_message_bytes", "max_pending_pairings"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.warmup_tokens > self.max_prompt_tokens:
            raise ValueError(f"--warmup-tokens {self.warmup_tokens} is over --max-prompt-tokens "
                             f"{self.max_prompt_tokens}: the warm-up is a prompt too; lower it (0: no warm-up)")
        if self.layerwise_min_tokens < -1 or self.warmup_tokens < 0:
            raise ValueError("--layerwise-min-tokens must be >= -1 (-1: the measured default) and --warmup-tokens >= 0")
        if self.fail_after_layers < -1 or self.fail_stall_s < 0 or self.fail_requests < 1:
            raise ValueError("--fail-after-layers must be >= -1 (-1: off), --fail-stall-s >= 0, --fail-requests >= 1")
        check_positive(self, "send_timeout_s", "dist_timeout_s")
        if self.dist_op_timeout_s < 0 or self.shutdown_grace_s < 0:
            raise ValueError("--dist-op-timeout-s and --shutdown-grace-s must be >= 0")
        check_seconds(self, "dist_op_timeout_s", "shutdown_grace_s", "fail_stall_s")
        check_choices(self)
        check_device("--device", self.device)
        check_metrics_flags(self.metrics_port, self.metrics_addr)
        check_address("--listen", self.listen)
        check_dist_init("--dist-init", self.dist_init)
        check_message_limit(self.max_message_bytes, self.max_prompt_tokens)
        check_tls_flags("tls", self.tls_cert, self.tls_key, self.tls_ca, server=True)
        check_tls_flags("data-tls", self.data_tls_cert, self.data_tls_key, self.data_tls_ca, server=False)
        check_token_flags("auth", self.auth_token, self.auth_token_file)

    def spec(self, device) -> ModelSpec:
        """The model on `device`: --dtype auto resolved there."""
        return ModelSpec(self.model, resolve_dtype(self.dtype, device), self.seed)

    def one_line(self) -> str:
        return one_line(self)
