"""Which decode worker gets a request: the least loaded healthy one (with prefix affinity), or round robin.

Why this load figure: a worker's footprint in tokens, the KV it holds (running contexts, waiting prompts) plus
what its running requests may still generate (LoadResponse: running_tokens + waiting_tokens + remaining_tokens).
Of that, what other clients put there comes from the worker's last report (at most --load-poll-s old), and what
this router put there from its own books, exact at every moment: each of its requests in flight counts
prompt + max_new_tokens, from the instant it is placed until it ends (workers.Worker.load_tokens). So a burst
that arrives between two polls is spread (each placement counts at once), short requests that ended since the
last report no longer count, and max_new_tokens tells a long generation from a short one when their prompts are
alike: with prompt tokens alone, a burst of equal prompts is placed as round robin places it, the long
generations stacked on one worker (docs/router.md, "Placement").
Ties go to the worker chosen least recently, so equal workers alternate.

Why affinity may lose to load: a conversation's next turn is cheapest where its cache is, but not at any price;
the worker holding it gets it unless its load exceeds the least loaded worker's by more than
--affinity-slack-tokens (then the prefix is prefilled again elsewhere).

Round robin is the baseline the issue compares against: healthy workers in turn, no load, no affinity.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection
from dataclasses import dataclass

from proto import kvtransfer_pb2 as pb
from router.affinity import Affinity
from router.metrics import RouterMetrics
from router.workers import Ticket, Worker, WorkerSet

log = logging.getLogger("kvtransfer.router")


@dataclass(frozen=True)
class Choice:
    worker: Worker
    reason: str  # "load", "affinity" or "round_robin"
    ticket: Ticket  # the request's charge on the worker: `started` at its first token, `release`d at its end


class Placement:
    def __init__(self, workers: WorkerSet, policy: str, metrics: RouterMetrics, affinity: Affinity | None = None,
                 slack_tokens: int = 4096):
        self.workers, self.policy, self.metrics = workers, policy, metrics
        self.affinity, self.slack = affinity, slack_tokens
        self._seq = itertools.count(1)
        self._turn = itertools.count()

    def choose(self, request: pb.GenerateRequest, exclude: Collection[Worker] = ()) -> Choice | None:
        """The worker for `request` (None: no healthy worker outside `exclude`), charged with its tokens."""
        healthy = [w for w in self.workers.healthy() if w not in exclude]
        if not healthy:
            return None
        if self.policy == "round_robin":
            w, reason = healthy[next(self._turn) % len(healthy)], "round_robin"
        else:
            w, reason = self._least_loaded(request, healthy, use_affinity=not exclude)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%d + %d tokens to %s (%s); loads before: %s", len(request.token_ids), request.max_new_tokens,
                      w.addr, reason, ", ".join(f"{x.addr} {x.load_tokens()}" for x in healthy))
        ticket = Ticket(len(request.token_ids), request.max_new_tokens)
        w.tickets.add(ticket)
        w.last_chosen = next(self._seq)
        self.metrics.placed(w)
        return Choice(w, reason, ticket)

    @staticmethod
    def started(choice: Choice) -> None:
        """The request's first token came: the worker runs it (a report from now on counts it as running)."""
        choice.ticket.first = True

    def release(self, choice: Choice) -> None:
        """The request ended on its worker (any way)."""
        choice.worker.tickets.discard(choice.ticket)
        self.metrics.placed(choice.worker)

    def _least_loaded(self, request: pb.GenerateRequest, healthy: list[Worker], use_affinity: bool
                      ) -> tuple[Worker, str]:
        best = min(healthy, key=lambda w: (w.load_tokens(), w.last_chosen))
        if use_affinity and self.affinity is not None:
            by_addr = {w.addr: w for w in healthy}
            hit = self.affinity.lookup(request.token_ids, {w.addr: w.block for w in healthy})
            if hit is not None:
                holder = by_addr[hit[0]]
                if holder.load_tokens() - best.load_tokens() <= self.slack:
                    self.metrics.affinity_hits.labels(holder.addr).inc()
                    return holder, "affinity"
                self.metrics.affinity_skipped.labels(holder.addr).inc()
        return best, "load"

    def served(self, w: Worker, context_tokens: list[int]) -> None:
        """A request ended OK on `w`, which now holds the KV of `context_tokens` (prompt + generated but the
        last): remembered for affinity."""
        if self.affinity is not None and self.policy == "least_loaded" and w.block:
            self.affinity.file(context_tokens, w.block, w.addr)
