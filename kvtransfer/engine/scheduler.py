"""Continuous batching: one thread owns the device; every step advances every running sequence.

Why one thread: a CUDA graph replay, a local prefill and a cache digest must not interleave on
the device, and tokens must come out in step order. Between two steps the thread, in order:
runs one piece of device work asked for by the servicer (a local prefill, or one chunk of a
chunked one; a digest), drops the sequences asked to stop (their slots are let go once no queued
step writes into them), admits the sequences whose caches are complete, then queues one step for
all of them (each row's next block taken first, the newest request preempted when none is free: preempt.py);
with --mixed-prefill that step also carries prompt tokens, in a step of --prefill-chunk
rows in all (or a larger size, --mixed-max-rows): the next chunk of each prompt in progress, then of
new ones (prompt_queue.py).
A sequence leaves when its last token is made. Nothing here waits on a client: tokens go to each
sequence's sink, which never blocks.

One step runs ahead (SGLang's overlap scheduling): step k+1 is queued on the device, its input
tokens gathered there from step k's choice (sampler.py), before the thread waits for step k's tokens and
hands them out. The host's share of a step (building inputs, launching the graph, streaming
tokens) then hides behind the device's. What it costs: a sequence that hits EOS at step k has
already been queued for step k+1; that row's token is dropped. Slots stay held by every queued
step that writes into them (`Lease.hold`), so a slot is never handed on while a write is queued
(queued.py queues a step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from kvtransfer.engine.graphs import Step
from kvtransfer.engine.mixed import Chunk, MixedPrefill
from kvtransfer.engine.preempt import make_room
from kvtransfer.engine.prompt_queue import PromptQueue
from kvtransfer.engine.queued import QueuedStep, StepStats, hand_out, let_go, queue_step, release_delivered
from kvtransfer.engine.sequence import EndCause, Ended, Sequence, Token

log = logging.getLogger("kvtransfer.decode.scheduler")

# A piece of device work: a generator run one `next()` per gap between steps; its return value resolves the future.
Job = Iterator[None]


class EngineFailed(RuntimeError):
    """The scheduler thread died: every request it held, and every later one, ends with this (INTERNAL)."""


class InjectedFault(Exception):
    """--fail-scheduler-after-steps: the scheduler thread dies on purpose (tests of the server's supervision)."""


class Scheduler:
    def __init__(self, step: Step, device: torch.device, on_step: Callable[[StepStats], None] | None = None,
                 on_fatal: Callable[[str, BaseException], None] | None = None, fail_after_steps: int = -1):
        self.step, self.device, self.on_step = step, device, on_step
        self.on_fatal = on_fatal  # called once, on this thread, if it dies (the server then stops, non-zero)
        self.fail_after_steps = fail_after_steps
        self.dead: str | None = None  # why the thread died
        self._job: tuple[Job, Future] | None = None  # the piece of device work in hand (this thread's)
        self._pending: QueuedStep | None = None  # the step queued on the device, not delivered (this thread's)
        self.max_batch = step.max_batch
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Job, Future]] = deque()
        self._joining: list[Sequence] = []
        self._prompts = PromptQueue(self._cond)  # prompts whose chunks ride in decode steps (--mixed-prefill)
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
            self._refuse_if_stopped()
            self._jobs.append((job, fut))
            self._cond.notify()
        return fut

    def submit_mixed(self, task: MixedPrefill) -> Future:
        """Hand out `task`'s chunks one per step, each in the same forward as the decode rows (mixed.py)."""
        with self._cond:
            self._refuse_if_stopped()
            self._prompts.waiting.append(task)
            self._cond.notify()
        return task.future

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the device thread between two steps."""
        def job():
            return fn(*args)
            yield  # noqa: unreachable: makes this a generator
        return self.submit(job())

    def add(self, seq: Sequence) -> None:
        """Its cache is complete in its slot: it joins at the next step."""
        with self._cond:
            if self.dead is None:
                self._joining.append(seq)
                self._cond.notify()
                return
        self._end(seq, Ended(EndCause.ENGINE_FAILED, self.dead))

    def _refuse_if_stopped(self) -> None:
        if self.dead is not None:
            raise EngineFailed(self.dead)
        if self._closed:
            raise RuntimeError("the decode scheduler is stopped")

    def active(self) -> int:
        with self._cond:
            return len(self.running) + len(self._joining)

    def prompts_queued(self) -> int:
        """Prompts whose chunks wait to ride in steps, begun or not (a gauge: read without the device thread)."""
        with self._cond:
            return len(self._prompts.waiting) + len(self._prompts.active)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # --- the device thread ---

    def _run(self) -> None:
        """The thread: its loop, and if anything escapes it, every request ends INTERNAL and the server is told."""
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a dead scheduler must never look alive
            self._die(e)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self.dead = (f"the decode engine stopped: its scheduler thread died ({type(error).__name__}: {error}); "
                         "the server is exiting, retry on another replica")
            tasks = self._prompts.take_all()
            joining, self._joining = self._joining, []
        pending, self._pending = self._pending, None
        for task in tasks + (pending.chunk_tasks if pending is not None else []):  # + those riding in the step
            if not task.future.done():
                task.future.set_exception(EngineFailed(self.dead))
        let_go(pending, self._end)  # the step in flight: its rows' holds and the ends it carried (EOS)
        for s in self.running + joining:
            if not s.over:
                self._end(s, Ended(EndCause.ENGINE_FAILED, self.dead))
        self.running = []
        self._fail_jobs(EngineFailed(self.dead))
        if self.on_fatal is not None:
            self.on_fatal("the decode scheduler thread", error)
        else:
            log.error("the decode scheduler thread died", exc_info=error)

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._job = None
        pending: QueuedStep | None = None
        while True:
            with self._cond:
                while not (self._closed or self._jobs or self._joining or self.running or self._job or pending
                           or self._prompts):
                    self._cond.wait()
                if self._closed:
                    break
                if 0 <= self.fail_after_steps <= self.steps:
                    raise InjectedFault(f"injected after {self.steps} steps (--fail-scheduler-after-steps)")
                while self._job is None and self._jobs:
                    self._job = self._jobs.popleft()
                    if not self._job[1].set_running_or_notify_cancel():  # cancelled while queued (its request gave up)
                        self._job[0].close()
                        self._job = None
                joining, self._joining = self._joining, []
            if self._job is not None and self._advance(*self._job):
                self._job = None
            self.running.extend(joining)
            self._drop_stopped(pending)
            newer = None
            pieces: list[tuple[MixedPrefill, Chunk]] = []
            try:
                if make_room(self.running, self._end):  # blocks for this step's rows
                    self.running = [s for s in self.running if not s.over]
                launch = [s for s in self.running if s.remaining > 0 and not s.over]
                pieces = self._prompts.pieces(self.step, len(launch))
                newer = queue_step(self.step, self.device, launch, pending, pieces) if launch or pieces else None
                if pending is not None:
                    self._deliver(pending, newer)
                pending = self._pending = newer
            except Exception as e:  # a failed step fails every running request loudly, not silently
                log.exception("decode step failed")
                for s in self.running:
                    if not s.over:
                        self._end(s, Ended(EndCause.STEP_FAILED, f"decode step failed: {e}"))
                self.running = []
                pending = self._pending = let_go(pending, self._end)
                if newer is not pending:
                    let_go(newer, self._end)
                for task in [t for t, _ in pieces] + self._prompts.active:
                    if not task.future.done():
                        task.future.set_exception(RuntimeError(f"decode step failed: {e}"))
                self._prompts.active = []
        pending = self._pending = let_go(pending, self._end)
        stopping = "the decode server is stopping"
        for s in self.running + self._joining:
            if not s.over:
                self._end(s, Ended(EndCause.SHUTDOWN, stopping))
        self._fail_jobs(RuntimeError(stopping))
        for task in self._prompts.take_all():
            if not task.future.done():
                task.future.set_exception(RuntimeError(stopping))

    def _fail_jobs(self, error: Exception) -> None:
        """The job in hand (a prefill between two of its pieces) and the queued ones: each closed, so the one in hand
        releases its lease (its `finally`), and its future failed with `error`."""
        with self._cond:
            jobs, self._job, self._jobs = [*([self._job] if self._job else []), *self._jobs], None, deque()
        for job, fut in jobs:
            try:
                job.close()
            except Exception:  # noqa: BLE001 - its caller is still told
                log.exception("closing a device job failed")
            if not fut.done():
                fut.set_exception(error)

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

    def _drop_stopped(self, pending: QueuedStep | None) -> None:
        """Sequences asked to stop leave now; one queued in `pending` ends once that step is delivered."""
        queued = {id(s) for s in pending.batch} if pending is not None else set()
        keep = []
        for s in self.running:
            if s.stopped:
                s.over = True
                if id(s) in queued:
                    pending.after.append((s, Ended(s.stop_cause, s.stop_reason)))
                else:
                    self._end(s, Ended(s.stop_cause, s.stop_reason))
            else:
                keep.append(s)
        self.running = keep

    @staticmethod
    def _end(s: Sequence, item: Token | Ended) -> None:
        """Let go of the sequence's slot, then hand it its last token or its end (a stream ends with its slot free)."""
        s.over = True
        s.lease.release()
        s.sink(item)

    def _deliver(self, done: QueuedStep, newer: QueuedStep | None) -> None:
        """Wait for a queued step and hand each row's token to its sink; sequences whose last token it was leave
        the batch. A sequence still queued in `newer` (it hit EOS here) gets its last token when `newer` is
        delivered: a stream ends only once its slot is free."""
        if done.event is not None:
            done.event.synchronize()  # the one host wait per step, while `newer` already runs
        tokens = done.host.tolist()
        t = time.perf_counter()
        if done.batch:
            self.steps += 1
        if self.on_step is not None:
            self.on_step(StepStats(len(done.batch), done.prompt_rows, done.step_rows, done.device_s(),
                                   done.staging_s()))
        ends = hand_out(done, newer, tokens, t)
        if ends or (newer is not None and newer.after):  # sequences whose last token it was leave the batch
            self.running = [s for s in self.running if not s.over]
        release_delivered(done, tokens, t, ends, self._end)
