"""The data-plane receive loop: frames in wire order, matched to requests by header id.

Why one thread: the data plane is one ordered stream per peer, so frames are accepted in
the order the prefill worker sent them, whatever order the requests were made in. Each
frame's header names its request; the loop's destination provider hands the link the
memory that request registered (`expect(..., destination=)`, e.g. its slice of the KV
pool) when the header matches it exactly, and fresh tensors otherwise (the warm-up frame,
a frame nobody waits for, a mismatched one: drained and dropped).

Why the bookkeeping: a pairing can end at any moment (peer killed, link down). Then every
request still waiting is failed at once (`fail_pending`, or `retire` for a loop whose
process group is being replaced), so each one reaches its policy before its deadline, and
every receive buffer is counted from the frame's header until its request lets go of it
(`BufferLedger`), so a test can prove that none leaks.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvtransfer.geometry import CacheGeometry
from kvtransfer.transport import Cause, Destination, TransferError, TransferHeader, fresh_destination

log = logging.getLogger("kvtransfer.decode.receiver")

WARMUP_REQUEST_ID = 0


@dataclass
class Expected:
    seq_len: int
    future: Future  # -> list[(k, v)] on the device, or TransferError
    destination: Destination | None = None  # where its layers land (None: fresh tensors)
    lease: object = None  # held while a frame lands in `destination` (a KV pool slot's Lease; None: nothing)
    t_ready: float = 0.0  # perf_counter when the whole cache was on the device
    nbytes: int = 0  # receive-buffer bytes handed over with the result; `release` gives them back


class BufferLedger:
    """Bytes of receive buffers held for requests, across every receive loop of the process."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


# How a link goes down (the transports' TransferError, torch.distributed's errors, sockets): the loop stops and the
# pairing makes a new one. Anything else escaping the loop is a bug in it, and fatal.
LINK_ERRORS = (RuntimeError, OSError, TimeoutError, ConnectionError)


class ReceiveLoop:
    def __init__(self, link, geometry: CacheGeometry, device: torch.device, finish_timeout_s: float,
                 ledger: BufferLedger | None = None, name: str = "kv-receive"):
        self.link, self.geometry, self.device = link, geometry, device
        self.finish_timeout_s = finish_timeout_s
        self.ledger = ledger or BufferLedger()
        self._expected: dict[int, Expected] = {}
        self._lock = threading.Lock()
        self._current = None  # the receiver being finished (aborted by fail_pending on links that survive it)
        self._landing = None  # the lease of the slot the current frame lands in (held until it stops landing)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.survives = type(link).survives_failed_request
        self.frames = 0
        self.warmups = 0
        self.dropped = 0
        self.retired = False
        self.error: BaseException | None = None
        self.on_stop = None  # called (from this thread) once the loop has stopped for good
        self.on_fatal = None  # called (from this thread) when it died of a bug, not of its link: the server stops

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def expect(self, request_id: int, seq_len: int, destination: Destination | None = None, lease=None) -> Expected:
        """Register a request before its frame can arrive; its layers land in `destination` (None: fresh),
        per layer (k, v) of (1, kv_heads, seq_len, head_dim) in the geometry's dtype, on this device. `lease`
        (with hold()/release()) is held from the moment the frame starts landing there until it stops, so a
        request that gives up meanwhile cannot have its slot handed to another request under the late frame."""
        e = Expected(seq_len, Future(), destination, lease)
        e.future.set_running_or_notify_cancel()  # a waiter that gives up cannot cancel it under this thread
        with self._lock:
            if self.error is not None or self.retired:
                e.future.set_exception(TransferError("peer", f"data plane is down: {self.error or 'retired'}"))
            else:
                self._expected[request_id] = e
        return e

    def forget(self, request_id: int) -> None:
        """The request gave up; its frame (if it still comes) is drained and dropped."""
        with self._lock:
            self._expected.pop(request_id, None)
            current = self._current
        if current is not None and self.survives and current.header.request_id == request_id:
            current.abort("the request gave up")  # gRPC: cancels the streams, the sender hears of it at once

    def release(self, exp: Expected) -> None:
        """The request is over: its receive buffers are no longer held."""
        with self._lock:
            n, exp.nbytes = exp.nbytes, 0
        self.ledger.add(-n)

    def pending(self) -> int:
        with self._lock:
            return len(self._expected)

    def receiving(self) -> int:
        """1 while a frame's receiver (and its buffers) is being finished."""
        return int(self._current is not None)

    def fail_pending(self, reason: str) -> None:
        """Fail every request still waiting for its cache (the pairing ended), and the transfer in progress."""
        with self._lock:
            waiting, self._expected = self._expected, {}
            current = self._current
        for exp in waiting.values():
            exp.future.set_exception(TransferError("peer", reason))
        if current is not None and self.survives:
            current.abort(reason)

    def retire(self, reason: str) -> None:
        """This loop's link is being replaced: fail everyone now; the thread ends when its link gives up."""
        self.retired = True
        self.fail_pending(reason)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while not self.retired:  # a retired loop's thread ends after the frame it was blocked in
                try:
                    self._one()
                except TransferError as e:
                    if not self.survives or self.retired:
                        raise
                    log.warning("a transfer failed; the data plane is still up: %s", e)
        except BaseException as e:  # the link is broken: fail everyone waiting, loudly
            with self._lock:
                self.error = e
            fatal = not isinstance(e, LINK_ERRORS) and not self.retired and self.on_fatal is not None
            if not fatal:
                (log.info if self.retired else log.error)("receive loop stopped: %s", e)
            self.fail_pending(f"data plane failed: {e}")
            if fatal:  # a bug, not a link going down: re-pairing would only meet it again
                self.on_fatal("the receive loop", e)
            if self.on_stop is not None:
                self.on_stop()

    def _destination(self, h: TransferHeader) -> Destination:
        """The link's destination provider: the registered destination of the request the header matches."""
        with self._lock:
            exp = self._expected.get(h.request_id)
            if exp is None or exp.destination is None or self._problem(h, exp) is not None:
                return fresh_destination(h, self.device)
            if exp.lease is not None:
                exp.lease.hold()
                self._landing = exp.lease
        return exp.destination

    def _problem(self, h: TransferHeader, exp: Expected) -> str | None:
        g = self.geometry
        if (h.seq_len, h.num_layers, h.kv_heads, h.head_dim, h.dtype, h.batch) != (
                exp.seq_len, g.num_layers, g.kv_heads, g.head_dim, g.dtype, 1):
            return (f"frame for request {h.request_id} is {h.batch} x {h.seq_len} tokens x {h.num_layers} layers "
                    f"x {h.kv_heads} heads x {h.head_dim} {h.dtype}; expected 1 x {exp.seq_len} tokens of "
                    f"{g.num_layers} x {g.kv_heads} x {g.head_dim} {g.dtype}")
        return None

    def _one(self) -> None:
        try:
            r = self.link.accept(timeout=None, destinations=self._destination)
        except BaseException:
            self._let_go()
            raise
        h = r.header
        self.frames += 1
        nbytes = h.layer_bytes() * h.num_layers
        self.ledger.add(nbytes)
        handed = False
        with self._lock:
            exp = self._expected.get(h.request_id)
            self._current = r
        try:
            handed = self._finish(r, exp, nbytes)
        finally:
            with self._lock:
                self._current = None
            self._let_go()
            if not handed:
                self.ledger.add(-nbytes)

    def _let_go(self) -> None:
        """The current frame stopped landing: release the slot lease its destination held, if any."""
        with self._lock:
            landing, self._landing = self._landing, None
        if landing is not None:
            landing.release()

    def _finish(self, r, exp: Expected | None, nbytes: int) -> bool:
        """Receive the frame and hand it to its request; False when it was dropped (its bytes are freed)."""
        h = r.header
        problem = None
        if h.request_id == WARMUP_REQUEST_ID:
            self.warmups += 1
        elif exp is None:
            problem = f"no request {h.request_id} is waiting (cancelled or unknown)"
        else:
            problem = self._problem(h, exp)
        try:
            layers = r.finish(timeout=self.finish_timeout_s)
        except TransferError as e:
            if exp is not None:
                self._settle(h.request_id, exp, error=e)
            if e.cause not in (Cause.ABORTED, Cause.DATA_LOSS):
                raise  # timeout / peer: an ordered stream is out of step (the loop decides whether to stop)
            return False
        if h.request_id == WARMUP_REQUEST_ID:
            return False
        if problem is not None:
            self.dropped += 1
            log.warning("dropped a frame: %s", problem)
            if exp is not None:
                self._settle(h.request_id, exp, error=TransferError("protocol", problem))
            return False
        if self.device.type == "cuda" and exp.destination is not None:
            torch.cuda.synchronize(self.device)  # landed before the decode thread's stream reads the slot
        exp.t_ready = time.perf_counter()
        return self._settle(h.request_id, exp, layers=layers, nbytes=nbytes)

    def _settle(self, request_id: int, exp: Expected, layers=None, nbytes: int = 0, error=None) -> bool:
        """Complete `exp` unless its request gave up or was failed meanwhile; True when the layers were handed over."""
        with self._lock:
            if self._expected.get(request_id) is not exp:
                return False
            del self._expected[request_id]
            if error is None:
                exp.nbytes = nbytes
        if error is not None:
            exp.future.set_exception(error)
            return False
        exp.future.set_result(layers)
        return True
