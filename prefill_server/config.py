"""Prefill server configuration: one frozen dataclass, validated once, CLI flags map 1:1.

Why every limit is here: a limit that is not a flag cannot be fitted to a deployment,
and one that is not validated at start fails later, in the middle of a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.configargs import one_line
from kvtransfer.models import ModelSpec
from kvtransfer.security import check_tls_flags, check_token_flags
from kvtransfer.transport.registry import options_from
from kvtransfer.serving import CONTROL_MESSAGE_LIMIT, check_message_limit, check_metrics_flags


@dataclass(frozen=True)
class PrefillConfig:
    listen: str = "127.0.0.1:50061"       # gRPC control plane (loopback unless told otherwise)
    model: str = "tiny"
    dtype: str = "float32"
    seed: int = 0
    device: str = "auto"                  # auto, cpu, cuda, cuda:N
    transport: str = "auto"               # auto (nccl on cuda, gloo on cpu), nccl, gloo, grpc, cuda_ipc
    grpc_channels: int = 4                # grpc: parallel connections per transfer
    grpc_chunk_bytes: int = 4 << 20       # grpc: payload bytes per message
    grpc_abort_cancel_s: float = 5.0      # grpc: after an abort, cancel streams that have not ended by then
    data_tls_ca: str = ""                 # grpc data plane: use TLS, verify the decode side's certificate with this CA
    data_tls_cert: str = ""               # grpc data plane: client certificate (when the decode side requires mTLS)
    data_tls_key: str = ""                # grpc data plane: private key of --data-tls-cert
    checksum: str = "xxh3"                # grpc: per-layer checksum verified on receive (xxh3 or none)
    dist_init: str = "env://"             # torch.distributed rendezvous, e.g. tcp://10.0.0.1:29500
    layers_per_message: int = 1           # nccl/gloo: group layers into one send
    dist_op_timeout_s: float = 0.0        # nccl/gloo: one group operation's timeout (0: a week on NCCL, --dist-timeout-s on gloo)
    ipc_slot_timeout_s: float = 30.0      # cuda_ipc: how long a transfer waits for a free receive slot
    layerwise_min_tokens: int = -1        # MODE_AUTO: prompts this long stream layer-wise, shorter bulk; -1: measured per transport (policy.py)
    max_prompt_tokens: int = 32768
    max_inflight: int = 64                # Prefill calls admitted at once (run one by one); beyond: RESOURCE_EXHAUSTED
    max_message_bytes: int = CONTROL_MESSAGE_LIMIT  # gRPC send/receive limit; larger: RESOURCE_EXHAUSTED
    send_timeout_s: float = 60.0
    dist_timeout_s: float = 120.0
    warmup_tokens: int = 128              # warm-up at each pairing (0: none); must fit the peer's --max-receive-bytes
    fail_after_layers: int = -1           # fault injection (tests): hold a transfer after this many layers (-1: off)
    fail_stall_s: float = 30.0            # fault injection: how long each held transfer stalls before it goes on
    fail_requests: int = 1                # fault injection: how many requests (after the warm-up) are held
    metrics_port: int = 0                 # Prometheus /metrics on this port (0: off)
    metrics_addr: str = "127.0.0.1"       # where /metrics listens (loopback unless told otherwise)
    tls_cert: str = ""                    # PEM certificate chain: serve TLS
    tls_key: str = ""                     # PEM private key of --tls-cert
    tls_ca: str = ""                      # PEM CA bundle: require client certificates signed by it (mTLS)
    auth_token: str = ""                  # shared secret required as `authorization: Bearer ...` (prefer the file)
    auth_token_file: str = ""             # file holding the shared secret (first line)
    deterministic: bool = False
    log_level: str = "INFO"

    def __post_init__(self):
        ModelSpec(self.model, self.dtype, self.seed)  # validates model and dtype
        options_from(self, self.transport)  # the backend's options; refuses another backend's flags
        for name in ("max_prompt_tokens", "max_inflight", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.layerwise_min_tokens < -1 or self.warmup_tokens < 0:
            raise ValueError("--layerwise-min-tokens must be >= -1 (-1: the measured default) and --warmup-tokens >= 0")
        if self.fail_after_layers < -1 or self.fail_stall_s < 0 or self.fail_requests < 1:
            raise ValueError("--fail-after-layers must be >= -1 (-1: off), --fail-stall-s >= 0, --fail-requests >= 1")
        check_metrics_flags(self.metrics_port, self.metrics_addr)
        if ":" not in self.listen:
            raise ValueError(f"--listen {self.listen!r}: expected HOST:PORT")
        check_message_limit(self.max_message_bytes, self.max_prompt_tokens)
        check_tls_flags("tls", self.tls_cert, self.tls_key, self.tls_ca, server=True)
        check_tls_flags("data-tls", self.data_tls_cert, self.data_tls_key, self.data_tls_ca, server=False)
        check_token_flags("auth", self.auth_token, self.auth_token_file)

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.dtype, self.seed)

    def one_line(self) -> str:
        return one_line(self)
