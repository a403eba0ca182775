"""One decode peer of a prefill worker as its pairing keeps it (pairing.py), and which handshakes need a place.

Why apart from the pairing: the record and the cap's rule are small and stateless, and the pairing's module is the
protocol (handshakes, joins, the device thread). A process-group pairing is pending from its handshake until its join
ends (paired, failed or given up); each holds a thread here until then, so at most --max-pending-pairings are. A
handshake takes one of those places unless its pair is pending already (the new epoch supersedes that join, whose
thread gives way) or has been up before (a decode worker that paired, pairing again after a failure: never turned
away by callers that only open pairings).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Pair:
    """One decode peer: its instance, its current pairing's epoch, its link (None until joined) and group."""

    instance: int
    epoch: int = 0
    link: object = None
    group: object = None  # nccl/gloo: the pair's own process group
    up: bool = False
    was_up: bool = False  # paired at least once
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # clear while a process-group pairing is joined

    def __post_init__(self):
        self.settled.set()

    def pending(self) -> bool:
        return not self.settled.is_set()

    def settle(self, epoch: int) -> None:
        """Pairing `epoch` ended without the pair up: requests waiting for it go on, and its place is free, unless a
        newer epoch of the pair is under way (it settles them)."""
        if self.epoch == epoch:
            self.settled.set()


def needs_place(pair: Pair | None) -> bool:
    """Whether a handshake of `pair` (None: an instance not seen) takes a place under --max-pending-pairings."""
    return pair is None or not (pair.pending() or pair.was_up)
