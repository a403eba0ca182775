"""The prompts whose chunks ride in decode steps (--mixed-prefill): who waits, who is in progress, and which
chunks the next step carries.

Why apart from the scheduler: choosing a step's prompt chunks is a policy of its own (the oldest prompt in
progress first, then new ones, within the step's budget of prompt rows and MAX_PIECES prompts), while the
scheduler decides who decodes and delivers what a step made.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from kvtransfer.engine.graphs import Step
from kvtransfer.engine.mixed import MAX_PIECES, Chunk, MixedPrefill


class PromptQueue:
    """`waiting` is shared with the servicer's threads (under the scheduler's lock); `active`, the prompts with
    chunks handed out (oldest first), is the scheduler thread's own."""

    def __init__(self, lock: threading.Condition):
        self._lock = lock
        self.waiting: deque[MixedPrefill] = deque()
        self.active: list[MixedPrefill] = []

    def __bool__(self) -> bool:
        return bool(self.waiting or self.active)

    def take_all(self) -> list[MixedPrefill]:
        """Every prompt, in progress then waiting; the queue is left empty (the engine failed or stops)."""
        out, self.active, self.waiting = [*self.active, *self.waiting], [], deque()
        return out

    def pieces(self, step: Step, n: int) -> list[tuple[MixedPrefill, Chunk]]:
        """This step's prompt chunks: the next chunk of each prompt in progress, oldest first, then of prompts not
        yet begun, while the step's budget of prompt tokens beside n decode rows and its count of prompts last
        (Step.prompt_budget: the largest step size that the prompt tokens waiting fill)."""
        if not self:
            return []
        with self._lock:  # the prompt tokens this step could take: of the first MAX_PIECES live prompts
            live = [task for task in (*self.active, *self.waiting) if not task.future.cancelled()][:MAX_PIECES]
        waiting = sum(task.left for task in live)
        budget, out = step.prompt_budget(n, waiting), []
        for task in self.active:
            if budget <= 0 or len(out) == MAX_PIECES:
                break
            out.append((task, task.next_chunk(budget)))
            budget -= out[-1][1].ids.shape[0]
        while budget > 0 and len(out) < MAX_PIECES:
            with self._lock:
                task = self.waiting.popleft() if self.waiting else None
            if task is None:
                break
            if not task.future.set_running_or_notify_cancel():  # its request gave up while queued
                continue
            task.t0 = time.perf_counter()  # its prefill_ms counts from its first chunk
            self.active.append(task)
            out.append((task, task.next_chunk(budget)))
            budget -= out[-1][1].ids.shape[0]
        self.active = [task for task in self.active if not task.handed_out]
        return out
