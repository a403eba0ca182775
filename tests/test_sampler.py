"""Sampling (kvtransfer/engine/sampler.py): the draw's definition, its batch invariance, and the engine's use of it.

What is claimed (and tested here, on CPU; the captured Sampler on CUDA at the end, `gpu`):
- greedy rows (temperature 0) are argmax bit for bit, alone or beside sampling rows; top_k 1 and a tiny top_p are
  argmax too;
- the uniform is SplitMix64 keyed by the seed, its position-th output (a pure-python reference pins it);
- a row's token depends on (seed, position, its logits) alone: the same alone and in batches of 2..8 beside rows
  with other parameters; other seeds give other tokens;
- top_k / top_p never pick outside the kept set, and over many positions the draws follow softmax(logits / T)
  restricted to it (fixed seeds: deterministic, with a loose bound);
- the engine draws each decode row at position length + 1 and a prompt's first token at the prompt's length, as
  a reference loop over `runner.forward` + `sample` does; a step of greedy rows never touches the sampler.
"""

from __future__ import annotations

import queue

import pytest
import torch

from kvtransfer.engine import sampler as sampler_mod
from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.engine.sampler import Draws, SamplingParams, first_token, next_tokens, sample, uniform
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model

M64 = (1 << 64) - 1


def ref_uniform(seed: int, position: int) -> float:
    """SplitMix64 in plain python: started at mix(seed), output number `position` (from 0), top 53 bits."""
    def mix(z: int) -> int:
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
        return z ^ (z >> 31)
    z = mix((mix(seed & M64) + (position + 1) * 0x9E3779B97F4A7C15) & M64)
    return (z >> 11) * 2.0 ** -53


def draw(logits: torch.Tensor, params: list[SamplingParams | None], positions: list[int]) -> torch.Tensor:
    """`sample` over rows given as SamplingParams, as the engine builds them."""
    floats, ints = Draws(params, positions).tensors()
    return sample(logits, floats[:, 0], floats[:, 1], ints[:, 0], ints[:, 1], ints[:, 2])


def rand_logits(n: int, vocab: int, seed: int, dtype=torch.float32, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * scale).to(dtype)


def test_uniform_is_splitmix64_of_seed_and_position():
    seeds = [0, 1, 7, 2**32 + 5, 2**63 - 1, 2**63, 2**64 - 1]
    positions = [0, 1, 2, 17, 4096, 2**40]
    s = torch.tensor([sampler_mod._signed(x) for x in seeds for _ in positions])
    p = torch.tensor([y for _ in seeds for y in positions])
    assert uniform(s, p).tolist() == [ref_uniform(x, y) for x in seeds for y in positions]
    u = uniform(torch.full((20000,), 7), torch.arange(20000))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / 20000
    assert (hist - 0.1).abs().max() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_argmax_bit_for_bit(dtype):
    logits = rand_logits(8, 1000, 1, dtype)
    logits[3, [10, 500]] = logits[3].max() + 1  # a tie: the lowest id wins, as argmax's
    want = logits.argmax(-1)
    assert torch.equal(draw(logits, [None] * 8, list(range(8))), want)
    assert torch.equal(draw(logits, [SamplingParams(0.0, 0.5, 3, 9)] * 8, list(range(8))), want)
    assert torch.equal(next_tokens(logits), want)
    assert int(first_token(logits[3])) == int(first_token(logits[3], SamplingParams(), 5)) == 10
    mixed = [None if j % 2 else SamplingParams(1.0, 0.9, 0, j) for j in range(8)]  # every other row samples
    got = draw(logits, mixed, list(range(8)))
    assert torch.equal(got[1::2], want[1::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_1_and_a_tiny_top_p_are_argmax(dtype):
    logits = rand_logits(6, 777, 2, dtype)
    want = logits.argmax(-1)
    for seed in range(20):
        for params in (SamplingParams(1.5, 1.0, 1, seed), SamplingParams(0.8, 1e-6, 0, seed),
                       SamplingParams(100.0, 1e-6, 50, seed)):
            assert torch.equal(draw(logits, [params] * 6, [seed * 31 + j for j in range(6)]), want)


@pytest.mark.parametrize("vocab", [512, 1003, 8192])
def test_a_rows_token_does_not_depend_on_its_batch(vocab):
    """Row 0 alone, then at every place in batches of 2..8 beside rows of other logits and other parameters."""
    g = torch.Generator().manual_seed(vocab)
    for dtype in (torch.float32, torch.bfloat16):
        for trial in range(4):
            row = rand_logits(1, vocab, 100 + trial, dtype, scale=2.0)
            p = SamplingParams(1.0, 0.9, 0, 7 + trial) if trial % 2 else SamplingParams(0.7, 1.0, 40, 11 + trial)
            pos = 33 + trial
            alone = int(draw(row, [p], [pos])[0])
            for n in range(2, 9):
                others = rand_logits(n - 1, vocab, 1000 * n + trial, dtype, scale=float(1 + n))
                at = int(torch.randint(0, n, (1,), generator=g))
                logits = torch.cat([others[:at], row, others[at:]])
                params = [SamplingParams(0.5 + 0.3 * j, 0.5 + 0.05 * j, j, 1000 + j) if j % 3 else None
                          for j in range(n - 1)]
                params.insert(at, p)
                positions = [5 * j + 1 for j in range(n - 1)]
                positions.insert(at, pos)
                assert int(draw(logits, params, positions)[at]) == alone, (vocab, dtype, trial, n, at)


def test_same_seed_position_logits_same_token_other_seeds_other_tokens():
    logits = rand_logits(1, 512, 3, scale=0.5).expand(400, 512).contiguous()  # flat-ish: many tokens likely
    positions = list(range(100, 500))
    a = draw(logits, [SamplingParams(1.0, 1.0, 0, 7)] * 400, positions)
    assert torch.equal(a, draw(logits, [SamplingParams(1.0, 1.0, 0, 7)] * 400, positions))
    b = draw(logits, [SamplingParams(1.0, 1.0, 0, 8)] * 400, positions)
    assert (a != b).float().mean() > 0.8
    c = draw(logits, [SamplingParams(1.0, 1.0, 0, 7)] * 400, [x + 1 for x in positions])
    assert (a != c).float().mean() > 0.8  # the position is part of the draw
    assert len(set(a.tolist())) > 100  # not stuck on a few tokens


def test_top_k_and_top_p_never_pick_outside_the_kept_set():
    logits = rand_logits(64, 300, 4, scale=2.0)
    probs = logits.double().softmax(-1)
    for top_k, top_p in ((5, 1.0), (0, 0.5), (20, 0.3), (0, 0.9)):
        for seed in range(10):
            toks = draw(logits, [SamplingParams(1.0, top_p, top_k, seed)] * 64, [seed * 64 + j for j in range(64)])
            for j, t in enumerate(toks.tolist()):
                order = probs[j].argsort(descending=True).tolist()
                rank = order.index(t)
                assert not top_k or rank < top_k
                assert probs[j][order[:rank]].sum() < top_p + 1e-6  # the mass before it is under top_p


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.7)])
def test_draws_follow_the_softmax_over_the_kept_set(temperature, top_k, top_p):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.7, 0.2, 0.0, -0.5, -1.0, -2.0, -3.0]])
    n = 20000
    toks = draw(logits.expand(n, 10).contiguous(), [SamplingParams(temperature, top_p, top_k, 12345)] * n,
                list(range(n)))
    want = (logits[0].double() / temperature).softmax(-1)  # already in descending order
    keep = torch.ones(10, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    before = want.cumsum(0) - want
    keep &= before < top_p
    want = torch.where(keep, want, 0.0)
    want /= want.sum()
    got = torch.bincount(toks, minlength=10).double() / n
    assert (got - want).abs().max() < 0.015, (got, want)  # ~4 standard deviations at n = 20000
    assert got[~keep].sum() == 0


# --- the engine ---


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0))


def make_engine(tiny, **kw) -> DecodeEngine:
    lm = LoadedModel(ModelSpec("tiny", "float32", 0), tiny, CacheGeometry.from_config(tiny.config, torch.float32),
                     torch.device("cpu"))
    return DecodeEngine(lm, EngineOptions(max_batch=4, max_seq_len=256, cuda_graphs=False, **kw))


@pytest.fixture(scope="module")
def engine(tiny):
    e = make_engine(tiny)
    yield e
    e.close()


def run(engine: DecodeEngine, prompts, params, steps: int = 8) -> list[list[int]]:
    """Prefill each prompt (its first token drawn with its params), then decode them together."""
    runs = []
    for ids, p in zip(prompts, params):
        lease = engine.pool.try_lease()
        first = engine.prefill(ids, lease, False, p).result(timeout=60).first
        q: queue.Queue = queue.Queue()
        runs.append(([first], q, Sequence(1, lease, len(ids), first, steps, q.put, sampling=p)))
    for _, _, s in runs:
        engine.scheduler.add(s)
    for toks, q, _ in runs:
        while True:
            t = q.get(timeout=60)
            assert not isinstance(t, Ended), t
            toks.append(t.token_id)
            if t.last:
                break
    assert engine.pool.used() == 0
    return [toks for toks, _, _ in runs]


def reference(engine: DecodeEngine, ids: list[int], p: SamplingParams | None, steps: int) -> list[int]:
    """The prompt alone: the prefill's logits drawn at position len(ids), then one `runner.forward` row per step,
    its input at index `length` of the slot, drawn at position length + 1."""
    lease = engine.pool.try_lease()
    try:
        cache, logits = prefill(engine.m.model, torch.tensor([ids]))
        for (dk, dv), layer in zip(engine.pool.views(lease.slot, len(ids)), cache.layers):
            dk.copy_(layer.keys)
            dv.copy_(layer.values)
        toks = [int(first_token(logits, p, len(ids)))]
        for i in range(steps):
            length = len(ids) + i
            out = engine.runner.forward(torch.tensor([toks[-1]]), torch.tensor([length]), torch.tensor([lease.slot]))
            toks.append(int(draw(out, [p], [length + 1])[0]))
        return toks
    finally:
        lease.release()


PROMPTS = [random_prompt(512, n, seed=n)[0].tolist() for n in (30, 77, 5, 120)]


def test_the_engine_draws_at_the_stated_positions(engine):
    p = SamplingParams(1.0, 0.9, 0, 7)
    got = run(engine, PROMPTS[:1], [p], steps=12)[0]
    assert got == reference(engine, PROMPTS[0], p, 12)
    assert got == run(engine, PROMPTS[:1], [p], steps=12)[0]  # reproducible
    assert got != run(engine, PROMPTS[:1], [SamplingParams(1.0, 0.9, 0, 8)], steps=12)[0]
    assert run(engine, PROMPTS[:1], [None])[0] == reference(engine, PROMPTS[0], None, 8)


def test_rows_in_one_batch_each_draw_their_own(engine):
    """Greedy and sampling rows together: each row's tokens as its reference alone (tiny fp32: the batch's logits
    are within BATCH_TOL of alone, far below these margins)."""
    params = [SamplingParams(1.0, 0.9, 0, 7), None, SamplingParams(0.8, 1.0, 20, 3), SamplingParams(1.2, 0.95, 0, 9)]
    got = run(engine, PROMPTS, params)
    assert got == [reference(engine, ids, p, 8) for ids, p in zip(PROMPTS, params)]


def test_a_greedy_step_never_touches_the_sampler(engine, monkeypatch):
    calls = []
    monkeypatch.setattr(sampler_mod, "sample", lambda *a: calls.append(1) or pytest.fail("sampled"))
    monkeypatch.setattr(type(engine.step.sampler), "__call__", lambda *a: pytest.fail("sampler called"))
    assert run(engine, PROMPTS[:3], [None, SamplingParams(0.0, 0.5, 3, 1), None], steps=4)
    assert not calls


def test_a_mixed_prefill_draws_the_first_token_at_the_prompts_length(tiny):
    """--mixed-prefill: the prompt's first token comes out of a decode step; it is drawn from that step's last row
    of the prompt at position len(prompt), as a whole prefill's would be."""
    e = make_engine(tiny, prefill_chunk=16, mixed_prefill=True)
    lasts = []
    mixed = e.step.mixed

    def keep(*a):
        logits, last = mixed(*a)
        lasts.append(last.clone())
        return logits, last
    e.step.mixed = keep
    try:
        p = SamplingParams(1.0, 0.9, 0, 21)
        lease = e.pool.try_lease()
        ids = PROMPTS[1]  # 77 tokens: 5 chunks
        first = e.prefill(ids, lease, False, p).result(timeout=60).first
        lease.release()
        assert first == int(first_token(lasts[-1][0], p, len(ids)))
    finally:
        e.close()


# --- CUDA: the captured sampler ---



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_sampler_equals_eager_on_cuda():
    from kvtransfer.engine.graphs import buckets
    from kvtransfer.engine.sampler import Sampler

    dev = torch.device("cuda")
    vocab = 49152
    s = Sampler(vocab, torch.bfloat16, dev, buckets(16), cuda_graphs=True)
    assert set(s.graphs) == set(buckets(16))
    seeds, positions = torch.arange(-50, 50) * 977, torch.arange(100) * 13
    assert torch.equal(uniform(seeds.to(dev), positions.to(dev)).cpu(), uniform(seeds, positions))
    for n in (1, 3, 8, 11, 16):
        logits = rand_logits(n, vocab, n, torch.bfloat16).to(dev)
        params = [SamplingParams(0.5 + 0.2 * j, 0.8 + 0.01 * j, j % 4 * 10, 100 + j) if j % 3 else None
                  for j in range(n)]
        positions = [40 + j for j in range(n)]
        ds = Draws(params, positions)
        graphed = s(logits, ds).clone()
        floats, ints = ds.tensors()
        floats, ints = floats.to(dev), ints.to(dev)
        eager = sample(logits, floats[:, 0], floats[:, 1], ints[:, 0], ints[:, 1], ints[:, 2])
        assert torch.equal(graphed, eager), n
        assert torch.equal(graphed[[j for j in range(n) if j % 3 == 0]],
                           logits.argmax(-1)[[j for j in range(n) if j % 3 == 0]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_step_with_sampling_rows_draws_as_the_eager_step():
    """queue_step over a graphed Step and over an eager one sharing its runner: the same tokens, step by step (the
    graph replays the eager kernels bit for bit, tests/test_engine_gpu.py)."""
    from kvtransfer.engine.graphs import Step
    from kvtransfer.engine.pool import KVPool
    from kvtransfer.engine.queued import queue_step
    from kvtransfer.engine.runner import StepRunner

    dev = torch.device("cuda")
    model = load_model(ModelSpec("smollm2-135m", "bfloat16", 0), "cuda")
    pool = KVPool(CacheGeometry.from_config(model.config, torch.bfloat16), dev, 8, 512)
    runner = StepRunner(model, pool)
    graphed, eager = Step(runner, 8, cuda_graphs=True), Step(runner, 8, cuda_graphs=False)
    assert graphed.sampler.graphs and not eager.sampler.graphs
    lengths = [17, 300, 64, 5, 250]
    params = [SamplingParams(1.0, 0.9, 0, 7), None, SamplingParams(0.7, 1.0, 50, 8), SamplingParams(1.0, 0.9, 0, 9),
              None]

    def decode(step: Step) -> list[list[int]]:
        leases = [pool.try_lease() for _ in lengths]
        batch = []
        for le, n, p in zip(leases, lengths, params):
            ids = random_prompt(model.config.vocab_size, n, seed=n, device="cuda")
            cache, logits = prefill(model, ids)
            for (dk, dv), layer in zip(pool.views(le.slot, n), cache.layers):
                dk.copy_(layer.keys)
                dv.copy_(layer.values)
            first = int(first_token(logits, p, n))
            batch.append(Sequence(le.slot, le, n, first, 10, lambda _: None, sampling=p))
        out, prev = [[s.last_token] for s in batch], None
        for _ in range(10):
            q = queue_step(step, dev, batch, prev)
            q.event.synchronize()
            for j, t in enumerate(q.host.tolist()):
                out[j].append(t)
            for s in batch:
                s.lease.release()  # the step's hold
            prev = q
        for le in leases:
            le.release()
        return out

    assert decode(graphed) == decode(eager)
    assert pool.used() == 0
