"""One-line bugs in the search's key helpers (kvtransfer/kernels/triton_keys.py) that tests/test_sample_interp.py
lets through, each pinned by a test here (Triton interpreter, CPU).

A mutation pass over triton_keys.py (INF_BITS, to_key, to_value, elem_key, mix64, uniform, mixed_pivots): one-line
mutants (a constant or mask changed, a comparison flipped, where() branches swapped, a term dropped, an off-by-one)
run against tests/test_sample_interp.py. The draw there checks tokens only, and a token hides most key bugs:

- the greedy rows never hold an infinity, so INF_BITS (elem_key's NaN bound) may move by one either way;
- a key bug that keeps the keys' order or a pivot bug that only slows the search (the list rounds close the
  bracket whatever the pivots, up to MAX_ROUNDS) draws the same token; nothing checks the pivots themselves
  (strictly inside the bracket, half of them spread over the keys so that the rounds are bounded).

Here each helper is called directly through a small @triton.jit wrapper and its output checked exactly: keys over
every bf16/fp16 bit pattern (and fp32 samples), their inverse, elem_key's NaN placement, the uniform's bits against
`sampler.uniform`, and mixed_pivots' keys for chosen brackets. Equivalent mutants are listed in the pass's report,
not here. Run with `TRITON_INTERPRET=1 python -m pytest tests/test_triton_keys_mutants_interp.py`; skipped
otherwise, as tests/test_kernels_interp.py. Two interpreter caveats (Triton 3.7's `_convert_float`, not the
kernels'): its fp32 -> bf16 conversion truncates, so the bf16 value pivots are checked to one key, and it mangles
bf16 subnormals both ways (it normalizes their significand, then clamps the exponent to 0), so the bf16 checks
that convert (to_key, to_value) leave the 254 nonzero subnormal patterns out; elem_key (a bitcast) keeps them.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton interpreter tests", allow_module_level=True)
pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's numpy use

import triton
import triton.language as tl

from kvtransfer.engine.sampler import uniform as uniform_ref
from kvtransfer.kernels.triton_keys import INF_BITS, elem_key, mixed_pivots, to_key, to_value, uniform

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@triton.jit
def _to_key_kernel(X, Out, N, BITS: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(Out + offs, to_key(tl.load(X + offs, mask=ok, other=0.0), BITS, DT), mask=ok)


@triton.jit
def _key_span_kernel(X, Out, N, BITS: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):
    """to_key(x) - to_key(-x), as the callers' hi - lo (int64 there: to_key's keys are int64)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(X + offs, mask=ok, other=0.0)
    tl.store(Out + offs, to_key(x, BITS, DT) - to_key(-x, BITS, DT), mask=ok)


@triton.jit
def _to_value_kernel(K, Out, N, BITS: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(Out + offs, to_value(tl.load(K + offs, mask=ok, other=0), BITS, DT), mask=ok)


@triton.jit
def _elem_key_kernel(X, Out, N, BITS: tl.constexpr, INF_KEY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(Out + offs, elem_key(tl.load(X + offs, mask=ok, other=0.0), BITS, INF_KEY), mask=ok)


@triton.jit
def _uniform_kernel(Seed, Pos, Out, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    tl.store(Out + offs, uniform(tl.load(Seed + offs, mask=ok, other=0), tl.load(Pos + offs, mask=ok, other=0)),
             mask=ok)


@triton.jit
def _pivots_kernel(Lo, Hi, Out, R: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    row = tl.program_id(0)
    tl.store(Out + row * R + tl.arange(0, R), mixed_pivots(tl.load(Lo + row), tl.load(Hi + row), R, BITS, DT))


def _grid(n, block):
    return (triton.cdiv(n, block),)


def _bits(dtype):
    return 16 if dtype != torch.float32 else 32


def _to_key(values, dtype):
    """float32 values exact in dtype -> the kernel's int64 keys."""
    x = values.float().contiguous()
    out = torch.empty(x.numel(), dtype=torch.int64)
    _to_key_kernel[_grid(x.numel(), 4096)](x, out, x.numel(), BITS=_bits(dtype), DT=TL[dtype], BLOCK=4096)
    return out


def _to_value(keys, dtype):
    k = keys.to(torch.int64).contiguous()
    out = torch.empty(k.numel(), dtype=torch.float32)
    _to_value_kernel[_grid(k.numel(), 4096)](k, out, k.numel(), BITS=_bits(dtype), DT=TL[dtype], BLOCK=4096)
    return out


def _all_patterns(dtype):
    """Every bit pattern of a 16-bit dtype; for fp32 the edges (zeros, subnormals, extremes, infinities, NaNs of
    both signs) and 4096 random patterns."""
    if dtype != torch.float32:
        return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    edges = [0, 1, 2, 0x007FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFE, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000,
             0x7FFFFFFF]
    edges = edges + [e | -2**31 for e in edges]
    rand = torch.randint(-2**31, 2**31, (4096,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    return torch.cat([torch.tensor(edges, dtype=torch.int64), rand]).to(torch.int32).view(torch.float32)


def _converts(x, dtype):
    """The values the interpreter converts between fp32 and dtype exactly: all but bf16's nonzero subnormals."""
    if dtype != torch.bfloat16:
        return torch.ones(x.shape, dtype=torch.bool)
    return (x.view(torch.int16) & 0x7F80 != 0) | (x.view(torch.int16) & 0x7FFF == 0)


def _value_order_keys(x):
    """Independent keys of the non-NaN values x (1-D, any float dtype): rank among the distinct values, shifted so
    that 0.0 (and -0.0) is key 0. Valid as the expected key only over a set that holds every value of a range."""
    v = x.double()
    uniq = torch.unique(v)  # sorted; -0.0 and 0.0 are one value
    return torch.searchsorted(uniq, v) - int(torch.searchsorted(uniq, torch.tensor(0.0, dtype=torch.float64)))


def test_inf_bits_are_the_bits_of_plus_infinity():
    """Kills INF_BITS' constants moved by one (0x7F80 -> 0x7F7F / 0x7F81, 0x7C00 -> 0x7BFF / 0x7C01, 0x7F800000 ->
    0x7F7FFFFF / 0x7F800001) or swapped between dtypes: each is +inf's bit pattern in its dtype, NaNs above."""
    assert set(INF_BITS) == set(DTYPES)
    for dtype in DTYPES:
        assert INF_BITS[dtype] == int(torch.tensor(float("inf"), dtype=dtype).view(INT[dtype])), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_to_key_over_every_16_bit_value(dtype):
    """Kills, in to_key's 16-bit branch: a bitcast to uint16 (no sign), `b <= 0` is fine but `0xFFFF` / `0x3FFF`
    masks, a dropped minus, swapped where() branches, an off-by-one on the negatives, and `BITS != 16`: the keys of
    all 63k+ non-NaN values are exactly their rank in value order around 0 (-inf..+inf onto -INF..INF, -0.0 and
    +0.0 both 0), as the sign-magnitude -> two's complement formula gives."""
    x = _all_patterns(dtype)
    x = x[~torch.isnan(x)]
    got, want = _to_key(x, dtype), _value_order_keys(x)
    b = x.view(torch.int16).to(torch.int64)
    assert torch.equal(want, torch.where(b < 0, -(b & 0x7FFF), b))  # the formula is the value order
    ok = _converts(x, dtype)
    assert torch.equal(got[ok], want[ok])
    assert got.min() == -INF_BITS[dtype] and got.max() == INF_BITS[dtype]
    assert _to_key(torch.tensor([-0.0, 0.0]), dtype).tolist() == [0, 0]


def test_to_key_fp32():
    """Kills, in to_key's 32-bit branch: the mask 0x7FFFFFF (a bit short), `b > 0`, `BITS != 16`, and the int64
    widening dropped (int32 keys: a caller's hi - lo across the range, +inf's key minus -inf's, wraps): exact keys
    of the edges and random patterns, strictly in value order, and spans up to 2 x 0x7F800000."""
    x = _all_patterns(torch.float32)
    x = x[~torch.isnan(x)]
    got = _to_key(x, torch.float32)
    b = x.view(torch.int32).to(torch.int64)
    assert torch.equal(got, torch.where(b < 0, -(b & 0x7FFFFFFF), b))
    order = torch.argsort(x.double(), stable=True)
    xs, ks = x.double()[order], got[order]
    assert bool(((ks[1:] > ks[:-1]) | (xs[1:] == xs[:-1])).all())  # strictly increasing but at equal values
    assert _to_key(torch.tensor([-0.0, 0.0]), torch.float32).tolist() == [0, 0]
    assert int(_to_key(torch.tensor([float("inf")]), torch.float32)[0]) == 0x7F800000
    assert int(_to_key(torch.tensor([float("-inf")]), torch.float32)[0]) == -0x7F800000
    ends = torch.tensor([float("inf"), 3.0e38, 1.0, 0.0])
    span = torch.empty(4, dtype=torch.int64)
    _key_span_kernel[(1,)](ends, span, 4, BITS=32, DT=tl.float32, BLOCK=4)
    assert span.tolist() == [2 * 0x7F800000, 2 * int(torch.tensor(3.0e38).view(torch.int32)), 2 * 0x3F800000, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_to_value_inverts_to_key(dtype):
    """Kills, in to_value: `-k + 32768` / `-k - 32767` (16 bits), `-k - 2147483647` (32 bits), `k > 0` and swapped
    where() branches, and `BITS != 16`: to_value(to_key(v)) == v for every non-NaN value (16-bit: all of them),
    and every key in [-INF, INF] (16-bit) maps to the value of that key."""
    x = _all_patterns(dtype)
    x = x[~torch.isnan(x) & _converts(x, dtype)].float()
    assert torch.equal(_to_value(_to_key(x, dtype), dtype), x)  # torch.equal: -0.0 == 0.0
    if dtype != torch.float32:
        keys = torch.arange(-INF_BITS[dtype], INF_BITS[dtype] + 1)
        if dtype == torch.bfloat16:
            keys = keys[(keys.abs() >= 0x80) | (keys == 0)]
        assert torch.equal(_to_key(_to_value(keys, dtype), dtype), keys)
    else:
        ends = torch.tensor([-0x7F800000, -0x7F7FFFFF, -1, 0, 1, 0x7F7FFFFF, 0x7F800000])
        assert torch.equal(_to_key(_to_value(ends, dtype), dtype), ends)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_elem_key_places_nan_above_inf(dtype):
    """Kills, in elem_key: masks 0xFFFF / 0x3FFFFFFF, `mag >= INF_KEY` (+inf taken for NaN), NaN's key lowered to
    INF_KEY (ties +inf: argmax would take the first of the two, not the NaN), `mag` / `b` for `-mag` (negatives out
    of order): every 16-bit pattern (fp32: edges and random ones, NaN payloads of both signs) keyed as its value
    (to_key's key), NaNs all at 2^31 - 1, above +inf."""
    x = _all_patterns(dtype).contiguous()
    out = torch.empty(x.numel(), dtype=torch.int32)
    _elem_key_kernel[_grid(x.numel(), 4096)](x, out, x.numel(), BITS=_bits(dtype), INF_KEY=INF_BITS[dtype],
                                             BLOCK=4096)
    nan = torch.isnan(x)
    assert bool(nan.any()) and bool((out[nan] == 2**31 - 1).all())
    b = x[~nan].view(INT[dtype]).to(torch.int64)
    want = torch.where(b < 0, -(b & (0x7FFF if dtype != torch.float32 else 0x7FFFFFFF)), b)
    if dtype != torch.float32:
        assert torch.equal(want, _value_order_keys(x[~nan]))  # the formula is the value order
    assert torch.equal(out[~nan].to(torch.int64), want)
    assert int(out[~nan].max()) == INF_BITS[dtype]  # +inf, below every NaN


def test_uniform_is_sampler_uniform_bit_for_bit():
    """Kills, in mix64 and uniform: each shift moved by one (30, 27, 31, 11), a multiplier's or the golden gamma's
    last bit, a dropped final xor-shift, `+` for `^`, `p` for `p + 1`, the seed's inner mix64 dropped, and 2^-52
    for 2^-53: the float64 bits of the kernel's uniform against `sampler.uniform` over seeds across the int64
    range (negatives as uint64) and positions, 1024 pairs."""
    g = torch.Generator().manual_seed(11)
    seeds = torch.cat([torch.tensor([0, 1, -1, -2**63, 2**63 - 1, 2**40 + 3, -977, 7]),
                       torch.randint(-2**63, 2**63 - 1, (1016,), generator=g, dtype=torch.int64)])
    positions = torch.cat([torch.tensor([0, 1, 17, 4096, 2**40, 5, 99, 2**62]),
                           torch.randint(0, 2**31, (1016,), generator=g, dtype=torch.int64)])
    out = torch.empty(seeds.numel(), dtype=torch.float64)
    _uniform_kernel[_grid(seeds.numel(), 1024)](seeds, positions, out, seeds.numel(), BLOCK=1024)
    want = uniform_ref(seeds, positions)
    assert torch.equal(out, want)
    assert bool(((out >= 0) & (out < 1)).all()) and float(out.max()) > 0.99  # the top 53 bits, all of them


def _pivots(lo, hi, dtype, R):
    lo, hi = torch.tensor(lo, dtype=torch.int64), torch.tensor(hi, dtype=torch.int64)
    out = torch.empty(lo.numel(), R, dtype=torch.int64)
    _pivots_kernel[(lo.numel(),)](lo, hi, out, R=R, BITS=_bits(dtype), DT=TL[dtype])
    return out


def _by_key(lo, hi, h):
    return [min(max(lo + ((hi - lo) * (i + 1)) // (h + 1), lo + 1), hi - 1) for i in range(h)]


def _key(v, dtype):
    return int(_to_key(torch.tensor([v], dtype=dtype).float(), dtype)[0])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # -inf x (1 - f) + inf x f: NaN, by key
@pytest.mark.parametrize("R", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_mixed_pivots_half_by_value_half_by_key_strictly_inside(dtype, R):
    """Kills, in mixed_pivots: `j <= R // 2` and `half | finite` / `finite` alone (a key lane lost: the rounds are
    no longer bounded), f's `+ 1` dropped or its `/ (R // 2)` (a pivot at an end, clamped), by_key's `// (R // 2)`
    or `lo + 1 + ...`, `<=` in the finite test (-inf taken for a value end: every value lane at lo + 1), the clamp
    to [lo, hi] or its min/max swapped: for brackets wide, narrow (hi = lo + 2, 3, 5) and with an infinite end,
    lanes R/2.. are exactly the by-key spread, lanes ..R/2 the by-value one (as a set: _narrow needs no order; bf16
    to one key, the interpreter's fp32 -> bf16 truncates), and every pivot lies in [lo + 1, hi - 1]."""
    h = R // 2
    inf = INF_BITS[dtype]
    k = lambda v: _key(v, dtype)  # noqa: E731
    brackets = [(k(-3.0), k(2.5)), (k(0.5), k(96.0)), (k(-40.0), k(-0.25)), (k(-1.0), k(1.0)),
                (k(1.0), k(1.0) + 2), (k(1.0), k(1.0) + 3), (k(-1.0) - 2, k(-1.0) + 3), (k(0.0) - 1, k(0.0) + 4),
                (-inf, k(2.0)), (k(-2.0), inf), (-inf, inf)]
    lo, hi = zip(*brackets)
    got = _pivots(list(lo), list(hi), dtype, R)
    for (l, u), row in zip(brackets, got.tolist()):
        assert all(l + 1 <= p <= u - 1 for p in row), (l, u, row)
        assert row[h:] == _by_key(l, u, h), (l, u, row)
        lo_v, hi_v = float(_to_value(torch.tensor([l]), dtype)), float(_to_value(torch.tensor([u]), dtype))
        if abs(lo_v) == float("inf") or abs(hi_v) == float("inf"):
            assert row[:h] == _by_key(l, u, h), (l, u, row)  # an infinite end: spread over the keys
            continue
        f = (torch.arange(1, h + 1, dtype=torch.float32) / (h + 1))
        v = torch.tensor(lo_v, dtype=torch.float32) * (1.0 - f) + torch.tensor(hi_v, dtype=torch.float32) * f
        want = [min(max(int(kk), l + 1), u - 1) for kk in _to_key(v.to(dtype).float(), dtype)]
        tol = 1 if dtype == torch.bfloat16 else 0
        assert all(abs(a - b) <= tol for a, b in zip(sorted(row[:h]), sorted(want))), (l, u, row, want)
