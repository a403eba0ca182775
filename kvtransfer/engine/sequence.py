"""One request's decode state, as the scheduler sees it.

Why apart: the scheduler advances many of these per step and the servicer reads their
tokens from another thread; this is the whole contract between the two. A sequence holds its
pool slot (`lease`) until it ends; `stop` (client gone, deadline, slow reader) is honoured at
the next step boundary, where the slot is let go.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.engine.pool import Lease
from kvtransfer.engine.sampler import SamplingParams


@dataclass(frozen=True)
class Token:
    index: int  # 1.. (token 0 came from prefill)
    token_id: int
    logits_digest: str
    t: float  # perf_counter when it was known on the host
    last: bool  # no more tokens follow (max_new_tokens reached, or a stop token)


class EndCause(enum.Enum):
    """Why a sequence left before its last token (the servicer maps each to one gRPC status)."""

    REQUEST_ENDED = "request ended"  # the request side asked: client gone, deadline, error
    SLOW_READER = "slow reader"  # the client left too many tokens unread
    STEP_FAILED = "step failed"  # the device step raised
    SHUTDOWN = "shutdown"  # the server is stopping
    ENGINE_FAILED = "engine failed"  # the scheduler thread died: nothing will decode here again
    PREEMPTED = "preempted"  # a step needed its blocks (preempt.py): not an end for the client, the servicer
    # readmits the request and it continues from the tokens it made (the reason says "recompute" or "swap")


@dataclass(frozen=True)
class Ended:
    """The scheduler dropped the sequence before its last token; `reason` says why (ends the stream)."""

    cause: EndCause
    reason: str


@dataclass(frozen=True)
class LocalPrefill:
    """What a local prefill (colocated, recompute) gives the servicer: the first token, its logits' digest."""

    first: int
    digest: str
    prefill_ms: float  # from the device idle to its last forward's work done (CUDA: events; the gap after, when
    # the first token is read, not counted)
    cpu_ms: float = 0.0  # the scheduler thread's CPU time in it (wall far above: waiting on the GPU or the GIL)


# Called on the scheduler thread; must not block (the servicer hands it to its event loop).
Sink = Callable[[Token | Ended], None]


@dataclass
class Sequence:
    rid: int
    lease: Lease
    length: int  # tokens in the pool slot, counting those of steps queued on the device
    last_token: int  # the next input
    remaining: int  # tokens still to make, less those of queued steps
    sink: Sink
    want_digest: bool = False
    eos: frozenset[int] = frozenset()  # stop early on these: the request's stop set (stop_token_ids, and the
    # model's EOS with stop_on_eos); empty: run to max_new_tokens
    index: int = 0  # of the last token made
    over: bool = False  # its last token was delivered, or it was dropped (the scheduler thread's flag)
    _stop: threading.Event = field(default_factory=threading.Event)
    stop_cause: EndCause = EndCause.REQUEST_ENDED
    stop_reason: str = ""
    sampling: SamplingParams | None = None  # None: greedy (sampler.py; each row's draw position is length + 1)
    tokens: list[int] | None = None  # the context's ids through last_token as delivered (the scheduler appends each
    # token it hands out), so tokens[:-1] is what delivered steps wrote at positions 0..: what a preempted row swaps
    # to the host tier (preempt.py). None: not kept (no host tier; the row is then recomputed)

    @property
    def slot(self) -> int:
        return self.lease.slot

    def stop(self, reason: str, cause: EndCause = EndCause.REQUEST_ENDED) -> None:
        """Ask the scheduler to drop this sequence at the next step boundary (thread-safe; the first call wins)."""
        if not self._stop.is_set():
            self.stop_cause, self.stop_reason = cause, reason
            self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()
