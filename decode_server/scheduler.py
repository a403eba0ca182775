"""Continuous batching: one thread owns the device; every step advances every running sequence.

Why one thread: a CUDA graph replay, a local prefill and a cache digest must not interleave on
the device, and tokens must come out in step order. Between two steps the thread, in order:
runs one piece of device work asked for by the servicer (a local prefill, or one chunk of a
chunked one; a digest), drops the sequences asked to stop (their slots are let go at once),
admits the sequences whose caches are complete, then runs one step for all of them. A sequence
leaves when its last token is made. Nothing here waits on a client: tokens go to each
sequence's sink, which never blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from kvtransfer.reference import logits_digest

from .graphs import Step
from .sequence import EndCause, Ended, Sequence, Token

log = logging.getLogger("kvtransfer.decode.scheduler")

# A piece of device work: a generator run one `next()` per gap between steps; its return value resolves the future.
Job = Iterator[None]


class Scheduler:
    def __init__(self, step: Step, device: torch.device, on_step: Callable[[int], None] | None = None):
        self.step, self.device, self.on_step = step, device, on_step
        self.max_batch = step.max_batch
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Job, Future]] = deque()
        self._joining: list[Sequence] = []
        self.running: list[Sequence] = []
        self.steps = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="decode-scheduler", daemon=True)
        self._thread.start()

    # --- called from other threads ---

    def submit(self, job: Job) -> Future:
        """Run `job` on the device thread between steps; the future gets what the generator returns."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the decode scheduler is stopped")
            self._jobs.append((job, fut))
            self._cond.notify()
        return fut

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the device thread between two steps."""
        def job():
            return fn(*args)
            yield  # noqa: unreachable: makes this a generator
        return self.submit(job())

    def add(self, seq: Sequence) -> None:
        """Its cache is complete in its slot: it joins at the next step."""
        with self._cond:
            self._joining.append(seq)
            self._cond.notify()

    def active(self) -> int:
        with self._cond:
            return len(self.running) + len(self._joining)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # --- the device thread ---

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        job: tuple[Job, Future] | None = None
        while True:
            with self._cond:
                while not (self._closed or self._jobs or self._joining or self.running or job):
                    self._cond.wait()
                if self._closed:
                    break
                while job is None and self._jobs:
                    job = self._jobs.popleft()
                    if not job[1].set_running_or_notify_cancel():  # cancelled while queued (its request gave up)
                        job[0].close()
                        job = None
                joining, self._joining = self._joining, []
            if job is not None and self._advance(*job):
                job = None
            self.running.extend(joining)
            self._drop_stopped()
            if self.running:
                try:
                    self._step()
                except Exception as e:  # a failed step fails every running request loudly, not silently
                    log.exception("decode step failed")
                    for s in self.running:
                        self._end(s, Ended(EndCause.STEP_FAILED, f"decode step failed: {e}"))
                    self.running = []
        for s in self.running + self._joining:
            self._end(s, Ended(EndCause.SHUTDOWN, "the decode server is stopping"))
        for _, fut in self._jobs:
            fut.set_exception(RuntimeError("the decode server is stopping"))

    @staticmethod
    def _advance(job: Job, fut: Future) -> bool:
        """One piece of the job; True when it is over (its future is then resolved)."""
        try:
            next(job)
        except StopIteration as done:
            fut.set_result(done.value)
            return True
        except BaseException as e:
            fut.set_exception(e)
            return True
        return False

    def _drop_stopped(self) -> None:
        keep = []
        for s in self.running:
            if s.stopped:
                self._end(s, Ended(s.stop_cause, s.stop_reason))
            else:
                keep.append(s)
        self.running = keep

    @staticmethod
    def _end(s: Sequence, ended: Ended) -> None:
        s.lease.release()
        s.sink(ended)

    def _step(self) -> None:
        batch = self.running  # <= max_batch: each running sequence holds one of max_batch slots
        dev = self.device
        tokens = torch.tensor([s.last_token for s in batch], dtype=torch.long).to(dev, non_blocking=True)
        positions = torch.tensor([s.length for s in batch], dtype=torch.long).to(dev, non_blocking=True)
        slots = torch.tensor([s.slot for s in batch], dtype=torch.long).to(dev, non_blocking=True)
        logits = self.step(tokens, positions, slots)  # (n, vocab)
        nxt = logits.argmax(dim=-1).tolist()  # the one host sync per step: tokens go to clients now
        t = time.perf_counter()
        self.steps += 1
        if self.on_step is not None:
            self.on_step(len(batch))
        done = set()
        for j, s in enumerate(batch):
            s.length += 1
            s.index += 1
            s.remaining -= 1
            s.last_token = nxt[j]
            last = s.remaining == 0 or nxt[j] in s.eos
            s.sink(Token(s.index, nxt[j], logits_digest(logits[j]) if s.want_digest else "", t, last))
            if last:
                s.lease.release()
                done.add(id(s))
        if done:
            self.running = [s for s in self.running if id(s) not in done]
