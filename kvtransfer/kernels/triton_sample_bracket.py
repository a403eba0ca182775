"""The split draw's search arithmetic (kvtransfer/kernels/triton_sample.py), shared by its launches: weights in
fixed point, pivots and the bracket they narrow, and the per-row and per-segment figures read back from the
partials the launches leave.

Why a file of its own: every launch rebuilds the same bracket from the same exact partials (so no launch is needed
only to share it), and they must all compute it with the same code; the launches themselves are in
triton_sample_passes.py (over the row's values) and triton_sample.py (over the list, and the draw). What the
bracket and the partials mean is in triton_sample.py's docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtransfer.kernels.triton_keys import to_key, to_value

COUNT_ONE = tl.constexpr(1 << 50)  # a count of one in the packed accumulators
MASS_BITS = tl.constexpr((1 << 50) - 1)  # their mass bits
BIG = tl.constexpr(1 << 62)  # a count or mass bar past reach: that threshold is off


@triton.jit
def weight(x, M, c):
    """float32 values -> int64 fixed-point weights floor(exp2((x - M) * c) * 2**40); the one place they are made,
    so every launch computes the same bits."""
    return (tl.exp2((x - M) * c) * 1099511627776.0).to(tl.int64)


@triton.jit
def pin(ptr, keys, R: tl.constexpr):
    """keys (R,) int64 through memory: stored, then read back. A computed tensor may be recomputed for each layout
    it is used in, and float steps need not give the same bits twice (a constant folded exactly in one copy, a
    division approximated in another): a pivot counted at one key and narrowed at another would break the
    search. Read back, every use sees the stored bits."""
    j = tl.arange(0, R)
    tl.store(ptr + j, keys)
    tl.debug_barrier()
    return tl.load(ptr + j)


@triton.jit
def quantile(q):
    """The standard normal's quantile at q in (0, 1) (Abramowitz-Stegun 26.2.23, |error| < 5e-4): only where to
    look, so a rough one does."""
    a = tl.minimum(q, 1.0 - q)
    s = tl.sqrt(-2.0 * tl.log(tl.maximum(a, 1e-30)))
    z = s - (2.515517 + 0.802853 * s + 0.010328 * s * s) / (1.0 + 1.432788 * s + 0.189269 * s * s
                                                            + 0.001308 * s * s * s)
    return tl.where(q < 0.5, -z, z)


@triton.jit
def clamp_keys(k, lo, hi, BITS: tl.constexpr, DT: tl.constexpr):
    """Keys into (lo, hi) and above -inf's key (a lane past a segment's end loads -inf: it must pass no pivot)."""
    k = tl.minimum(tl.maximum(k, lo + 1), hi - 1)
    return tl.maximum(k, to_key(tl.full([], float("-inf"), tl.float32), BITS, DT) + 1)


@triton.jit
def first_pivots(lo, hi, M, t, mu, sd, top_p, kq, p_on, k_on, R: tl.constexpr, BITS: tl.constexpr,
                 DT: tl.constexpr):
    """Round 1's R = 8 keys in (lo, hi): rungs M - t x (2, 5, 10), where a peaked row's thresholds fall, and
    v + sd x (-0.4, -0.15, 0.1, 0.35, 0.6) around v, the estimate of a Gaussian body N(mu, sd^2): for top_p its
    tilted quantile mu + sd^2 / t - sd x z(top_p) (weights exp(l / t) tilt the body to N(mu + sd^2 / t, sd^2)),
    for top_k its quantile mu + sd x z(1 - k / finite count), the larger when both are on."""
    tl.static_assert(R == 8)
    j = tl.arange(0, R)
    rung = tl.where(j == 0, 2.0, tl.where(j == 1, 5.0, 10.0))
    v_p = mu + sd * sd / t - sd * quantile(top_p)
    v_k = mu + sd * quantile(1.0 - kq)
    est = tl.where(p_on & k_on, tl.maximum(v_p, v_k), tl.where(p_on, v_p, v_k))
    v = tl.where(j < 3, M - t * rung, est + sd * ((j - 3).to(tl.float32) * 0.25 - 0.4))
    by_key = lo + ((hi - lo) * (j + 1).to(tl.int64)) // (R + 1)
    finite = tl.abs(v) < float("inf")  # false for NaN (sd of a row with infinities, say): spread by key
    k = tl.where(finite, to_key(tl.minimum(tl.maximum(tl.where(finite, v, 0.0), -3.0e38), 3.0e38), BITS, DT),
                 by_key)
    return clamp_keys(k, lo, hi, BITS, DT)


@triton.jit
def even_pivots(lo, hi, R: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """R keys spread evenly over the values of (lo, hi) (over the keys where an end is not finite)."""
    j = tl.arange(0, R)
    f = (j + 1).to(tl.float32) / (R + 1)
    v = to_value(lo, BITS, DT) * (1.0 - f) + to_value(hi, BITS, DT) * f
    by_key = lo + ((hi - lo) * (j + 1).to(tl.int64)) // (R + 1)
    finite = tl.abs(v) < float("inf")
    k = tl.where(finite, to_key(tl.where(finite, v, 0.0), BITS, DT), by_key)
    return clamp_keys(k, lo, hi, BITS, DT)


@triton.jit
def narrow(lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi, pk, cnt, mss, k, pz, src0, R: tl.constexpr):
    """The bracket after pred at pivots pk (R,) with their exact counts and masses (R,) int64: the highest true
    pivot is the new lo, the lowest false one the new hi (where inside the bracket), each with its count, mass and
    source (src0 + the pivot's index: where its per-segment partials lie; repeated keys share counts, so any copy
    does)."""
    j = tl.arange(0, R)
    pred = (cnt >= k) | (mss >= pz)  # (R,)
    new_lo = tl.maximum(tl.max(tl.where(pred, pk, lo), 0), lo)  # pivots may lie outside [lo, hi) (list rounds)
    new_hi = tl.minimum(tl.min(tl.where(pred, hi, pk), 0), hi)
    at = pred & (pk == new_lo)
    moved = tl.max(at.to(tl.int32), 0) > 0
    c_lo = tl.where(moved, tl.max(tl.where(at, cnt, -1), 0), c_lo)
    s_lo = tl.where(moved, tl.max(tl.where(at, mss, -1), 0), s_lo)
    src_lo = tl.where(moved, src0 + tl.max(tl.where(at, j, -1), 0), src_lo)
    at = (pk == new_hi) & ~pred
    moved = tl.max(at.to(tl.int32), 0) > 0
    c_hi = tl.where(moved, tl.max(tl.where(at, cnt, -1), 0), c_hi)
    s_hi = tl.where(moved, tl.max(tl.where(at, mss, -1), 0), s_hi)
    src_hi = tl.where(moved, src0 + tl.max(tl.where(at, j, -1), 0), src_hi)
    return new_lo, new_hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi


@triton.jit
def row_range(RF, RI, row, P, PB: tl.constexpr):
    """Round 1's inputs from the range partials RF (n, P, 4) float32 [max, min, sum, sum of squares] and RI
    (n, P, 4) int32 [finite count, non-NaN count, argmax key, argmax id]: M, m (of the non-NaN values), the
    non-NaN count, and the finite values' count, mean and spread."""
    pi = tl.arange(0, PB)
    pm = pi < P
    base = (row * P + pi) * 4  # (PB,)
    M = tl.max(tl.load(RF + base, mask=pm, other=float("-inf")), 0)
    m = tl.min(tl.load(RF + base + 1, mask=pm, other=float("inf")), 0)
    nok = tl.sum(tl.load(RI + base + 1, mask=pm, other=0).to(tl.int64), 0)
    nf = tl.sum(tl.load(RI + base, mask=pm, other=0), 0).to(tl.float32)
    s1 = tl.sum(tl.load(RF + base + 2, mask=pm, other=0.0), 0)
    s2 = tl.sum(tl.load(RF + base + 3, mask=pm, other=0.0), 0)
    mu = s1 / nf
    sd = tl.sqrt(tl.maximum(s2 / nf - mu * mu, 0.0))
    return M, m, nok, nf, mu, sd


@triton.jit
def row_setup(Temp, TopP, TopK, RF, RI, row, s_t, s_p, s_k, vocab, P, PB: tl.constexpr):
    """Round 1's view of a sampled row: t, top_p, top_k, M and m, the weights' reference Mw (0 for a row without a
    finite max: all its weights 0) and c = log2(e) / t (capped: t -> 0 keeps weights finite), which thresholds
    are on (and whether any is: not for a row with no value but NaN), and row_range's counts, mean and
    spread. Later launches read M, m, Mw, c back (row_consts) rather than recompute them."""
    t = tl.load(Temp + row * s_t).to(tl.float32)
    top_p = tl.load(TopP + row * s_p).to(tl.float32)
    top_k = tl.load(TopK + row * s_k).to(tl.int64)
    M, m, nok, nf, mu, sd = row_range(RF, RI, row, P, PB)
    Mw = tl.where(M > float("-inf"), M, 0.0)
    c = tl.minimum(1.4426950408889634 / t, 3.4028234663852886e38)
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    on = (k_on | p_on) & (m <= M)  # m > M: no value that is not NaN (nothing to search)
    return t, top_p, top_k, M, m, Mw, c, k_on, p_on, on, nok, nf, mu, sd


@triton.jit
def row_consts(RS, row):
    """What round 1 stored of a sampled row in RS (n, 8) float32: M, m, Mw, c, the non-NaN count and whether a
    threshold is on. Read back rather than recomputed, so every launch weighs with the same bits."""
    base = RS + row * 8
    on = tl.load(base + 5) != 0
    return (tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4).to(tl.int64),
            on)


@triton.jit
def round_sums(CNT, MSS, row, rnd, P, PB: tl.constexpr, R: tl.constexpr):
    """A round's per-pivot totals (R,) int64 from its per-segment partials CNT, MSS (n, 2, P, R)."""
    pi = tl.arange(0, PB)[:, None]
    j = tl.arange(0, R)[None, :]
    at = ((row * 2 + rnd) * P + pi) * R + j  # (PB, R)
    ok = (pi < P) & (j < R)
    return tl.sum(tl.load(CNT + at, mask=ok, other=0), 0), tl.sum(tl.load(MSS + at, mask=ok, other=0), 0)


@triton.jit
def bracket(TopP, TopK, RS, ZS, PIV, CNT, MSS, row, s_p, s_k, vocab, P, cap,
            UPTO: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, PB: tl.constexpr, R: tl.constexpr):
    """A sampled row's bracket after round 1 (UPTO 1) or after round 2 where that ran (UPTO 2), recomputed from
    the exact partials (every program of every launch gets the same): lo, hi, the counts and masses at them,
    their sources (-1: the row's first lo, whose partials are the non-NaN counts and Z_s; -2: above M, zeros;
    else round x R + pivot), the weights' Mw and c as round 1 stored them, the bars k and pz, and whether a
    threshold is on."""
    top_p = tl.load(TopP + row * s_p).to(tl.float32)
    top_k = tl.load(TopK + row * s_k).to(tl.int64)
    M, m, Mw, c, nok, on = row_consts(RS, row)
    k = tl.where((top_k > 0) & (top_k < vocab), top_k, BIG)
    p_on = top_p < 1.0
    pi = tl.arange(0, PB)
    z = tl.sum(tl.load(ZS + row * P + pi, mask=pi < P, other=0), 0)
    prod = top_p.to(tl.float64) * z.to(tl.float64)
    pz = prod.to(tl.int64)
    pz = tl.minimum(pz + (pz.to(tl.float64) < prod).to(tl.int64), z)  # ceil(top_p x Z): mass >= it <=> >= top_p Z
    pz = tl.where(p_on, pz, BIG)
    lo = to_key(m, BITS, DT)
    hi = tl.where(on, to_key(M, BITS, DT) + 1, lo + 1)  # off (or nothing to search): tau = m, every value kept
    c_lo, s_lo, c_hi, s_hi = nok, z, nok * 0, z * 0
    src_lo, src_hi = (lo * 0 - 1).to(tl.int32), (lo * 0 - 2).to(tl.int32)
    if on:
        cnt, mss = round_sums(CNT, MSS, row, 0, P, PB, R)
        pk = tl.load(PIV + row * 2 * P * R + tl.arange(0, R))  # program 0's copy (all programs' are equal)
        lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi = narrow(lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi,
                                                                pk, cnt, mss, k, pz, 0, R)
        if UPTO == 2:  # noqa: SIM102 (a compile-time test, then a run-time one)
            if (c_lo - c_hi > cap) & (hi - lo > 1):  # exactly round 2's own test
                cnt, mss = round_sums(CNT, MSS, row, 1, P, PB, R)
                pk = tl.load(PIV + (row * 2 + 1) * P * R + tl.arange(0, R))
                lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi = narrow(lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo,
                                                                        src_hi, pk, cnt, mss, k, pz, R, R)
    return lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi, Mw, c, k, pz, on


@triton.jit
def seg_at(RI, ZS, CNT, MSS, row, P, src, PB: tl.constexpr, R: tl.constexpr):
    """Per-segment count and mass (PB,) int64 at or above a bracket end, from its source (see bracket)."""
    pi = tl.arange(0, PB)
    pm = pi < P
    piv = src >= 0
    at = ((row * 2 + src // R) * P + pi) * R + src % R
    cnt = tl.load(CNT + at, mask=pm & piv, other=0)
    mss = tl.load(MSS + at, mask=pm & piv, other=0)
    first = src == -1
    cnt = tl.where(first, tl.load(RI + (row * P + pi) * 4 + 1, mask=pm, other=0).to(tl.int64), cnt)
    mss = tl.where(first, tl.load(ZS + row * P + pi, mask=pm, other=0), mss)
    return cnt, mss


@triton.jit
def list_place(RI, ZS, CNT, MSS, row, p, P, src_lo, src_hi, PB: tl.constexpr, R: tl.constexpr):
    """Where segment p's values in [lo, hi) go in the row's list: (its offset, its count, the list's length)."""
    pi = tl.arange(0, PB)
    c_lo, _m_lo = seg_at(RI, ZS, CNT, MSS, row, P, src_lo, PB, R)
    c_hi, _m_hi = seg_at(RI, ZS, CNT, MSS, row, P, src_hi, PB, R)
    cand = c_lo - c_hi  # (PB,)
    off = tl.sum(tl.where(pi < p, cand, 0), 0)
    return off, tl.sum(tl.where(pi == p, cand, 0), 0), tl.sum(cand, 0)
