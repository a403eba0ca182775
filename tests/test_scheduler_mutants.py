"""How the decode scheduler ends requests while prompts ride in its steps: gaps found by planting bugs (mutation
testing) in scheduler.py, queued.py, prompt_queue.py and sequence.py, each closed by a test on CPU.

Why: the existing tests (test_scheduler_overlap.py, test_mixed.py, test_engine.py, test_preempt.py and the server
tests) check tokens and free slots where requests end normally; about 30 planted bugs in the other ending paths
survived them all: a stopped row whose queued token still reached the client, a stop ending with the wrong
cause or never, a step failure, a shutdown or a dead thread that left a request, a job or a prompt's future
hanging or a slot held, a finished or preempted row kept in the running batch, a row queued past its last token,
a prompt given up while it waited riding anyway (and failing the whole batch). Here a fake step makes every token
a known function of (input token, position) and a prompt's first token one of its last id, so each stream is
predictable, and whatever must happen at a given step boundary is triggered from a sink, on the device thread;
every wait is on a queue, an event or a future with a timeout (no sleeps, no timed asserts).

What is claimed (and tested here):
- a sequence asked to stop leaves at the next step boundary with its own cause (the first stop wins): no token
  after it, its slot free before its end is seen, whether a step had queued it or not;
- a stop token or the last token ends a stream once, its slot free, and it leaves the running batch at that step;
  a preempted one leaves it at once; no row is queued past its last token;
- a prompt whose request gave up while it waited never rides;
- a step that fails (queued or delivered) ends every running request STEP_FAILED and every prompt riding in it
  or in progress with an error, lets go of every hold, and the scheduler serves the next request;
- a stopping scheduler ends every request, job and prompt, in hand or waiting, and frees every slot;
- a dead scheduler fails every request it held (running, joining, the job in hand, prompts in progress or
  waiting) and every later one, at once.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from kvtransfer.engine.mixed import MixedPrefill
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.scheduler import EngineFailed, InjectedFault, Scheduler
from kvtransfer.engine.sequence import EndCause, Ended, Sequence, Token
from kvtransfer.geometry import CacheGeometry

VOCAB = 97
CHUNK = 4  # prompt tokens a step carries
WAIT_S = 10.0


def nxt(token: int, position: int) -> int:
    """The fake step's next token for a decode row."""
    return (token * 3 + position) % VOCAB


def first_of(prompt: list[int]) -> int:
    """The fake step's first token for a prompt (from its last chunk's last row)."""
    return (prompt[-1] * 5 + len(prompt)) % VOCAB


class FakeStep:
    """A decode step (and a mixed one) without a model: one-hot logits of `nxt` per decode row and of `first_of` per
    chunk's last row. `fail_at`: the step (1..) that raises, as a device error would."""

    max_batch = 4
    mixed_graphs: dict = {}
    replayed = None  # Step's event before a graph replay: none, eager

    def __init__(self, fail_at: int = 0):
        self.calls, self.fail_at, self.rows = 0, fail_at, []  # rows: each step's decode rows
        self.chunks = []  # (slot, start, tokens) of each prompt chunk that rode

    def _count(self, rows: int):
        self.calls += 1
        self.rows.append(rows)
        if self.calls == self.fail_at:
            raise RuntimeError("injected device error")

    def _decode(self, tokens, positions):
        return torch.nn.functional.one_hot((tokens * 3 + positions) % VOCAB, VOCAB).float()

    def __call__(self, tokens, positions, slots):
        self._count(tokens.shape[0])
        return self._decode(tokens, positions)

    def mixed(self, tokens, positions, slots, chunks):
        self._count(tokens.shape[0])
        self.chunks += [(c.slot, c.start, c.ids.shape[0]) for c in chunks]
        lasts = torch.tensor([(int(c.ids[-1]) * 5 + c.start + c.ids.shape[0]) % VOCAB for c in chunks])
        return self._decode(tokens, positions), torch.nn.functional.one_hot(lasts, VOCAB).float()

    def prompt_budget(self, n: int, waiting: int) -> int:
        return CHUNK

    def rows_for(self, n: int, prompt_rows: int) -> int:
        return 0


def pool() -> KVPool:
    return KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=4, max_seq=512)


def expected(first: int, length: int, n: int) -> list[int]:
    out, tok = [], first
    for i in range(n):
        tok = nxt(tok, length + i)
        out.append(tok)
    return out


class Stream:
    """A sequence's sink: what it got, and the rows in use when its end came (its slot must be free by then)."""

    def __init__(self, p: KVPool, rid: int, first: int, length: int, n: int, eos: frozenset = frozenset(),
                 on_token=None, blocks_for: int | None = None):
        """blocks_for: the positions its lease gets blocks for (None: a whole context)."""
        self.pool, self.items, self.q, self.on_token = p, [], queue.Queue(), on_token
        self.used_at_end = None
        self.seq = Sequence(rid, p.try_lease(blocks_for), length, first, n, self.sink, eos=eos)

    def sink(self, item):
        if isinstance(item, Ended) or item.last:
            self.used_at_end = self.pool.used()
        self.items.append(item)
        self.q.put(item)
        if self.on_token is not None and isinstance(item, Token):
            self.on_token(self, item)

    def end(self) -> Token | Ended:
        """Wait for the stream's last item (a last token, or Ended)."""
        while True:
            item = self.q.get(timeout=WAIT_S)
            if isinstance(item, Ended) or item.last:
                return item

    def tokens(self) -> list[int]:
        return [t.token_id for t in self.items if isinstance(t, Token)]


def prompt_task(p: KVPool, prompt: list[int]) -> MixedPrefill:
    return MixedPrefill(torch.tensor(prompt, dtype=torch.long), p.try_lease(), False)


def hold(sched: Scheduler) -> threading.Event:
    """Hold the device thread between two steps until the returned event is set: what is asked for meanwhile waits
    for the next step together."""
    started, gate = threading.Event(), threading.Event()

    def wait():
        started.set()
        assert gate.wait(WAIT_S)
    sched.call(wait)
    assert started.wait(WAIT_S)
    return gate


PROMPT = [(7 * i + 3) % VOCAB for i in range(4 * CHUNK + 1)]  # five chunks: rides in five steps


# --- stops ---


@pytest.mark.parametrize("cause", [EndCause.REQUEST_ENDED, EndCause.SLOW_READER])
def test_a_stopped_stream_gets_no_token_after_the_stop_and_ends_with_its_cause_its_slot_free(cause):
    """Guards _drop_stopped for a row the step in flight holds: asked to stop at its 3rd token (from its sink, on
    the device thread: the next boundary is exactly known), it gets no 4th token (the queued row's token is
    dropped), then Ended with the cause it was stopped with, its slot free first; a prompt riding in the same
    steps still gets its first token and the other stream all its tokens."""
    p = pool()
    sched = Scheduler(FakeStep(), torch.device("cpu"))
    try:
        def stop_at_3(stream, tok):
            if tok.index == 3:
                stream.seq.stop("client cancelled", cause)
        a = Stream(p, 0, 5, 10, 1000, on_token=stop_at_3)
        b = Stream(p, 1, 7, 33, 20)
        task = prompt_task(p, PROMPT)
        gate = hold(sched)
        sched.add(a.seq)
        sched.add(b.seq)
        fut = sched.submit_mixed(task)
        gate.set()
        end = a.end()
        assert isinstance(end, Ended) and end.cause is cause and end.reason == "client cancelled"
        assert b.end().last and b.tokens() == expected(7, 33, 20)
        assert a.tokens() == expected(5, 10, 3) and a.items[-1] is end  # nothing after the stop, nothing after the end
        assert a.used_at_end <= 2  # its slot was free when its end came (b's and the prompt's held)
        assert fut.result(timeout=WAIT_S).first == first_of(PROMPT)
        task.lease.release()
        assert p.used() == 0
    finally:
        sched.close()


@pytest.mark.parametrize("cause", [EndCause.REQUEST_ENDED, EndCause.SLOW_READER])
def test_a_stream_stopped_before_its_first_step_ends_at_once_with_its_cause(cause):
    """Guards _drop_stopped for a row no step holds: stopped while it waits to join, it ends at the next boundary
    with its own cause, no token, its slot free."""
    p = pool()
    sched = Scheduler(FakeStep(), torch.device("cpu"))
    try:
        a = Stream(p, 0, 5, 10, 1000)
        gate = hold(sched)
        sched.add(a.seq)
        a.seq.stop("deadline exceeded", cause)
        gate.set()
        end = a.end()
        assert isinstance(end, Ended) and end.cause is cause and end.reason == "deadline exceeded"
        assert a.items == [end] and a.used_at_end == 0
    finally:
        sched.close()


def test_the_first_stop_wins():
    """Guards Sequence.stop: a request stopped for a slow reader, then again as its client leaves, ends with the
    first cause and reason (the status the client is told)."""
    p = pool()
    sched = Scheduler(FakeStep(), torch.device("cpu"))
    try:
        a = Stream(p, 0, 5, 10, 1000)
        gate = hold(sched)
        sched.add(a.seq)
        a.seq.stop("too many tokens unread", EndCause.SLOW_READER)
        a.seq.stop("client cancelled", EndCause.REQUEST_ENDED)
        gate.set()
        assert a.end() == Ended(EndCause.SLOW_READER, "too many tokens unread")
    finally:
        sched.close()


# --- EOS and max tokens while a prompt rides ---


def test_eos_and_the_last_token_end_streams_once_while_a_prompt_rides():
    """Guards _deliver's ending: a stream that makes a stop token ends with it (last, nothing after), one that
    reaches its count ends at it, each with its slot free; each leaves the running batch at the step that made its
    last token (kept there, it would count in `active` and spin the thread once nothing else runs), and the prompt
    riding in the same steps gets its own first token (not a decode row's)."""
    p = pool()
    sched = Scheduler(FakeStep(), torch.device("cpu"))
    try:
        full = expected(5, 10, 12)
        assert full.index(full[3]) == 3
        a = Stream(p, 0, 5, 10, 12, eos=frozenset([full[3]]))
        batch = []  # the running batch's size as b sees each of its tokens
        b = Stream(p, 1, 7, 33, 6, on_token=lambda stream, tok: batch.append(sched.active()))
        task = prompt_task(p, PROMPT)
        gate = hold(sched)
        sched.add(a.seq)
        sched.add(b.seq)
        fut = sched.submit_mixed(task)
        gate.set()
        ea, eb = a.end(), b.end()
        assert ea.last and a.tokens() == full[:4] and a.items[-1] is ea
        assert a.used_at_end <= 2 and b.used_at_end <= 1  # each slot free when its end came
        assert eb.last and b.tokens() == expected(7, 33, 6) and b.items[-1] is eb
        assert [t.index for t in b.items] == list(range(1, 7))
        assert batch == [2, 2, 2, 2, 1, 0]  # each stream leaves the batch at the step of its last token
        assert fut.result(timeout=WAIT_S).first == first_of(PROMPT)
        task.lease.release()
        assert p.used() == 0
    finally:
        sched.close()


def test_a_stream_costs_one_decode_row_per_token_and_none_after_its_last():
    """Guards which rows a step launches: a row whose last token is already queued (remaining 0) is not queued
    again (such a row's token is dropped, and its stream's end would wait one step more for it)."""
    p = pool()
    step = FakeStep()
    sched = Scheduler(step, torch.device("cpu"))
    try:
        a, b = Stream(p, 0, 5, 10, 5), Stream(p, 1, 7, 33, 3)
        gate = hold(sched)
        sched.add(a.seq)
        sched.add(b.seq)
        gate.set()
        assert a.end().last and b.end().last
        assert a.tokens() == expected(5, 10, 5) and b.tokens() == expected(7, 33, 3)
        assert sum(step.rows) == 5 + 3 and step.rows == [2, 2, 2, 1, 1]
        assert p.used() == 0
    finally:
        sched.close()


def test_a_preempted_stream_leaves_the_batch_at_once():
    """Guards the loop after make_room: the newest stream, preempted for a block the oldest needs, ends
    PREEMPTED with nothing else, and leaves the running batch at that boundary (`active`, what admission and the
    choice of a prompt's prefill path read, counts only the stream left; a preempted row kept there would also
    spin the thread once nothing else runs)."""
    p = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=4, max_seq=64, page=4, blocks=3)
    sched = Scheduler(FakeStep(), torch.device("cpu"))
    try:
        seen = []
        # one block each: the step at position 4 needs a second for both, and one is free
        old = Stream(p, 0, 5, 4, 6, on_token=lambda stream, tok: seen.append(sched.active()), blocks_for=4)
        new = Stream(p, 1, 7, 4, 6, blocks_for=4)
        assert p.free_blocks() == 1
        gate = hold(sched)
        sched.add(old.seq)
        sched.add(new.seq)
        gate.set()
        assert new.end() == Ended(EndCause.PREEMPTED, "recompute") and len(new.items) == 1
        assert old.end().last and old.tokens() == expected(5, 4, 6)
        assert seen == [1] * 5 + [0]  # the last token comes once the stream left the batch too
        assert p.used() == 0 and p.free_blocks() == 3
    finally:
        sched.close()


@pytest.mark.parametrize("released", [False, True], ids=["lease-held", "lease-released"])
def test_a_prompt_given_up_while_it_waits_never_rides_and_fails_nobody(released):
    """Guards PromptQueue.pieces: a prompt whose request gave up while it waited (its future cancelled at the
    deadline, its lease let go or not yet) takes no chunk; ridden anyway, its slot's hold or its first token would
    fail the step, and with it every running request. The prompt queued behind it still rides."""
    p = pool()
    step = FakeStep()
    sched = Scheduler(step, torch.device("cpu"))
    try:
        a = Stream(p, 0, 5, 10, 8)
        gone, kept = prompt_task(p, PROMPT), prompt_task(p, [4, 4, 2])
        gate = hold(sched)
        sched.add(a.seq)
        fut = sched.submit_mixed(gone)
        nxt_fut = sched.submit_mixed(kept)
        assert fut.cancel()
        if released:
            gone.lease.release()
        gate.set()
        end = a.end()
        assert end.last and a.tokens() == expected(5, 10, 8)
        assert nxt_fut.result(timeout=WAIT_S).first == first_of([4, 4, 2])
        assert all(slot != gone.lease.slot for slot, _, _ in step.chunks) and step.chunks
        if not released:
            gone.lease.release()
        kept.lease.release()
        assert p.used() == 0
    finally:
        sched.close()


# --- a failed step ---


def test_a_step_failed_on_the_device_ends_every_request_and_prompt_and_lets_go_of_every_hold():
    """Guards the loop's failure path when queueing step 4 raises (a device error; step 1 carries only a prompt):
    the running stream ends STEP_FAILED; the stream whose stop token came at step 2 (its end held for step 3, the
    step in flight) still ends with that token; the prompt whose last chunk rode in step 3, the one-chunk prompt
    and the prompt begun in step 4 all fail (none hangs); every slot is free once the prompts' own leases go; and
    a request that joins next decodes all its tokens (a failed prompt left in progress would ride on and fail it)."""
    p = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=8, max_seq=512)
    sched = Scheduler(FakeStep(fail_at=4), torch.device("cpu"))
    try:
        after = Stream(p, 3, 9, 5, 12)
        last_in_3 = prompt_task(p, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])  # chunks in steps 1, 2, 3
        one_chunk = prompt_task(p, [8])  # all of it in step 4
        begun = prompt_task(p, [(11 * i) % VOCAB for i in range(40)])  # its first 3 tokens in step 4
        futs = []

        def ask_at_1(stream, tok):  # on the device thread, after step 3's chunks were chosen
            if tok.index == 1:
                futs.extend(sched.submit_mixed(t) for t in (one_chunk, begun))

        def join_next(stream, tok):  # on the device thread, as the failure path hands out the last token
            if tok.last:
                sched.add(after.seq)
        a = Stream(p, 0, 5, 10, 1000, on_token=ask_at_1)
        e = Stream(p, 1, 7, 33, 50, eos=frozenset(expected(7, 33, 1)), on_token=join_next)
        gate = hold(sched)
        sched.add(a.seq)
        sched.add(e.seq)
        futs.append(sched.submit_mixed(last_in_3))
        gate.set()
        end = a.end()
        assert isinstance(end, Ended) and end.cause is EndCause.STEP_FAILED and "injected device error" in end.reason
        assert a.tokens() == expected(5, 10, 1)
        last = e.end()
        assert isinstance(last, Token) and last.last and e.tokens() == expected(7, 33, 1) and e.items == [last]
        assert len(futs) == 3
        for fut in futs:
            with pytest.raises(RuntimeError):
                fut.result(timeout=WAIT_S)
        assert after.end().last and after.tokens() == expected(9, 5, 12)
        for t in (last_in_3, one_chunk, begun):
            t.lease.release()
        assert p.used() == 0
    finally:
        sched.close()


def test_a_step_failed_while_delivering_lets_go_of_the_step_queued_after_it():
    """Guards the loop's failure path when delivering step 2 raises (here the step's metrics callback) while
    step 3 is already queued: the stream ends STEP_FAILED, the prompt riding in both steps fails, and both steps'
    holds are let go (every slot free once the prompt's lease goes)."""
    p = pool()
    delivered = []

    def on_step(stats):
        if stats.rows:
            delivered.append(stats)
            if len(delivered) == 2:
                raise RuntimeError("injected metrics error")
    sched = Scheduler(FakeStep(), torch.device("cpu"), on_step=on_step)
    try:
        a = Stream(p, 0, 5, 10, 1000)
        task = prompt_task(p, PROMPT)
        gate = hold(sched)
        sched.add(a.seq)
        fut = sched.submit_mixed(task)
        gate.set()
        end = a.end()
        assert isinstance(end, Ended) and end.cause is EndCause.STEP_FAILED and "injected metrics error" in end.reason
        with pytest.raises(RuntimeError):
            fut.result(timeout=WAIT_S)
        task.lease.release()
        assert p.used() == 0
    finally:
        sched.close()


# --- a stopping server ---


def test_a_stopping_scheduler_ends_every_request_job_and_prompt_and_frees_every_slot():
    """Guards the loop's shutdown: close() while a stream runs (its step in flight), one waits to join, a job
    waits, a one-chunk prompt's only chunk is in flight, one prompt is in progress and one waits: the streams end
    SHUTDOWN, the job and every prompt fail (none hangs), and every slot is free once the prompts' leases go."""
    p = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=8, max_seq=512)
    sched = Scheduler(FakeStep(), torch.device("cpu"))
    closer = threading.Thread(target=sched.close)
    try:
        a = Stream(p, 0, 5, 10, 10_000)
        b = Stream(p, 1, 7, 33, 20)
        gate = hold(sched)
        sched.add(a.seq)
        gate.set()
        assert a.q.get(timeout=WAIT_S).index == 1  # a runs, a step of it in flight
        gate = hold(sched)
        sched.add(b.seq)  # joins at the next boundary: after the close
        job = sched.call(lambda: "never run")
        tasks = [prompt_task(p, [8, 9]), prompt_task(p, PROMPT), prompt_task(p, PROMPT)]
        futs = [sched.submit_mixed(t) for t in tasks]  # one chunk; begun in the step queued now; waiting
        closer.start()
        with sched._cond:  # the thread is held: close() has set the flag once this returns
            assert sched._cond.wait_for(lambda: sched._closed, WAIT_S)
        gate.set()
        closer.join(WAIT_S)
        assert not closer.is_alive()
        for s in (a, b):
            end = s.end()
            assert isinstance(end, Ended) and end.cause is EndCause.SHUTDOWN, end
        assert b.items == [b.items[-1]] and a.tokens() == expected(5, 10, len(a.tokens()))
        with pytest.raises(RuntimeError, match="stopping"):
            job.result(timeout=WAIT_S)
        for fut in futs:
            with pytest.raises(RuntimeError):
                fut.result(timeout=WAIT_S)
        for t in tasks:
            t.lease.release()
        assert p.used() == 0
    finally:
        if not closer.is_alive():
            sched.close()


# --- a dead scheduler ---


def test_a_dead_scheduler_fails_every_request_it_held_and_every_later_one():
    """Guards _die (and add/submit after it): the thread dies after 4 steps (--fail-scheduler-after-steps) with
    a stream running, one waiting to join, a job in hand and one queued, a prompt in progress and one waiting:
    the streams end ENGINE_FAILED, the jobs and prompts fail with EngineFailed (none hangs), the one in hand closed;
    the server is told
    once; a sequence added later ends at once, and later work is refused."""
    p = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=8, max_seq=512)
    fail = 4
    fatal, died = [], threading.Event()

    def on_fatal(what, error):
        fatal.append(error)
        died.set()
    sched = Scheduler(FakeStep(), torch.device("cpu"), on_fatal=on_fatal, fail_after_steps=fail)
    try:
        b = Stream(p, 1, 7, 33, 20)

        def join_at_the_end(stream, tok):  # on the device thread: b waits to join when the thread dies
            if sched.steps == fail and not join_at_the_end.done:
                join_at_the_end.done = True
                sched.add(b.seq)
        join_at_the_end.done = False
        a = Stream(p, 0, 5, 10, 1000, on_token=join_at_the_end)

        closed = threading.Event()

        def forever():
            try:
                while True:
                    yield
            finally:  # a prefill's lease is released here
                closed.set()
        gate = hold(sched)
        sched.add(a.seq)
        job = forever()  # held here too, so only an explicit close (not the last reference dropped) runs its finally
        in_hand, queued = sched.submit(job), sched.call(lambda: "never run")
        tasks = [prompt_task(p, PROMPT * 4), prompt_task(p, PROMPT)]  # in progress; waiting behind it
        futs = [sched.submit_mixed(t) for t in tasks]
        gate.set()
        assert died.wait(WAIT_S)
        assert len(fatal) == 1 and isinstance(fatal[0], InjectedFault)
        assert closed.is_set()  # the job in hand closed, not left to the garbage collector
        for s in (a, b):
            end = s.end()
            assert isinstance(end, Ended) and end.cause is EndCause.ENGINE_FAILED, end
            assert "scheduler thread died" in end.reason
        assert b.items == [b.items[-1]] and a.tokens() == expected(5, 10, len(a.tokens()))
        for fut in (in_hand, queued, *futs):
            with pytest.raises(EngineFailed):
                fut.result(timeout=WAIT_S)
        late = Stream(p, 2, 9, 5, 10)
        used = p.used()
        sched.add(late.seq)  # ends here, on this thread, its slot let go first
        assert late.items == [Ended(EndCause.ENGINE_FAILED, sched.dead)] and late.used_at_end == used - 1
        with pytest.raises(EngineFailed):
            sched.submit_mixed(prompt_task(p, PROMPT))
        with pytest.raises(EngineFailed):
            sched.call(lambda: None)
    finally:
        sched.close()


def test_a_dead_scheduler_ends_what_its_step_in_flight_carried():
    """The step queued on the device when the thread dies is the scheduler's too: a stream whose stop token came in
    the step before gets its end (its last token) and its row back, and a prompt whose last chunk rides in that step
    gets an error. Before, `_die` never saw that step (a local of the loop): the stream never ended, the prompt's
    future never resolved (found by this file's mutation pass, in the unmodified code)."""
    p, died = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=8, max_seq=512), \
        threading.Event()
    sched = Scheduler(FakeStep(), torch.device("cpu"), on_fatal=lambda *_: died.set(), fail_after_steps=3)
    try:
        full = expected(5, 10, 10)
        e = Stream(p, 0, 5, 10, 10, eos=frozenset([full[2]]))
        gate = hold(sched)
        sched.add(e.seq)
        gate.set()
        assert died.wait(WAIT_S)
        last = e.end()
        assert isinstance(last, Token) and last.last and last.token_id == full[2], last
    finally:
        sched.close()
    p, died = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=8, max_seq=512), \
        threading.Event()
    sched = Scheduler(FakeStep(), torch.device("cpu"), on_fatal=lambda *_: died.set(), fail_after_steps=3)
    try:
        task, futs = prompt_task(p, [4, 4, 2]), []

        def at_step_2(_seq, _tok):
            if sched.steps == 2 and not futs:
                futs.append(sched.submit_mixed(task))
        a = Stream(p, 0, 5, 10, 1000, on_token=at_step_2)
        gate = hold(sched)
        sched.add(a.seq)
        gate.set()
        assert died.wait(WAIT_S)
        with pytest.raises(EngineFailed):
            futs[0].result(timeout=WAIT_S)
    finally:
        sched.close()
