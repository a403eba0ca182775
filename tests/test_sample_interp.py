"""The split sampling kernel (kvtransfer/kernels/triton_sample.py) against sampler.sample_ref, interpreted.

Why: the kernel cuts each row over P programs and must draw what the reference draws, and the same token whatever
P is and whatever else is in the batch (a prompt's first token is drawn alone on one server and in a batch on
another). Run with `TRITON_INTERPRET=1 python -m pytest tests/test_sample_interp.py`; skipped otherwise (the
variable must be set before triton is imported) or when triton is missing, as tests/test_kernels_interp.py.
Small vocabularies that are no multiple of the segments or blocks, small blocks (segments span several) and a
small `cap` (round 2 and the list search run at this size). The interpreter costs about 0.1 s per program and
launch, so batches stay small.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton interpreter tests", allow_module_level=True)
pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's numpy use

from test_sampler import llm_like_logits, unexplained

from kvtransfer.engine.sampler import Draws, SamplingParams, sample_ref, uniform
from kvtransfer.kernels.triton_sample import programs_for, sample_triton, splits_for

SMALL = {"block": 64, "stream_block": 128, "list_block": 64, "cap": 48}  # steps, round 2's bar: vocab ~1000

# per row: temperature, top_p, top_k (None: greedy; top_k -j: vocab - j). Each threshold alone and together, none
# (temperature only), top_k past half the row, top_k 1, a temperature near 0 and huge ones (every weight ~1).
ROWS = [None, (0.7, 0.9, 50), (1.0, 0.95, 0), (0.8, 1.0, 20), (1.0, 1.0, 0), (2.0, 0.999, 0), (1.0, 1.0, -3),
        (1e-4, 0.9, 0), (1.2, 0.5, 400), (0.6, 0.8, 1), (1e4, 0.7, 0), (1.0, 0.3, 7), (1e4, 1.0, -3)]


def _args(specs, vocab, seed0=17, pos0=100):
    """ROWS-like specs -> the per-row tensors (temperature, top_p, top_k, seed, position)."""
    params = [None if s is None else SamplingParams(s[0], s[1], s[2] if s[2] >= 0 else vocab + s[2], seed0 + 7 * j)
              for j, s in enumerate(specs)]
    floats, ints = Draws(params, [pos0 + 3 * j for j in range(len(specs))]).tensors()
    return floats[:, 0], floats[:, 1], ints[:, 0], ints[:, 1], ints[:, 2]


def _ties(n, vocab, seed, dtype):
    """Integer logits 0..7: every threshold falls on a tie group of a hundred or more."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8, (n, vocab), generator=g).to(dtype)


def _split(logits, args, programs, splits=1, **kw):
    return sample_triton(logits, *args, programs_per_row=programs, splits=splits, **{**SMALL, **kw})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_split_draws_as_the_reference(dtype):
    vocab = 1000  # P = 3: segments of 336, 336 and 328, none a multiple of a block
    tied = [1, 2, 3, 5, 6, 8, 11]  # the rows with a threshold: each falls on a tie group
    for logits, specs in ((llm_like_logits(len(ROWS), vocab, 1, dtype), ROWS),
                          (_ties(len(tied), vocab, 2, dtype), [ROWS[j] for j in tied])):
        args = _args(specs, vocab)
        got = _split(logits, args, 3)
        want = sample_ref(logits, *args)
        assert unexplained(logits, *args, got, want) == [], (got.tolist(), want.tolist())
        assert int((got != want).sum()) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_tokens_do_not_depend_on_p(dtype):
    """P = 1, 2, 3, 7 over the same rows: the same tokens, bit for bit (every cross-program sum is exact)."""
    vocab = 777
    specs = [(0.7, 0.9, 50), (1.0, 0.95, 0), (1.0, 1.0, -3), (1.5, 0.99, 0)]  # the last on tied values
    logits = torch.cat([llm_like_logits(3, vocab, 3, dtype), _ties(1, vocab, 4, dtype)])
    args = _args(specs, vocab, seed0=5)
    base = _split(logits, args, 1)
    assert unexplained(logits, *args, base, sample_ref(logits, *args)) == []
    for programs in (2, 3, 7):
        assert torch.equal(_split(logits, args, programs), base), programs


def test_split_tokens_do_not_depend_on_q():
    """Each segment's rounds and compaction cut over Q = 1, 2, 3 programs (sums added atomically, the list's room
    taken a block at a time): the same tokens, bit for bit, as the reference draws them."""
    vocab = 1000
    specs = [(0.7, 0.9, 50), (1.0, 0.95, 0), (1.2, 0.5, 400), (1.5, 0.99, 0), (1.0, 1.0, 0)]  # one on tied values
    logits = torch.cat([llm_like_logits(3, vocab, 5, torch.bfloat16), _ties(1, vocab, 6, torch.bfloat16),
                        llm_like_logits(1, vocab, 8, torch.bfloat16)])
    args = _args(specs, vocab, seed0=9)
    base = _split(logits, args, 2)
    assert unexplained(logits, *args, base, sample_ref(logits, *args)) == []
    for splits in (2, 3):
        assert torch.equal(_split(logits, args, 2, splits=splits), base), splits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_masked_and_constant_rows(dtype):
    """-inf logits (a masked vocabulary: weight 0, kept only when no threshold is on), a row with ten live tokens,
    one with two under top_k 5, one with one, and a constant row: as the reference, for P = 1 and 3."""
    vocab = 600
    specs = [(1.0, 1.0, 0), (1.0, 0.95, 0), (0.7, 0.9, 50), (1.0, 0.9, 0), (1.0, 1.0, 5), (1.0, 1.0, 0)]
    x = llm_like_logits(len(specs), vocab, 7, dtype)
    x[0, ::3] = float("-inf")
    x[1, 100:400] = float("-inf")
    x[2, :590] = float("-inf")
    x[3] = 1.5
    x[4] = float("-inf")
    x[4, [7, 300]] = 0.0
    x[5, 1:] = float("-inf")
    args = _args(specs, vocab, seed0=3)
    want = sample_ref(x, *args)
    for programs in (1, 3):
        got = _split(x, args, programs)
        assert unexplained(x, *args, got, want) == [], (programs, got.tolist(), want.tolist())


def test_split_rows_are_batch_invariant():
    """Rows alone (as a prompt's first token: P from a batch of one), then among rows of other logits and
    settings (a batch's P): the same tokens."""
    vocab = 900
    specs = [(0.7, 0.9, 50), (2.0, 0.999, 0), (1.0, 1.0, -3)]
    mine = llm_like_logits(len(specs), vocab, 9, torch.bfloat16)
    alone = [int(_split(mine[j:j + 1], _args([s], vocab, seed0=40 + j, pos0=200 + j), 5)[0])
             for j, s in enumerate(specs)]
    others = llm_like_logits(3, vocab, 10, torch.bfloat16)
    logits = torch.cat([others[:1], mine[:1], others[1:2], mine[1:], others[2:]])  # mine at 1, 3, 4
    parts = [_args([s], vocab, seed0=s0, pos0=q) for s, s0, q in
             ((ROWS[2], 1, 7), (specs[0], 40, 200), (ROWS[8], 2, 9), (specs[1], 41, 201), (specs[2], 42, 202),
              (None, 3, 11))]
    args = tuple(torch.cat([a[i] for a in parts]) for i in range(5))
    batch = _split(logits, args, 2)
    assert [int(batch[at]) for at in (1, 3, 4)] == alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_greedy_rows_are_argmax_bit_for_bit(dtype):
    """Ties to the lowest id (across segments too), -0.0 equal to +0.0, NaN the max (first NaN), rows all -inf."""
    x = torch.full((5, 700), -3.0)
    x[0, [5, 600]] = 2.0  # in segments 0 and 1
    x[1, 10], x[1, 20] = -0.0, 0.0
    x[2, [430, 40]] = float("nan")
    x[3] = float("-inf")
    x[4] = torch.randn(700, generator=torch.Generator().manual_seed(4))
    logits = x.to(dtype)
    zeros = torch.zeros(5)
    got = _split(logits, (zeros, zeros + 1, zeros.long(), zeros.long(), zeros.long()), 2)
    assert torch.equal(got, logits.argmax(-1)), (got.tolist(), logits.argmax(-1).tolist())


def test_split_hashes_the_uniform_as_sampler_uniform():
    """Flat rows, temperature 1, no threshold: every weight is 2^40 exactly, so the token is floor(u x vocab): the
    kernel's SplitMix64 and integer draw against `uniform` over seeds across the uint64 range."""
    vocab, n = 1001, 8
    seeds = torch.tensor([0, 1, -1, -2**63, 2**63 - 1, 2**40 + 3, -977, 7])
    positions = torch.tensor([0, 1, 17, 4096, 2**40, 5, 99, 2**33])
    ones = torch.ones(n)
    got = _split(torch.zeros(n, vocab), (ones, ones, torch.zeros(n, dtype=torch.long), seeds, positions), 3)
    assert torch.equal(got, (uniform(seeds, positions) * vocab).floor().long())


def test_splits_follow_the_batch_and_the_segment():
    """Q: a power of two at or below 4 x SMs / (n x P), at most 16, no stretch under two round blocks, at least 1."""
    cpu = torch.device("cpu")
    v = 152064
    got = [splits_for(n, programs_for(n, cpu), -(-v // programs_for(n, cpu)), 512, cpu) for n in (1, 8, 32, 64, 256)]
    assert got == [4, 2, 1, 2, 2]
    assert splits_for(1, 1, 100, 64, cpu) == 1 and splits_for(1, 1, 10**6, 64, cpu) == 16


def test_programs_per_row_follow_the_batch():
    """A power of two at or below 4 x SMs / n up to 32 rows, 2 x SMs / n past (132 SMs off CUDA), 1 to 32 a row."""
    cpu = torch.device("cpu")
    assert [programs_for(n, cpu) for n in (1, 8, 9, 32, 33, 64, 128, 264, 1000)] == [32, 32, 32, 16, 8, 4, 2, 1, 1]
