"""Host-side bytes for the gRPC backend: what the sender reads from, what the receiver writes to.

Why: gRPC moves host bytes, so a CUDA layer must reach host memory without stalling prefill.
Sender: a side stream waits on an event recorded on the compute stream (the compute stream
never waits, the host never syncs in `send_layer`), copies the layer into pinned staging
and records a second event that the shipping thread waits on. CPU tensors are read in
place (a zero-copy memoryview), so the CPU path never touches CUDA.
Receiver: chunks land in host memory as they arrive, possibly before `accept` has named
the destination. On CUDA that is pinned memory and each complete layer of a bound request
is copied to the device on a side stream (straight into a contiguous destination, else via
a device staging block and one device-local copy); consumers order their stream after it
by event. On CPU the chunks land in a (layers, 2, b, h, s, d) block that is the destination
itself by default; a provider's destination gets one copy per layer as it lands.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kvtransfer.transport.base import TransferError, TransferHeader
from kvtransfer.transport.landing import Placement, destination_for
from kvtransfer.transport.layout import byte_array, kv_block, kv_pair_view


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
    """Receive memory for one request, sized from its (already checked) header.

    `flat` is the writable host bytes (uint8 array), layer i at [i * layer_bytes, (i + 1) * layer_bytes);
    numpy copies into it release the GIL, so stream handlers copy in parallel. `land(i)`: layer i's
    bytes are all in; `bind(provider)` (at accept) names the destination.
    """

    def __init__(self, header: TransferHeader, device: torch.device):
        self.header, self.device = header, device
        self.layer_bytes = header.layer_bytes()
        self.placement: Placement | None = None
        self._landed = [False] * header.num_layers
        self._events: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()
        if device.type == "cuda":
            self._host = torch.empty(header.total_bytes(), dtype=torch.uint8, pin_memory=True)
            self._h2d = torch.cuda.Stream(device=device)
            self.flat = self._host.numpy()
        else:  # (layers, 2, batch, kv_heads, seq, head_dim), the chunks' landing place
            self._own = kv_block(header.num_layers, header.layer_shape(), header.dtype, device)
            self.flat = byte_array(self._own)

    def bind(self, destinations) -> TransferError | None:
        h, cpu = self.header, self.device.type != "cuda"
        if destinations is None and cpu:
            dest, err = [(self._own[i, 0], self._own[i, 1]) for i in range(h.num_layers)], None
        else:
            dest, err = destination_for(h, self.device, destinations)
        if err is not None:
            return err
        p = Placement(h, self.device, dest, staging=self._own if cpu else None)
        if not cpu:
            p.block.record_stream(self._h2d)
            # the copies run on _h2d: order them after what the current stream did to the destination (its
            # allocation's fill under deterministic mode, a previous owner's reads of a pool slot)
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        with self._lock:
            self.placement = p
            for i, landed in enumerate(self._landed):
                if landed:
                    self._deliver(i)
        return None

    def land(self, i: int) -> None:
        """Layer i's bytes are all in host memory: place them once the destination is known."""
        with self._lock:
            self._landed[i] = True
            if self.placement is not None:
                self._deliver(i)

    def _deliver(self, i: int) -> None:
        p = self.placement
        if self.device.type != "cuda":
            p.place(i)
            return
        a, b = i * self.layer_bytes, (i + 1) * self.layer_bytes
        with torch.cuda.stream(self._h2d):
            p.block[i].view(-1).view(torch.uint8).copy_(self._host[a:b], non_blocking=True)
            p.place(i)
            ev = torch.cuda.Event()
            ev.record(self._h2d)
        self._events[i] = ev

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each (batch, kv_heads, seq, head_dim); the current stream is ordered after their copy."""
        ev = self._events.get(i)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        return self.placement.layer(i)
