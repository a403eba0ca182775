"""The data-plane receive loop: frames in wire order, matched to requests by header id.

Why one thread: the data plane is one ordered stream per peer, so frames are accepted in
the order the prefill worker sent them, whatever order the requests were made in. Each
frame's header names its request; buffers are sized from that header and handed to the
request that expected exactly that id and length, never to another.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvtransfer.geometry import CacheGeometry
from kvtransfer.transport import TransferError

log = logging.getLogger("kvtransfer.decode.receiver")

WARMUP_REQUEST_ID = 0


@dataclass
class Expected:
    seq_len: int
    future: Future  # -> list[(k, v)] on the device, or TransferError
    t_ready: float = 0.0  # perf_counter when the whole cache was on the device


class ReceiveLoop:
    def __init__(self, link, geometry: CacheGeometry, device: torch.device, finish_timeout_s: float):
        self.link, self.geometry, self.device = link, geometry, device
        self.finish_timeout_s = finish_timeout_s
        self._expected: dict[int, Expected] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-receive", daemon=True)
        self.frames = 0
        self.warmups = 0
        self.dropped = 0
        self.error: BaseException | None = None
        self.on_stop = None  # called (from this thread) once the loop has stopped for good

    def start(self) -> None:
        self._thread.start()

    def expect(self, request_id: int, seq_len: int) -> Expected:
        e = Expected(seq_len, Future())
        e.future.set_running_or_notify_cancel()  # a waiter that gives up cannot cancel it under this thread
        with self._lock:
            self._expected[request_id] = e
        return e

    def forget(self, request_id: int) -> None:
        """The request gave up; its frame (if it still comes) is drained and dropped."""
        with self._lock:
            self._expected.pop(request_id, None)

    def pending(self) -> int:
        with self._lock:
            return len(self._expected)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        survives = getattr(self.link, "survives_errors", False)
        try:
            while True:
                try:
                    self._one()
                except TransferError as e:
                    if not survives:
                        raise
                    log.warning("a transfer failed; the data plane is still up: %s", e)
        except BaseException as e:  # the link is broken: fail everyone waiting, loudly
            self.error = e
            log.error("receive loop stopped: %s", e)
            with self._lock:
                waiting, self._expected = self._expected, {}
            for exp in waiting.values():
                exp.future.set_exception(TransferError("peer", f"data plane failed: {e}"))
            if self.on_stop is not None:
                self.on_stop()

    def _one(self) -> None:
        r = self.link.accept(timeout=None)
        h = r.header
        self.frames += 1
        with self._lock:
            exp = self._expected.pop(h.request_id, None)
        g = self.geometry
        problem = None
        if h.request_id == WARMUP_REQUEST_ID:
            self.warmups += 1
        elif exp is None:
            problem = f"no request {h.request_id} is waiting (cancelled or unknown)"
        elif (h.seq_len, h.num_layers, h.kv_heads, h.head_dim, h.dtype) != (
                exp.seq_len, g.num_layers, g.kv_heads, g.head_dim, g.dtype):
            problem = (f"frame for request {h.request_id} is {h.seq_len} tokens x {h.num_layers} layers "
                       f"x {h.kv_heads} heads x {h.head_dim} {h.dtype}; expected {exp.seq_len} tokens of "
                       f"{g.num_layers} x {g.kv_heads} x {g.head_dim} {g.dtype}")
        try:
            layers = r.finish(timeout=self.finish_timeout_s)
        except TransferError as e:
            if exp is not None:
                exp.future.set_exception(e)
            if e.cause not in ("aborted", "data_loss"):
                raise  # timeout / peer: an ordered stream is out of step (the loop decides whether to stop)
            return
        if h.request_id == WARMUP_REQUEST_ID:
            return
        if problem is not None:
            self.dropped += 1
            log.warning("dropped a frame: %s", problem)
            if exp is not None:
                exp.future.set_exception(TransferError("protocol", problem))
            return
        exp.t_ready = time.perf_counter()
        exp.future.set_result(layers)
