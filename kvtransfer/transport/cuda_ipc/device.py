"""The device half of cuda_ipc: IPC memory and event handles, and the per-layer copy.

Why isolated: everything CUDA-specific that the transport does is in `CudaOps` (a dozen
small methods), so the protocol, the pool and the state machine (sender.py) run on CPU
against `LocalOps`, an in-process stand-in whose "handles" name objects of this process
(two threads, one real socket). `CudaOps` follows torch/multiprocessing/reductions.py:
`storage._share_cuda_()` -> (device, handle, size, offset, ref-counter file, ref-counter
offset, event handle, event_sync_required) and `torch.UntypedStorage._new_shared_cuda(...)`
with exactly those types (int, bytes, int, int, bytes, int, bytes, bool); the device is
not sent, the peer maps the owner GPU's UUID to its own index instead.
"""

from __future__ import annotations

import itertools
import os

import torch

from kvtransfer.transport.base import TransferError, TransferHeader

EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


def slot_view(storage: torch.UntypedStorage, h: TransferHeader) -> torch.Tensor:
    """(layers, 2, batch, kv_heads, seq, head_dim) over the first bytes of a slot; layer i's K, V adjacent."""
    need = h.num_layers * h.layer_bytes()
    if need > storage.nbytes():  # set_() would try to grow the storage: refuse instead
        raise TransferError("protocol", f"request {h.request_id} needs {need} bytes; the slot holds {storage.nbytes()}")
    return torch.empty(0, dtype=h.dtype, device=storage.device).set_(storage, 0, (h.num_layers, 2, *h.layer_shape()))


class CudaOps:
    """CUDA calls of one side; `side` (sender only) is the stream the copies run on."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"cuda_ipc needs a CUDA device with an index (cuda:N), got {device!r}")
        torch.cuda.init()
        self._side: torch.cuda.Stream | None = None
        self._ready = torch.cuda.Event()  # compute stream -> side stream ordering, reused every layer

    @property
    def side(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def uuid(self) -> bytes:
        return str(torch.cuda.get_device_properties(self.device).uuid).encode()

    def peer_index(self, uuid: bytes) -> int:
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid).encode() == uuid:
                return i
        raise TransferError("protocol", f"the peer's GPU {uuid.decode(errors='replace')} is not visible here "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
                            "both processes must see both GPUs")

    # --- receive pool (owner side) ---
    def alloc(self, nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()

    def share(self, storage: torch.UntypedStorage) -> dict:
        _device, handle, size, offset, ref_counter, ref_offset, event_handle, event_sync = storage._share_cuda_()
        return dict(size=size, offset=offset, ref_counter_offset=ref_offset, event_sync_required=bool(event_sync),
                    handle=handle, ref_counter=ref_counter, event_handle=event_handle)

    def open(self, m, owner: int) -> torch.UntypedStorage:
        """Map a peer's slot (a cuda_ipc/messages.py Slot message) into this process, on the owner's device."""
        return torch.UntypedStorage._new_shared_cuda(owner, m.handle, m.size, m.offset, m.ref_counter,
                                                     m.ref_counter_offset, m.event_handle, m.event_sync_required)

    # --- interprocess events ---
    def new_event(self) -> tuple[torch.cuda.Event, bytes]:
        ev = torch.cuda.Event(interprocess=True)  # interprocess implies timing disabled
        with torch.cuda.device(self.device):
            return ev, ev.ipc_handle()  # creates the event on this device

    def open_event(self, handle: bytes, owner: int) -> torch.cuda.Event:
        return torch.cuda.Event.from_ipc_handle(torch.device("cuda", owner), handle)

    # --- per layer, sender: record, wait, one copy launch, record ---
    def copy(self, dst: torch.Tensor, srcs: tuple[torch.Tensor, ...], landed: torch.cuda.Event) -> None:
        """dst (2, b, h, s, d) in a slot <- srcs ((2, b, h, s, d),) or (K, V), after the compute stream's
        work so far, on the side stream (copy engine: cudaMemcpy[Peer]Async); then `landed` is recorded."""
        cur = torch.cuda.current_stream(self.device)
        self._ready.record(cur)
        side = self.side
        side.wait_event(self._ready)
        torch.cuda.set_stream(side)  # cheaper than the stream context manager (leaves self.device current)
        try:
            if len(srcs) == 1:
                dst.copy_(srcs[0], non_blocking=True)
            else:
                dst[0].copy_(srcs[0], non_blocking=True)
                dst[1].copy_(srcs[1], non_blocking=True)
        finally:
            torch.cuda.set_stream(cur)
        landed.record(side)

    def side_wait(self, ev: torch.cuda.Event) -> None:
        self.side.wait_event(ev)

    def retire(self, tensors: list[torch.Tensor], last: torch.cuda.Event) -> None:
        """Sources may be freed now: tell the allocator about copies still reading them."""
        if not last.query():
            for t in tensors:
                t.record_stream(self.side)

    # --- receiver ---
    def wait(self, ev: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(ev)  # no host sync

    def record(self, ev: torch.cuda.Event) -> None:
        ev.record(torch.cuda.current_stream(self.device))

    def done(self, ev: torch.cuda.Event) -> bool:
        return ev.query()


class _LocalEvent:
    """CPU copies are synchronous: an event is always complete."""


class LocalOps:
    """In-process stand-in for CudaOps (CPU tests): handles are keys into this process's registry."""

    _objects: dict[bytes, object] = {}
    _ids = itertools.count(1)

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    @classmethod
    def _put(cls, obj, width: int = 0) -> bytes:
        key = f"local:{next(cls._ids)}".encode().ljust(width, b"\0")
        cls._objects[key] = obj
        return key

    @classmethod
    def _get(cls, key: bytes):
        if key not in cls._objects:
            raise TransferError("protocol", f"unknown local handle {key!r}")
        return cls._objects[key]

    def uuid(self) -> bytes:
        return b"local-cpu"

    def peer_index(self, uuid: bytes) -> int:
        if uuid != self.uuid():
            raise TransferError("protocol", f"peer device {uuid!r} is not this process's CPU")
        return 0

    def alloc(self, nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()

    def share(self, storage: torch.UntypedStorage) -> dict:
        return dict(size=storage.nbytes(), offset=0, ref_counter_offset=0, event_sync_required=False,
                    handle=self._put(storage), ref_counter=b"", event_handle=bytes(EVENT_HANDLE_BYTES))

    def open(self, m, owner: int) -> torch.UntypedStorage:
        return self._get(m.handle)

    def new_event(self) -> tuple[_LocalEvent, bytes]:
        ev = _LocalEvent()
        return ev, self._put(ev, EVENT_HANDLE_BYTES)

    def open_event(self, handle: bytes, owner: int) -> _LocalEvent:
        return self._get(handle)

    def copy(self, dst, srcs, landed) -> None:
        if len(srcs) == 1:
            dst.copy_(srcs[0])
        else:
            dst[0].copy_(srcs[0])
            dst[1].copy_(srcs[1])

    def side_wait(self, ev) -> None:
        pass

    def retire(self, tensors, last) -> None:
        pass

    def wait(self, ev) -> None:
        pass

    def record(self, ev) -> None:
        pass

    def done(self, ev) -> bool:
        return True
