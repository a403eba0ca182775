"""Decode server configuration: one frozen dataclass, validated once, CLI flags map 1:1."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtransfer.models import ModelSpec


@dataclass(frozen=True)
class DecodeConfig:
    listen: str = "127.0.0.1:50051"       # the front door (loopback unless told otherwise)
    prefill_addr: str = "127.0.0.1:50061"  # the prefill worker's control plane
    colocated: bool = False               # no prefill peer: this worker prefills itself (baseline)
    model: str = "tiny"
    dtype: str = "float32"
    seed: int = 0
    device: str = "auto"
    transport: str = "auto"               # auto (nccl on cuda, gloo on cpu), nccl, gloo
    dist_init: str = "env://"
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 4096            # per request
    max_inflight: int = 64                # beyond it: RESOURCE_EXHAUSTED at once
    max_receive_bytes: int = 64 << 30     # one transfer's receive buffer limit
    request_timeout_s: float = 120.0      # each request ends before this (unless the client's deadline is sooner)
    handshake_timeout_s: float = 120.0
    dist_timeout_s: float = 120.0
    deterministic: bool = False
    log_level: str = "INFO"

    def __post_init__(self):
        ModelSpec(self.model, self.dtype, self.seed)
        if self.transport not in ("auto", "nccl", "gloo"):
            raise ValueError(f"--transport {self.transport!r}: choose auto, nccl or gloo")
        for name in ("max_prompt_tokens", "max_new_tokens", "max_inflight", "max_receive_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.request_timeout_s <= 0 or self.handshake_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if ":" not in self.listen:
            raise ValueError(f"--listen {self.listen!r}: expected HOST:PORT")

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.dtype, self.seed)

    def one_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())
