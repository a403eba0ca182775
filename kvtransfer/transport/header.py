"""What one request is and where its layers land: the header (sent before any layer) and a destination.

Why beside base.py: the interface names them but they are data, not verbs; frames.py encodes and
checks the header on every wire, and landing.py places received layers into a destination.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TransferHeader:
    """Sent before any layer, so the receiver sizes (or finds) the right memory for the right request."""
    request_id: int
    seq_len: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    batch: int = 1

    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.seq_len, self.head_dim)  # (batch, kv_heads, seq, head_dim)

    def layer_bytes(self) -> int:
        """Bytes of one layer's K plus V."""
        b, h, s, d = self.layer_shape()
        return 2 * b * h * s * d * torch.empty((), dtype=self.dtype).element_size()

    def total_bytes(self) -> int:
        return self.layer_bytes() * self.num_layers


# Per layer (k, v), each with header.layer_shape() and header.dtype, on the receiving device. They MAY be
# non-contiguous views (e.g. a slice of a KV pool laid out (slots, kv_heads, max_seq, head_dim)).
Destination = Sequence[tuple[torch.Tensor, torch.Tensor]]
DestinationProvider = Callable[[TransferHeader], Destination]  # may raise TransferError: the frame is drained


def fresh_destination(header: TransferHeader, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The default: one contiguous (layers, 2, batch, kv_heads, seq, head_dim) block, K/V adjacent."""
    block = torch.empty((header.num_layers, 2, *header.layer_shape()), dtype=header.dtype, device=device)
    return [(block[i, 0], block[i, 1]) for i in range(header.num_layers)]
