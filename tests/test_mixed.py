"""Prefill chunks riding in decode steps (kvtransfer/engine/mixed.py), on CPU in fp32.

Why: the mixed forward computes two things in one pass; a row offset, a mask aligned the wrong
way or a K/V write into the wrong slot shows up as decode rows that stop matching the plain step
or a prompt whose cache stops matching a whole prefill.
"""

from __future__ import annotations

import queue

import pytest
import torch

from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.engine.mixed import Chunk, mixed_forward
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from kvtransfer.model.streaming import cache_layers

TOL = 1e-4  # fp32: other GEMM shapes than the plain step / whole prefill


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0))


def test_mixed_forward_matches_the_step_and_the_whole_prefill(tiny):
    g = CacheGeometry.from_config(tiny.config, torch.float32)
    pool = KVPool(g, torch.device("cpu"), slots=4, max_seq=128)
    r = StepRunner(tiny, pool)
    decoding = [random_prompt(tiny.config.vocab_size, n, seed=n)[0] for n in (20, 33)]
    for slot, p in enumerate(decoding):  # their caches, through the plain path
        cache, _ = prefill(tiny, p[None])
        for i, (k, v) in enumerate(cache_layers(cache)):
            pool.layer(i)[0][slot, :, :len(p)] = k[0]
            pool.layer(i)[1][slot, :, :len(p)] = v[0]
    tokens, positions, slots = torch.tensor([5, 9]), torch.tensor([20, 33]), torch.tensor([0, 1])
    plain = r.forward(tokens, positions, slots)  # (2, vocab); writes position 20 / 33 of slots 0 / 1
    prompt = random_prompt(tiny.config.vocab_size, 45, seed=7)[0]
    whole_cache, whole_logits = prefill(tiny, prompt[None])
    last = None
    for start in range(0, 45, 16):  # three chunks into slot 2, each riding with the two decode rows
        ids = prompt[start:start + 16]
        dec, lasts = mixed_forward(r, tokens, positions, slots, [Chunk(ids, 2, start, start + 16 >= 45)])
        assert (dec - plain).abs().max().item() <= TOL
        last = lasts[0]
    assert (last - whole_logits).abs().max().item() <= TOL
    for i, (k, v) in enumerate(cache_layers(whole_cache)):
        assert (pool.layer(i)[0][2, :, :45] - k[0]).abs().max().item() <= TOL
        assert (pool.layer(i)[1][2, :, :45] - v[0]).abs().max().item() <= TOL


def test_two_prompts_share_a_step_each_within_tolerance_of_its_whole_prefill(tiny):
    """The token budget (Step.chunk) packs the end of one prompt and the start of the next into one forward: each
    chunk's last-row logits and each prompt's cache still match its own whole prefill."""
    g = CacheGeometry.from_config(tiny.config, torch.float32)
    pool = KVPool(g, torch.device("cpu"), slots=4, max_seq=128)
    r = StepRunner(tiny, pool)
    a, b = (random_prompt(tiny.config.vocab_size, n, seed=n)[0] for n in (45, 30))
    none = torch.zeros(0, dtype=torch.long)
    steps = [[Chunk(a[:24], 2, 0, False)],  # a budget of 24 prompt tokens a step
             [Chunk(a[24:], 2, 24, True), Chunk(b[:3], 3, 0, False)],
             [Chunk(b[3:27], 3, 3, False)],
             [Chunk(b[27:], 3, 27, True)]]
    lasts = [mixed_forward(r, none, none, none, chunks)[1] for chunks in steps]
    for prompt, slot, got in ((a, 2, lasts[1][0]), (b, 3, lasts[3][0])):
        cache, want = prefill(tiny, prompt[None])
        assert (got - want).abs().max().item() <= TOL
        for i, (k, v) in enumerate(cache_layers(cache)):
            assert (pool.layer(i)[0][slot, :, :len(prompt)] - k[0]).abs().max().item() <= TOL
            assert (pool.layer(i)[1][slot, :, :len(prompt)] - v[0]).abs().max().item() <= TOL


def _engine(model, max_batch: int = 4, **kw) -> DecodeEngine:
    lm = LoadedModel(ModelSpec("tiny", "float32", 0), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    return DecodeEngine(lm, EngineOptions(max_batch=max_batch, max_seq_len=256, cuda_graphs=False, **kw))


def _record_steps(monkeypatch) -> tuple[list, list]:
    """Every mixed step from now on: its chunks as (start, tokens) and its size (Step.rows_for)."""
    from kvtransfer.engine.graphs import Step

    pieces, rows = [], []
    mixed = Step.mixed

    def recording(self, tokens, positions, slots, chunks):
        pieces.append([(c.start, c.ids.shape[0]) for c in chunks])
        rows.append(self.rows_for(tokens.shape[0], sum(c.ids.shape[0] for c in chunks)))
        return mixed(self, tokens, positions, slots, chunks)
    monkeypatch.setattr(Step, "mixed", recording)
    return pieces, rows


def _queued_together(e: DecodeEngine, prompts: list[list[int]]) -> tuple[list, list]:
    """Ask for all the prompts' prefills while the device thread waits between two steps, so the next step sees
    them all queued; returns (their first tokens, their leases)."""
    import threading

    gate = threading.Event()
    held = e.scheduler.call(gate.wait, 60)
    leases = [e.pool.try_lease() for _ in prompts]
    futs = [e.prefill(p, lease, False) for p, lease in zip(prompts, leases)]
    gate.set()
    held.result(timeout=60)
    return [f.result(timeout=60).first for f in futs], leases


def _settle(e: DecodeEngine, leases: list, decoding) -> None:
    """Let go of the queued prompts' slots, wait for the request decoding meanwhile: every slot is free again."""
    for lease in leases:
        lease.release()
    decoding.join(timeout=60)
    assert e.pool.used() == 0


def _decode(e: DecodeEngine, prompt: list[int], steps: int, started: list | None = None) -> list[int]:
    lease = e.pool.try_lease()
    first = e.prefill(prompt, lease, False).result(timeout=60).first
    q: queue.Queue = queue.Queue()
    e.scheduler.add(Sequence(len(prompt), lease, len(prompt), first, steps, q.put))
    out = [first]
    while True:
        t = q.get(timeout=60)
        assert not isinstance(t, Ended), t
        out.append(t.token_id)
        if started is not None and len(out) == 3:
            started.append(True)
        if t.last:
            return out


def _decoding_meanwhile(e: DecodeEngine, prompt: list[int], steps: int, got: dict):
    """Start decoding `prompt` on a thread (its tokens into got["other"]); returns the thread once the request is
    in the running batch (its second token arrived)."""
    import threading

    started: list = []
    t = threading.Thread(target=lambda: got.update(other=_decode(e, prompt, steps, started)))
    t.start()
    while not started:
        pass
    return t


# Steps the request decoding meanwhile takes: enough that it still decodes while the other prompts' chunks (4, then
# 2 steps) ride beside it, however late this thread submits them on a loaded machine.
OTHER_STEPS = 120


def test_prompts_prefilled_inside_decode_steps_decode_to_the_same_tokens(tiny, monkeypatch):
    """A long prompt (4 chunks) prefilled while another request decodes, its chunks riding in that request's steps:
    both requests' tokens equal those of the plain engine, and every slot is free afterwards."""
    long_prompt = random_prompt(tiny.config.vocab_size, 61, seed=3)[0].tolist()
    other = random_prompt(tiny.config.vocab_size, 12, seed=4)[0].tolist()
    plain = _engine(tiny)
    want_long, want_other = _decode(plain, long_prompt, 10), _decode(plain, other, OTHER_STEPS)
    plain.close()
    from kvtransfer.engine.graphs import Step

    rows, pieces = [], []  # decode rows and prompt chunks of every mixed forward
    mixed = Step.mixed

    def recording(self, tokens, positions, slots, chunks):
        rows.append(tokens.shape[0])
        pieces.append([(c.slot, c.start, c.ids.shape[0]) for c in chunks])
        return mixed(self, tokens, positions, slots, chunks)
    monkeypatch.setattr(Step, "mixed", recording)
    e = _engine(tiny, prefill_chunk=17, mixed_prefill=True)  # 16 prompt rows beside one decode row
    try:
        got = {}
        t = _decoding_meanwhile(e, other, OTHER_STEPS, got)
        steps_before = e.scheduler.steps
        got["long"] = _decode(e, long_prompt, 10)
        t.join(timeout=60)
        assert got == {"long": want_long, "other": want_other}
        assert e.scheduler.steps > steps_before and e.pool.used() == 0
        assert len(rows) == 4 and all(b == 1 for b in rows)  # 61 tokens = 4 chunks, each beside the decoding row
        # a prompt that fits one chunk with nothing decoding takes the plain prefill (bit-identical alone)
        assert _decode(e, other, 5) == want_other[:6]
        # two prompts asked for together while one decodes: the end of the first and the start of the second
        # share a step's 16-token budget, and both decode to the plain engine's tokens
        short = random_prompt(tiny.config.vocab_size, 20, seed=5)[0].tolist()
        want_short = _decode(plain_engine := _engine(tiny), short, 6)
        plain_engine.close()
        t = _decoding_meanwhile(e, other, OTHER_STEPS, got)
        del pieces[:]
        leases = [e.pool.try_lease(), e.pool.try_lease()]
        with e.scheduler._cond:  # both queued before a step looks (its lock): no step may see the first alone
            futs = [e.prefill(p, lease, False) for p, lease in zip((short, other), leases)]
        firsts = [f.result(timeout=60).first for f in futs]
        assert [firsts[0], firsts[1]] == [want_short[0], want_other[0]]
        assert [[(start, n) for _, start, n in p] for p in pieces] == [[(0, 16)], [(16, 4), (0, 12)]]  # 20 + 12 tokens
        _settle(e, leases, t)
        assert got["other"] == want_other
    finally:
        e.close()


def test_a_mixed_step_leaves_rows_for_prompt_chunks(tiny):
    from kvtransfer.engine.graphs import Step

    pool = KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=8, max_seq=64)
    with pytest.raises(ValueError, match=r"2 x --max-batch \(16\)"):
        EngineOptions(max_batch=8, prefill_chunk=15, mixed_prefill=True)
    step = Step(StepRunner(tiny, pool), max_batch=8, cuda_graphs=False, chunk=24)
    assert [step.prompt_budget(n, 0) for n in (0, 1, 3, 8)] == [24, 23, 21, 16]  # rows left beside n decode rows


def test_mixed_prefill_needs_a_chunk_size():
    with pytest.raises(ValueError, match="--prefill-chunk"):
        EngineOptions(mixed_prefill=True)


def test_the_server_refuses_a_mixed_step_with_no_room_for_prompt_rows():
    from decode_server.config import DecodeConfig

    with pytest.raises(ValueError, match=r"--prefill-chunk 64 with --mixed-prefill .* >= 2 x --max-batch \(128\)"):
        DecodeConfig(colocated=True, max_batch=64, prefill_chunk=64, mixed_prefill=True)
    DecodeConfig(colocated=True, max_batch=64, prefill_chunk=256, mixed_prefill=True)


def test_a_larger_step_runs_only_when_the_prompt_tokens_waiting_fill_it(tiny):
    """--mixed-max-rows: steps of 24, 48 and 96 rows (not 192: over 100); beside n decode rows (bucket b) a step
    takes the largest size whose c - n prompt rows the tokens waiting fill, else the smallest."""
    from kvtransfer.engine.graphs import Step
    from kvtransfer.engine.mixed import step_sizes

    assert step_sizes(24, 100) == [24, 48, 96] and step_sizes(24, 0) == [24]
    pool = KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=8, max_seq=64)
    with pytest.raises(ValueError, match=r"--mixed-max-rows 40 must be >= 2 x --prefill-chunk \(48\)"):
        EngineOptions(max_batch=8, prefill_chunk=24, mixed_prefill=True, mixed_max_rows=40)
    step = Step(StepRunner(tiny, pool), max_batch=8, cuda_graphs=False, chunk=24, max_rows=100)
    assert step.sizes == [24, 48, 96]
    # n = 3 decode rows (bucket 4: its fourth row takes a prompt token, mixed.lay_out): c - 3 prompt rows
    assert [step.prompt_budget(3, w) for w in (1, 44, 45, 92, 93, 500)] == [21, 21, 45, 45, 93, 93]
    assert [step.rows_for(3, r) for r in (1, 21, 22, 45, 46, 93, 94)] == [24, 24, 48, 48, 96, 96, 0]
    assert Step(StepRunner(tiny, pool), 8, False, chunk=24).prompt_budget(3, 500) == 21  # one size only


def test_a_step_with_little_prompt_work_takes_a_smaller_size_of_the_ladder(tiny):
    """--prefill-chunk 512: steps of 128, 256 and 512 rows; a step takes every waiting prompt token in the smallest
    size that holds them beside its n decode rows, a size holds at most half decode rows (its bucket b), and when more
    wait than the budget leaves, the whole 512 rows."""
    from kvtransfer.engine.graphs import Step
    from kvtransfer.engine.mixed import step_sizes

    assert step_sizes(512, 0) == [128, 256, 512] and step_sizes(512, 1024) == [128, 256, 512, 1024]
    assert step_sizes(384, 0) == [192, 384] and step_sizes(200, 0) == [200]  # halves while >= MIN_STEP_ROWS
    pool = KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=8, max_seq=64)
    step = Step(StepRunner(tiny, pool), max_batch=80, cuda_graphs=False, chunk=512)
    # 3 decode rows (bucket 4, its last row a prompt row): 10 waiting -> 125 rows of a 128-row step; 126 -> 256;
    # 300 -> 512; 600 -> the budget
    assert [step.prompt_budget(3, w) for w in (0, 10, 125, 126, 253, 254, 509, 600)] == [125] * 3 + [253] * 2 + [
        509] * 3
    assert [step.rows_for(3, r) for r in (1, 125, 126, 253, 254, 509, 510)] == [128, 128, 256, 256, 512, 512, 0]
    # 65 decode rows (bucket 80): no 128-row step (most rows would decode); 100 waiting -> a 256-row step
    assert step.prompt_budget(65, 100) == 191 and step.rows_for(65, 100) == 256 and step.rows_for(65, 40) == 256
    assert step.prompt_budget(65, 1000) == 447 and step.rows_for(65, 448) == 0


def test_prompts_waiting_together_ride_in_one_larger_step(tiny, monkeypatch):
    """Two 20-token prompts queued while one request decodes (--prefill-chunk 17, --mixed-max-rows 34): one step
    of 34 rows carries 33 of their 40 tokens (one of 17 would carry 16), the rest ride in a 17-row step, and
    every request decodes to the plain engine's tokens."""
    prompts = [random_prompt(tiny.config.vocab_size, 20, seed=s)[0].tolist() for s in (5, 6)]
    other = random_prompt(tiny.config.vocab_size, 12, seed=4)[0].tolist()
    plain = _engine(tiny)
    want = [_decode(plain, p, 1) for p in prompts]
    want_other = _decode(plain, other, 40)
    plain.close()
    pieces, rows = _record_steps(monkeypatch)
    e = _engine(tiny, prefill_chunk=17, mixed_prefill=True, mixed_max_rows=34)
    try:
        got = {}
        t = _decoding_meanwhile(e, other, 40, got)
        firsts, leases = _queued_together(e, prompts)
        assert firsts == [w[0] for w in want]
        assert pieces[:2] == [[(0, 20), (0, 13)], [(13, 7)]] and rows[:2] == [34, 17]
        _settle(e, leases, t)
        assert got["other"] == want_other
    finally:
        e.close()


def test_mixed_max_rows_need_mixed_prefill_and_room():
    from decode_server.config import DecodeConfig

    with pytest.raises(ValueError, match="--mixed-max-rows sizes the steps of --mixed-prefill"):
        DecodeConfig(colocated=True, mixed_max_rows=1024)
    with pytest.raises(ValueError, match=r"--mixed-max-rows 300 must be >= 2 x --prefill-chunk \(512\)"):
        DecodeConfig(colocated=True, max_batch=64, prefill_chunk=256, mixed_prefill=True, mixed_max_rows=300)
    DecodeConfig(colocated=True, max_batch=64, prefill_chunk=256, mixed_prefill=True, mixed_max_rows=1024)


def test_a_larger_step_counts_only_the_prompts_that_can_ride_in_it(tiny, monkeypatch):
    """Eight 5-token prompts queued while one request decodes (--prefill-chunk 18, --mixed-max-rows 36): a step
    takes at most MAX_PIECES = 4 prompts, 20 tokens, which do not fill the 36-row step's 35 prompt rows, so the
    18-row step runs full (17 prompt rows) instead of a 36-row one padded by 15 rows."""
    prompts = [random_prompt(tiny.config.vocab_size, 5, seed=20 + s)[0].tolist() for s in range(8)]
    other = random_prompt(tiny.config.vocab_size, 12, seed=4)[0].tolist()
    pieces, rows = _record_steps(monkeypatch)
    e = _engine(tiny, max_batch=9, prefill_chunk=18, mixed_prefill=True, mixed_max_rows=36)
    try:
        got = {}
        t = _decoding_meanwhile(e, other, 40, got)
        _, leases = _queued_together(e, prompts)
        # bucket(1) = 1: the 18-row step has 17 prompt rows, the 36-row one 35
        assert pieces[0] == [(0, 5), (0, 5), (0, 5), (0, 2)] and rows[0] == 18
        _settle(e, leases, t)
    finally:
        e.close()


def test_the_oldest_prompt_gets_each_steps_first_prompt_rows(tiny, monkeypatch):
    """Three 40-token prompts queued together (--prefill-chunk 17: 17 prompt rows a step, none decoding): each
    step's first rows go to the oldest prompt not yet handed out, a newer one starts only in the rows that the
    older ones leave, and the prompts finish in the order they came. A prompt that jumped ahead would starve those
    queued before it, yet every token would stay right: only this order shows it."""
    import threading

    from kvtransfer.engine.graphs import Step

    prompts = [random_prompt(tiny.config.vocab_size, 40, seed=30 + s)[0].tolist() for s in range(3)]
    pieces, mixed = [], Step.mixed  # every mixed step's chunks as (slot, start, tokens)

    def recording(self, tokens, positions, slots, chunks):
        pieces.append([(c.slot, c.start, c.ids.shape[0]) for c in chunks])
        return mixed(self, tokens, positions, slots, chunks)
    monkeypatch.setattr(Step, "mixed", recording)
    e = _engine(tiny, prefill_chunk=17, mixed_prefill=True)
    try:
        gate, finished = threading.Event(), []
        held = e.scheduler.call(gate.wait, 60)  # the device thread waits: the next step sees all three queued
        leases = [e.pool.try_lease() for _ in prompts]
        futs = [e.prefill(p, lease, False) for p, lease in zip(prompts, leases)]
        for i, f in enumerate(futs):
            f.add_done_callback(lambda _, i=i: finished.append(i))
        gate.set()
        held.result(timeout=60)
        for f in futs:
            f.result(timeout=60)
        name = {lease.slot: "abc"[i] for i, lease in enumerate(leases)}
        steps = [[(name[slot], start, n) for slot, start, n in step] for step in pieces]
        assert steps == [[("a", 0, 17)], [("a", 17, 17)], [("a", 34, 6), ("b", 0, 11)], [("b", 11, 17)],
                         [("b", 28, 12), ("c", 0, 5)], [("c", 5, 17)], [("c", 22, 17)], [("c", 39, 1)]]
        assert finished == [0, 1, 2]
        for lease in leases:
            lease.release()
        assert e.pool.used() == 0
    finally:
        e.close()


@pytest.mark.parametrize("page", [0, 8])
def test_the_rows_a_bucket_leaves_carry_prompt_tokens_as_the_unpadded_step(tiny, page):
    """The graphs' layout, run eagerly (Step staged): 9 decode rows in the 16-row bucket leave 7 rows, which take a
    5-token chunk whole and a 30-token chunk's first 2 tokens, attending as decode rows; the rest of that chunk
    attends through the chunk kernel from row 16, then padding to 64 rows. Decode logits, each chunk's last
    logits and every K/V written equal the unpadded eager step's within fp32 rounding (the two attention paths
    sum in other orders). Fails if the bucket's free rows are attended as padding, or the chunk table misses the
    tokens they took."""
    from kvtransfer.engine.graphs import Step

    torch.manual_seed(0)
    pool = KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=16, max_seq=64,
                  page=page)
    leases = [pool.try_lease(64) for _ in range(11)]
    pool.kv.normal_()
    step = Step(StepRunner(tiny, pool), max_batch=16, cuda_graphs=False, chunk=64, staged=True)
    assert step.staged and step.rows_for(9, 35) == 64 and step.bucket(9) == 16
    g = torch.Generator().manual_seed(1)
    vocab = tiny.config.vocab_size
    tokens = torch.randint(3, vocab, (9,), generator=g)
    positions = torch.randint(10, 40, (9,), generator=g)
    slots = torch.tensor([x.slot for x in leases[:9]])
    chunks = [Chunk(torch.randint(3, vocab, (5,), generator=g), leases[9].slot, 20, True),
              Chunk(torch.randint(3, vocab, (30,), generator=g), leases[10].slot, 7, False)]
    before = pool.kv.clone()
    want_dec, want_last = mixed_forward(step.runner, tokens, positions, slots, chunks)
    want_kv = pool.kv.clone()
    pool.kv.copy_(before)
    got_dec, got_last = step.mixed(tokens, positions, slots, chunks)
    scale = want_dec.abs().max()
    assert got_dec.shape == want_dec.shape and got_last.shape == want_last.shape == (2, vocab)
    assert (got_dec - want_dec).abs().max() <= 1e-4 * scale and (got_last - want_last).abs().max() <= 1e-4 * scale
    rows = [(s, p) for s, p in zip(slots.tolist(), positions.tolist())]
    rows += [(c.slot, c.start + i) for c in chunks for i in range(c.ids.shape[0])]
    for slot, pos in rows:  # every position the step wrote, through the pool's own view of a slot
        want = [torch.stack(kv) for kv in pool_layers(pool, want_kv, slot, pos)]
        got = [torch.stack(kv) for kv in pool_layers(pool, pool.kv, slot, pos)]
        for w, x in zip(want, got):
            torch.testing.assert_close(x, w, rtol=1e-4, atol=1e-4)


def pool_layers(pool: KVPool, kv: torch.Tensor, slot: int, pos: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Position `pos` of `slot` in every layer of `kv` (a pool tensor or a copy of one): [(k, v)] each (Hkv, D)."""
    saved = pool.kv.clone()
    pool.kv.copy_(kv)
    try:
        return [(k[0, :, pos].clone(), v[0, :, pos].clone()) for k, v in pool.layers_of(slot, pos + 1)]
    finally:
        pool.kv.copy_(saved)


def test_the_side_stream_is_joined_when_a_launch_fails(tiny, monkeypatch):
    """The prompt rows' attention goes to a side stream (engine/side_stream.py) and writes into the step's one
    output; if the decode rows' launch then fails, the step's stream still waits for the side stream before that
    output can be freed and handed out again (a join skipped would let a later allocation race the chunk kernel)."""
    from contextlib import contextmanager

    from kvtransfer.kernels import ops

    pool = KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=4, max_seq=64)
    runner = StepRunner(tiny, pool)
    events = []

    class Recorder:
        @contextmanager
        def fork(self):
            events.append("fork")
            yield

        def join(self):
            events.append("join")
    runner.side = Recorder()

    def fails(*args, **kw):
        raise RuntimeError("CUDA out of memory (injected)")
    monkeypatch.setattr(ops, "decode_attention", fails)
    lease = pool.try_lease(64)
    chunk = Chunk(torch.arange(3, 8), lease.slot, 0, True)
    with pytest.raises(RuntimeError, match="injected"):
        mixed_forward(runner, torch.tensor([5]), torch.tensor([3]), torch.tensor([lease.slot]), [chunk])
    assert events == ["fork", "join"]
