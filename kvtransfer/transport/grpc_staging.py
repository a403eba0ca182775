"""Host-side bytes for the gRPC backend: what the sender reads from, what the receiver writes to.

Why: gRPC moves host bytes, so a CUDA layer must reach host memory without stalling prefill.
Sender: a side stream waits on an event recorded on the compute stream (the compute stream
never waits, the host never syncs in `send_layer`), copies the layer into pinned staging
and records a second event that the shipping thread waits on. CPU tensors are read in
place (a zero-copy memoryview), so the CPU path never touches CUDA.
Receiver: chunks land in pinned host memory, and each completed layer is copied to the
device on a side stream; consumers order their stream after that copy by event. On CPU
the chunks land directly in the final (layers, 2, b, h, s, d) block.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ..streaming import kv_pair_view
from .base import TransferHeader


def byte_array(t: torch.Tensor) -> np.ndarray:
    """Zero-copy flat uint8 array over a CPU tensor (any dtype, bfloat16 included); copies only if strided."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(byte_array(t))


def wait_event(ev: torch.cuda.Event, stop: Callable[[], bool]) -> bool:
    """Poll a CUDA event (no blocking sync, so an abort is seen); False when `stop()` said so."""
    pause = 20e-6
    while not ev.query():
        if stop():
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


class D2HStager:
    """One side stream per device; `stage` returns (pinned bytes of K then V, event when they are there)."""

    def __init__(self):
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def stage(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        dev = key.device
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = torch.cuda.Stream(device=dev)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))
        side.wait_event(ready)  # the side stream waits for layer i's compute; the compute stream waits for nothing
        n = key.nbytes
        stage = torch.empty(2 * n, dtype=torch.uint8, pin_memory=True)  # K bytes then V bytes
        with torch.cuda.stream(side):
            kv = kv_pair_view(key, value)  # (2, b, h, s, d) when V directly follows K
            if kv is not None:
                stage.view(kv.dtype).view(kv.shape).copy_(kv, non_blocking=True)
            else:
                stage[:n].view(key.dtype).view(key.shape).copy_(key, non_blocking=True)
                stage[n:].view(value.dtype).view(value.shape).copy_(value, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        key.record_stream(side)  # the caller may free K/V now: the allocator waits for the copy
        value.record_stream(side)
        return stage, done


class Landing:
    """Receiver buffers for one request, sized from its (already checked) header.

    `flat` is the writable host bytes (uint8 array), layer i at [i * layer_bytes, (i + 1) * layer_bytes);
    numpy copies into it release the GIL, so stream handlers copy in parallel.
    """

    def __init__(self, header: TransferHeader, device: torch.device):
        self.device = device
        self.layer_bytes = header.layer_bytes()
        shape = (header.num_layers, 2, *header.layer_shape())  # (layers, 2, batch, kv_heads, seq, head_dim)
        self.block = torch.empty(shape, dtype=header.dtype, device=device)
        self._events: dict[int, torch.cuda.Event] = {}
        if device.type == "cuda":
            self._host = torch.empty(self.block.nbytes, dtype=torch.uint8, pin_memory=True)
            self._h2d = torch.cuda.Stream(device=device)
            self.block.record_stream(self._h2d)
            self.flat = self._host.numpy()
        else:
            self.flat = byte_array(self.block)

    def land(self, i: int) -> None:
        """Layer i's bytes are all in host memory: move them to the device (async on CUDA)."""
        if self.device.type != "cuda":
            return
        a, b = i * self.layer_bytes, (i + 1) * self.layer_bytes
        with torch.cuda.stream(self._h2d):
            self.block[i].view(-1).view(torch.uint8).copy_(self._host[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._h2d)
        self._events[i] = ev

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each (batch, kv_heads, seq, head_dim); the current stream is ordered after their copy."""
        ev = self._events.get(i)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        return self.block[i, 0], self.block[i, 1]
