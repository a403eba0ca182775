"""The scheduler's one-step lookahead (kvtransfer/engine/scheduler.py) against a fake step, on CPU.

Why: step k+1 is queued before step k's tokens are read, its input tokens gathered on the device
from step k's argmax. A wrong gather feeds a row another row's token; a wrong end frees a slot
while a queued step may still write into it. The fake step makes each next token a known function
of (input token, position), so every token of every stream is predictable; each stream must end
(last token, or Ended) only once its slot is free.
"""

from __future__ import annotations

import queue

import torch

from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.scheduler import Scheduler
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.geometry import CacheGeometry

VOCAB = 97


class FakeStep:
    """next token = (token * 3 + position) % VOCAB, as (n, VOCAB) one-hot logits."""

    max_batch = 4
    replayed = None  # Step's event before a graph replay: none, eager

    def __init__(self):
        self.rows = []

    def __call__(self, tokens, positions, slots):
        self.rows.append(len(tokens))
        nxt = (tokens * 3 + positions) % VOCAB
        return torch.nn.functional.one_hot(nxt, VOCAB).float()


def expected(first: int, length: int, n: int, eos: frozenset = frozenset()) -> list[int]:
    out, tok = [], first
    for i in range(n):
        tok = (tok * 3 + length + i) % VOCAB
        out.append(tok)
        if tok in eos:
            break
    return out


def run(seqs_at: list[tuple[int, int, int, frozenset]], stop_after: dict[int, int] | None = None):
    """Sequences (first token, length, tokens, eos), each added after the previous one has streamed 2 tokens."""
    pool = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=4, max_seq=256)
    step = FakeStep()
    sched = Scheduler(step, torch.device("cpu"))
    streams, used_at_end = [], {}
    try:
        for i, (first, length, n, eos) in enumerate(seqs_at):
            q: queue.Queue = queue.Queue()

            def sink(item, i=i, q=q):
                if isinstance(item, Ended) or item.last:
                    used_at_end[i] = pool.used()
                q.put(item)
            s = Sequence(i, pool.try_lease(), length, first, n, sink, eos=eos)
            sched.add(s)
            streams.append((s, q, []))
            for _ in range(2 if i + 1 < len(seqs_at) else 0):
                streams[-1][2].append(q.get(timeout=10).token_id)
        for i, (s, q, got) in enumerate(streams):
            while True:
                if stop_after and i in stop_after and len(got) >= stop_after[i]:
                    s.stop("client cancelled")
                item = q.get(timeout=10)
                if isinstance(item, Ended):
                    got.append(item)
                    break
                got.append(item.token_id)
                if item.last:
                    break
        return [got for _, _, got in streams], used_at_end, pool, step
    finally:
        sched.close()


def test_rows_joining_mid_run_get_their_own_next_tokens():
    spec = [(5, 10, 12, frozenset()), (7, 33, 9, frozenset()), (11, 3, 15, frozenset())]
    got, used, pool, _ = run(spec)
    assert got == [expected(f, n0, n) for f, n0, n, _ in spec]
    assert pool.used() == 0


def test_eos_ends_the_stream_after_its_slot_is_free_and_the_row_queued_after_it_is_dropped():
    full = expected(5, 10, 20)
    eos = frozenset([full[4]])
    spec = [(5, 10, 20, eos), (7, 33, 30, frozenset())]
    got, used, pool, step = run(spec)
    assert got[0] == full[:full.index(full[4]) + 1] and got[1] == expected(7, 33, 30)
    # when stream 0 saw its last token, only stream 1 held a slot (the queued step's hold was let go first)
    assert used[0] <= 1 and used[1] == 0 and pool.used() == 0


def test_a_stopped_stream_ends_once_its_queued_step_is_done():
    spec = [(5, 10, 10_000, frozenset()), (7, 33, 40, frozenset())]
    got, used, pool, _ = run(spec, stop_after={0: 6})
    assert isinstance(got[0][-1], Ended) and got[0][:-1] == expected(5, 10, len(got[0]) - 1)
    assert used[0] <= 1 and got[1] == expected(7, 33, 40) and pool.used() == 0
