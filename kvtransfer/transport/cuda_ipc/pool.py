"""Receive-slot bookkeeping for cuda_ipc, on both sides of a connection (pure Python, no CUDA).

Why two flags per slot: a slot may be written again only when (a) the sender's own request
in it has ended, so no copy into it is still being issued, and (b) the receiver has let go
of the cache in it. The receiver says (b) with a RELEASE message; it sends one exactly once
per request, on success when the cache's tensors are dropped or released, on abort or
timeout at once (`early`). Copies of consecutive requests run on one side stream, so a
copy still in flight on the GPU is always ordered before the next request's copies, and
the receiver's reads of an old cache are ordered before them by the slot's release event.
"""

from __future__ import annotations

import threading
import time

from kvtransfer.geometry import DTYPE_CODES
from kvtransfer.transport.base import TransferError, TransferHeader


def check_fits(h: TransferHeader, slot_bytes: int, max_layers: int) -> None:
    """A request must fit one slot and the per-slot events; refused before anything is sent or copied."""
    if min(h.seq_len, h.num_layers, h.kv_heads, h.head_dim, h.batch) < 1 or h.dtype not in DTYPE_CODES:
        raise TransferError("protocol", f"transfer header has non-positive fields or an unsupported dtype: {h}")
    if h.num_layers > max_layers:
        raise TransferError("protocol", f"request {h.request_id} has {h.num_layers} layers; the receive pool has "
                            f"events for {max_layers} (raise max_layers)")
    need = h.num_layers * h.layer_bytes()
    if need > slot_bytes:
        raise TransferError("protocol", f"request {h.request_id} needs {need} bytes; a receive slot holds "
                            f"{slot_bytes} (raise slot_bytes)")


class SlotPool:
    """The sender's mirror of the receiver's slots: acquire per request, freed by both sides."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError("a pool needs at least one slot")
        self._cond = threading.Condition()
        self._sending: list[int | None] = [None] * slots  # request whose copies are issued into the slot
        self._held: list[int | None] = [None] * slots     # request whose cache the receiver holds
        self.gave_up: list[int | None] = [None] * slots   # request the receiver released early (read lock-free)
        self._error: TransferError | None = None

    def __len__(self) -> int:
        return len(self._sending)

    def _free(self) -> list[int]:
        return [s for s in range(len(self._sending)) if self._sending[s] is None and self._held[s] is None]

    def acquire(self, request_id: int, timeout: float | None) -> int:
        """A free slot for `request_id`, waiting up to `timeout` seconds for a release."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free():
                if self._error is not None:
                    raise TransferError(self._error.cause, f"link failed while waiting for a slot: {self._error}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferError(
                        "timeout", f"receive pool exhausted: all {len(self)} slots stayed in use for {timeout} s "
                        "(the decode side holds a slot until the cache's tensors are released; add slots or "
                        "release caches sooner)")
                self._cond.wait(left)
            if self._error is not None:
                raise TransferError(self._error.cause, f"link failed: {self._error}")
            slot = self._free()[0]
            self._sending[slot] = self._held[slot] = request_id
            self.gave_up[slot] = None
            return slot

    def sender_done(self, slot: int) -> None:
        """The sender's request in `slot` ended (finished or aborted): no more copies will be issued."""
        with self._cond:
            self._sending[slot] = None
            self._cond.notify_all()

    def released(self, slot: int, request_id: int, early: bool) -> None:
        """The receiver let go of `request_id`'s cache in `slot` (RELEASE message)."""
        with self._cond:
            if not 0 <= slot < len(self) or self._held[slot] != request_id:
                held = self._held[slot] if 0 <= slot < len(self) else "no such slot"
                raise TransferError("protocol", f"receiver released slot {slot} for request {request_id}, "
                                    f"but that slot holds {held}")
            self._held[slot] = None
            if early and self._sending[slot] == request_id:
                self.gave_up[slot] = request_id
            self._cond.notify_all()

    def fail(self, error: TransferError) -> None:
        """The link broke: wake every waiter with `error`."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()


class HeldSlots:
    """The receiver's view: which slots hold a cache that the sender must not overwrite."""

    def __init__(self, slots: int):
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # slot -> request id
        self.slots = slots

    def hold(self, slot: int, request_id: int) -> None:
        with self._lock:
            if not 0 <= slot < self.slots:
                raise TransferError("protocol", f"request {request_id} names slot {slot}; the pool has {self.slots}")
            if slot in self._held:
                raise TransferError("protocol", f"request {request_id} was sent into slot {slot}, which still holds "
                                    f"request {self._held[slot]}'s cache")
            self._held[slot] = request_id

    def free(self, slot: int, request_id: int) -> bool:
        """Let go of `slot`; False when it did not hold `request_id` (already released)."""
        with self._lock:
            if self._held.get(slot) != request_id:
                return False
            del self._held[slot]
            return True

    def held(self) -> dict[int, int]:
        with self._lock:
            return dict(self._held)
