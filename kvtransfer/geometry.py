"""Cache geometry: how many bytes one token of KV cache costs, and what a layer looks like.

Why: every size decision (receive buffers, break-even link speed, limits) starts here,
and both workers must agree on it before a single byte moves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> "CacheGeometry":
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, dtype)

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.elem_size

    def layer_shape(self, seq_len: int, batch: int = 1) -> tuple[int, int, int, int]:
        return (batch, self.kv_heads, seq_len, self.head_dim)  # (batch, kv_heads, seq, head_dim)

    def layer_bytes(self, seq_len: int) -> int:
        """Bytes of one layer's K plus V."""
        return self.bytes_per_token * seq_len // self.num_layers

    def cache_bytes(self, seq_len: int) -> int:
        return self.bytes_per_token * seq_len

    def digest(self) -> str:
        return hashlib.sha256(
            f"{self.num_layers}/{self.kv_heads}/{self.head_dim}/{self.dtype}/bhsd".encode()
        ).hexdigest()[:16]
