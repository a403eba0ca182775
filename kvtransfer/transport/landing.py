"""Where a received layer lands: the receiving side's destination (the decode server's pool-slot views), checked
against the frame's header, and the one copy that puts each layer there.

Why one place for every backend: a layer reaches its pool slot the same way whatever carried it, received straight
into the destination when that is one contiguous block, else into a staging block with one device-local copy per
layer as it arrives; and a destination that does not match the frame fails that request, not the link.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvtransfer.transport.base import Destination, DestinationProvider, TransferError, TransferHeader, fresh_destination
from kvtransfer.transport.layout import contiguous_run, kv_block, kv_pair_view


class Landed:
    """A destination that is no tensors but a hand-off: each layer, once received (into the backend's staging or a
    block of its own), goes to `land(i, k, v)` exactly once, k and v (batch, kv_heads, seq, head_dim) on the
    receiving device, ordered before the current stream's work. The decode server's paged pool lands so: one
    scatter per layer into the request's blocks."""

    def __init__(self, land: Callable[[int, torch.Tensor, torch.Tensor], None]):
        self.land = land


def check_destination(h: TransferHeader, device: torch.device, dest: Destination | Landed) -> list | Landed:
    """A provider's destination must hold exactly the header's layers, shapes and dtype, on `device`."""
    if isinstance(dest, Landed):
        return dest
    dest, device = list(dest), torch.device(device)
    if len(dest) != h.num_layers:
        raise TransferError("protocol", f"request {h.request_id}: destination has {len(dest)} layers, "
                            f"the frame {h.num_layers}")
    want = h.layer_shape()
    for i, kv in enumerate(dest):
        for name, t in zip(("key", "value"), kv):
            if tuple(t.shape) != want or t.dtype != h.dtype or t.device != device:
                raise TransferError("protocol", f"request {h.request_id}: destination layer {i} {name} is "
                                    f"{tuple(t.shape)} {t.dtype} on {t.device}; the frame needs {want} {h.dtype} "
                                    f"on {device}")
    return dest


def destination_for(h: TransferHeader, device: torch.device, destinations: DestinationProvider | None):
    """(destination, None), or (None, the provider's TransferError): that frame is drained and fails."""
    if destinations is None:
        return fresh_destination(h, device), None
    try:
        return check_destination(h, device, destinations(h)), None
    except TransferError as e:
        return None, e


class Placement:
    """Where one request's layers are received (`block`, (layers, 2, b, h, s, d)) and where they end up.

    dest None: a provider failed; the frame is drained into a scratch block and dropped.
    staging: the backend already received into this block (gRPC on CPU): always copy from it.
    """

    def __init__(self, h: TransferHeader, device: torch.device, dest: list | Landed | None, staging=None):
        self.dest = dest
        self.landed = dest if isinstance(dest, Landed) else None
        if self.landed is not None:  # received into staging (the backend's, or a block of its own), then handed off
            self.direct, self.dest = False, None
            self.block = staging if staging is not None else kv_block(h.num_layers, h.layer_shape(), h.dtype, device)
            self._placed = [False] * h.num_layers
            return
        run = None
        if dest is not None and staging is None:
            pairs = [kv_pair_view(k, v) for k, v in dest]
            run = contiguous_run(pairs) if all(p is not None for p in pairs) else None
        self.direct = run is not None
        if run is None and staging is None:
            staging = kv_block(h.num_layers, h.layer_shape(), h.dtype, device)
        self.block = run if run is not None else staging
        self._placed = [self.direct or (dest is not None and dest[0][0].data_ptr() == staging[0, 0].data_ptr())
                        ] * h.num_layers

    def place(self, i: int) -> None:
        """Layer i is in `block[i]` (ordered before the current stream's work): copy it to its destination."""
        if self.landed is not None and not self._placed[i]:
            self.landed.land(i, self.block[i, 0], self.block[i, 1])
            self._placed[i] = True
        if self._placed[i] or self.dest is None:
            return
        k, v = self.dest[i]
        k.copy_(self.block[i, 0], non_blocking=True)  # device-local, on the current stream
        v.copy_(self.block[i, 1], non_blocking=True)
        self._placed[i] = True

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.place(i)
        return self.dest[i] if self.dest is not None else (self.block[i, 0], self.block[i, 1])
