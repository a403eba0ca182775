"""Gaps in the mixed steps' token-budget tests found by planting one-line bugs (a mutation pass over mixed.py,
prompt_queue.py, graphs.py and side_stream.py), each closed here on CPU without servers.

Why apart from tests/test_mixed.py: those tests compare tokens, logits and K/V with the plain engine, so a bug that
leaves every token right survives them: a step size chosen without a captured graph for its bucket (on a GPU, a
KeyError that fails every running request), a chunk table whose padding piece starts before row 0 (on a GPU, the
chunk kernel zeroes rows of the decode kernel's output), a step that counts cancelled prompts or takes a fifth
prompt, a side stream that is never waited on. Each test names the planted bug it catches.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from contextlib import contextmanager

import pytest
import torch

from kvtransfer.engine import graphs
from kvtransfer.engine.graphs import Step
from kvtransfer.engine.mixed import MAX_PIECES, Chunk, MixedPrefill, lay_out, mixed_forward
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.prompt_queue import PromptQueue
from kvtransfer.engine.runner import StepRunner
from kvtransfer.engine.side_stream import SideStream
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0))


@pytest.fixture(scope="module")
def pool(tiny):
    return KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=8, max_seq=64)


def _chunks(sizes: list[int]) -> list[Chunk]:
    """Chunks of `sizes` tokens, chunk j into slot j from position 3 j + 1 (so every row's slot and position differ)."""
    return [Chunk(torch.arange(10, 10 + n), j, 3 * j + 1, False) for j, n in enumerate(sizes)]


@pytest.mark.parametrize("n, b, rows, sizes", [
    (9, 16, 48, [5, 30]),  # the bucket's 7 free rows take a chunk whole and the next one's first 2 tokens
    (9, 16, 16, [3]),  # every prompt token inside the bucket's free rows: the chunk kernel has only padding
    (5, 8, 8, [2, 1]),  # the free rows hold the prompt tokens exactly
    (0, 1, 31, [4, 4, 4, 4]),  # nothing decoding: bucket 1's row is a prompt row
    (16, 16, 16, [16]),  # a full bucket and a full step: no padding row
    (3, 4, 20, [1]),
])
def test_the_chunk_table_covers_each_row_after_the_bucket_once(n, b, rows, sizes):
    """Caught: piece_table's `at = max(at, 0)` dropped (when the bucket's free rows hold every prompt token, the
    padding piece starts before row 0: the Triton kernel then zeroes rows of the decode kernel's output). Also
    holds the table to its docstring where today's kernels would not notice: a padding piece one row short (that
    row is never kept) and a chunk wholly in the bucket's rows given negative rows (both kernels skip rows <= 0).
    Read row by row, the table must give every row from b the slot and position lay_out gives it, and every other
    row the padding piece, exactly once."""
    p = lay_out(_chunks(sizes), n, b, rows, MAX_PIECES, scratch=99)
    skip, total = b - n, sum(sizes)
    assert p.table.shape == (MAX_PIECES + 1, 4)
    cover: list = [None] * rows
    for first, count, slot, start in p.table.tolist():
        assert count >= 0 and 0 <= first and first + count <= rows, p.table
        for i in range(count):
            assert cover[first + i] is None, p.table  # no row in two pieces
            cover[first + i] = (slot, start + i) if slot >= 0 else "padding"
    want = [(int(p.slots[skip + j]), int(p.positions[skip + j])) if skip + j < total else "padding"
            for j in range(rows)]
    assert cover == want


def _queue(pool: KVPool, lengths: list[int], cancelled: tuple[int, ...] = ()) -> tuple[PromptQueue, list]:
    """A PromptQueue with prompts of `lengths` tokens waiting, oldest first; those at `cancelled` gave up."""
    q = PromptQueue(threading.Condition())
    tasks = []
    for i, n in enumerate(lengths):
        task = MixedPrefill(torch.arange(n), pool.try_lease(), False, future=Future())
        if i in cancelled:
            assert task.future.cancel()
        q.waiting.append(task)
        tasks.append(task)
    return q, tasks


def _release(tasks: list) -> None:
    for task in tasks:
        task.lease.release()


def _taken(q: PromptQueue, step: Step, n: int, tasks: list) -> list[tuple[int, int, int]]:
    """One step's chunks as (prompt index, start, tokens)."""
    index = {id(task): i for i, task in enumerate(tasks)}  # MixedPrefill's dataclass == compares tensors
    return [(index[id(task)], c.start, c.ids.shape[0]) for task, c in q.pieces(step, n)]


def test_a_step_takes_the_largest_size_that_the_waiting_prompt_tokens_fill(tiny, pool):
    """Caught: MixedPrefill.left counting one token too many, or PromptQueue passing `waiting + 1` to the budget
    (44 tokens would then count as filling the 48-row step: a step of 48 rows with a padding row, where the policy
    is the 24-row step full). Steps of 24, 48 and 96 rows beside 3 decode rows (bucket 4): 44 tokens waiting ride
    21 a step, 45 ride in one 48-row step."""
    step = Step(StepRunner(tiny, pool), max_batch=8, cuda_graphs=False, chunk=24, max_rows=100)
    q, tasks = _queue(pool, [44])
    try:
        assert _taken(q, step, 3, tasks) == [(0, 0, 21)] and step.rows_for(3, 21) == 24
        assert _taken(q, step, 3, tasks) == [(0, 21, 21)]
        assert _taken(q, step, 3, tasks) == [(0, 42, 2)] and not q
    finally:
        _release(tasks)
    q, tasks = _queue(pool, [20, 25])
    try:
        assert _taken(q, step, 3, tasks) == [(0, 0, 20), (1, 0, 25)] and step.rows_for(3, 45) == 48
    finally:
        _release(tasks)


def test_cancelled_prompts_count_neither_for_the_step_size_nor_for_its_prompt_count(tiny, pool):
    """Caught: the `future.cancelled()` filter dropped from the waiting count (a prompt that gave up makes the step
    a 48-row one, padded, instead of the 24-row step full), and the count taken over the first MAX_PIECES prompts
    before the cancelled ones are left out (four live prompts behind a cancelled one count as three: a 24-row step
    instead of the 48-row step that all four fill)."""
    step = Step(StepRunner(tiny, pool), max_batch=8, cuda_graphs=False, chunk=24, max_rows=100)
    q, tasks = _queue(pool, [30, 30], cancelled=(0,))
    try:
        assert _taken(q, step, 3, tasks) == [(1, 0, 21)]  # 30 live tokens: the 24-row step, full
    finally:
        _release(tasks)
    q, tasks = _queue(pool, [30, 12, 12, 12, 12], cancelled=(0,))
    try:
        assert _taken(q, step, 3, tasks) == [(1, 0, 12), (2, 0, 12), (3, 0, 12), (4, 0, 9)]  # 45 rows of 48
    finally:
        _release(tasks)


def test_a_step_carries_at_most_max_pieces_prompts(tiny, pool):
    """Caught: PromptQueue's `len(out) < MAX_PIECES` written `<=` (a fifth prompt in the step: it then has no
    captured graph and runs eagerly, and the budget was sized for four). Six 2-token prompts, a 24-row step: four
    ride, the two others wait for the next step."""
    step = Step(StepRunner(tiny, pool), max_batch=8, cuda_graphs=False, chunk=24)
    q, tasks = _queue(pool, [2] * 6)
    try:
        assert _taken(q, step, 0, tasks) == [(i, 0, 2) for i in range(MAX_PIECES)]
        assert _taken(q, step, 0, tasks) == [(4, 0, 2), (5, 0, 2)] and not q
    finally:
        _release(tasks)


@pytest.mark.parametrize("max_batch, chunk, max_rows", [(8, 16, 0), (8, 24, 100), (80, 288, 0), (80, 512, 1024)])
def test_every_step_size_chosen_has_a_graph_for_its_bucket(tiny, pool, max_batch, chunk, max_rows):
    """Caught: Step._beside's `2 * b <= c` written `<` (no graph captured for a step half decode rows, which
    rows_for still picks: on a GPU a KeyError fails the step and every request in it), _sizes's written `<` (with
    --prefill-chunk = 2 x --max-batch a full batch has no size: prompt_budget raises; elsewhere a larger size than
    needed), rows_for filtering by n instead of its bucket (--prefill-chunk 288: 70 decode rows, bucket 80, picked
    the 144-row step, which has no graph for bucket 80). The sizes are those _capture records."""
    step = Step(StepRunner(tiny, pool), max_batch=max_batch, cuda_graphs=False, chunk=chunk, max_rows=max_rows)
    graphed = {(c, b) for c in step.sizes for b in step._beside(c)}  # what _capture makes, one graph each
    assert {b for _, b in graphed} == set(step.buckets)  # every bucket has a mixed step
    for n in range(max_batch + 1):
        b = step.bucket(n)
        room = sorted({1, *(c - n + d for c in step.sizes for d in (-1, 0, 1))} - {0})
        for r in room:
            want = min((c for c in step.sizes if (c, b) in graphed and r <= c - n), default=0)
            assert step.rows_for(n, r) == want, (n, r)
        for waiting in room:
            budget = step.prompt_budget(n, waiting)
            assert budget > 0 and step.rows_for(n, min(budget, waiting)) > 0, (n, waiting)
    if (max_batch, chunk) == (8, 16):  # a full bucket: the one size, half decode rows
        assert step.prompt_budget(8, 3) == 8 and step.rows_for(8, 8) == 16
    if chunk == 288:
        assert step.sizes == [144, 288] and step.rows_for(70, 10) == 288


def test_a_step_of_max_pieces_chunks_runs_in_the_graphs_layout(tiny, monkeypatch):
    """Caught: Step.mixed's `len(chunks) > MAX_PIECES` written `>=` (a step of four prompts, which its graphs are
    captured for, replayed eagerly instead: on a GPU a host-bound step). Staged (the graphs' layout eagerly on CPU),
    four chunks beside 3 decode rows must not fall back to the unpadded eager step, and give its logits."""
    pool = KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=8, max_seq=64)
    leases = [pool.try_lease(64) for _ in range(7)]
    step = Step(StepRunner(tiny, pool), max_batch=4, cuda_graphs=False, chunk=32, staged=True)
    vocab = tiny.config.vocab_size
    ids = random_prompt(vocab, 20, seed=50)[0]
    tokens, positions = ids[:3], torch.tensor([4, 9, 6])
    slots = torch.tensor([x.slot for x in leases[:3]])
    chunks = [Chunk(ids[j:j + 4], leases[3 + j].slot, 2 * j, j % 2 == 0) for j in range(MAX_PIECES)]
    assert step.rows_for(3, 16) == 32
    want_dec, want_last = mixed_forward(step.runner, tokens, positions, slots, chunks)

    def eager(*args, **kw):
        raise AssertionError("a step of MAX_PIECES chunks fell back to the eager unpadded step")
    monkeypatch.setattr(graphs, "mixed_forward", eager)
    got_dec, got_last = step.mixed(tokens, positions, slots, chunks)
    assert got_last.shape == (MAX_PIECES, vocab)
    torch.testing.assert_close(got_dec, want_dec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_last, want_last, rtol=1e-4, atol=1e-4)


class _FakeStreams:
    """torch.cuda's streams, recorded: which stream waits for which, and where the forked block runs."""

    def __init__(self):
        self.events: list[str] = []
        self.main = self.Stream(self, "main")
        self.current = self.main

    class Stream:
        def __init__(self, fake, name="side", device=None):
            self.fake, self.name, self.device = fake, name, device

        def wait_stream(self, other):
            self.fake.events.append(f"{self.name} waits for {other.name}")

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: self.Stream(self, "side", device))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)

        @contextmanager
        def stream(s):
            before, self.current = self.current, s
            try:
                yield
            finally:
                self.current = before
        monkeypatch.setattr(torch.cuda, "stream", stream)


def test_the_side_stream_forks_after_the_step_and_is_joined_back(monkeypatch):
    """Caught (on a GPU these race; on CPU the stream is None, so no other test sees them): fork's wait for the
    step's stream dropped (the chunk kernel could read q and K/V before they are written), join's wait dropped
    (the step's output read before the chunk kernel wrote it), the block run on the step's own stream (no overlap),
    `on=False` ignored (the probe that prices the side stream would measure it on)."""
    fake = _FakeStreams()
    fake.install(monkeypatch)
    side = SideStream(torch.device("cuda"))
    with side.fork():
        fake.events.append(f"block on {fake.current.name}")
    assert fake.current is fake.main
    side.join()
    assert fake.events == ["side waits for main", "block on side", "main waits for side"]
    fake.events.clear()
    off = SideStream(torch.device("cuda"), on=False)
    with off.fork():
        fake.events.append(f"block on {fake.current.name}")
    off.join()
    assert off.stream is None and fake.events == ["block on main"]
