"""Prefill server configuration: one frozen dataclass, validated once, CLI flags map 1:1."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtransfer.models import ModelSpec


@dataclass(frozen=True)
class PrefillConfig:
    listen: str = "127.0.0.1:50061"       # gRPC control plane (loopback unless told otherwise)
    model: str = "tiny"
    dtype: str = "float32"
    seed: int = 0
    device: str = "auto"                  # auto, cpu, cuda, cuda:N
    transport: str = "auto"               # auto (nccl on cuda, gloo on cpu), nccl, gloo
    dist_init: str = "env://"             # torch.distributed rendezvous, e.g. tcp://10.0.0.1:29500
    layers_per_message: int = 1           # group layers into one send
    layerwise_min_tokens: int = 0         # MODE_AUTO: prompts at least this long stream layer-wise, shorter ones bulk
    max_prompt_tokens: int = 32768
    send_timeout_s: float = 60.0
    dist_timeout_s: float = 120.0
    warmup_tokens: int = 128              # size of the warm-up transfer at start (0: none)
    deterministic: bool = False
    log_level: str = "INFO"

    def __post_init__(self):
        ModelSpec(self.model, self.dtype, self.seed)  # validates model and dtype
        if self.transport not in ("auto", "nccl", "gloo"):
            raise ValueError(f"--transport {self.transport!r}: choose auto, nccl or gloo")
        if self.layers_per_message < 1:
            raise ValueError("--layers-per-message must be >= 1")
        if self.max_prompt_tokens < 1:
            raise ValueError("--max-prompt-tokens must be >= 1")
        if self.layerwise_min_tokens < 0 or self.warmup_tokens < 0:
            raise ValueError("--layerwise-min-tokens and --warmup-tokens must be >= 0")
        if ":" not in self.listen:
            raise ValueError(f"--listen {self.listen!r}: expected HOST:PORT")

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.dtype, self.seed)

    def one_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())
