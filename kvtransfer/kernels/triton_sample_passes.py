"""The split draw's passes over every value of a row (kvtransfer/kernels/triton_sample.py, launches 1 to 4):
the range, the two counting rounds and the compaction of the bracket's values into the row's list.

Why a file of its own: these are the launches that read all of a row's logits and so set the draw's cost at
large batches; the rounds and the compaction cut each segment over Q programs (grid (n, P, Q)) that add their
exact sums into the segment's. The arithmetic they share with the later launches is triton_sample_bracket.py's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtransfer.kernels.triton_keys import elem_key, to_key, to_value
from kvtransfer.kernels.triton_sample_bracket import (
    COUNT_ONE,
    MASS_BITS,
    bracket,
    even_pivots,
    first_pivots,
    list_place,
    pin,
    row_setup,
    weight,
)


@triton.jit
def range_kernel(X, Temp, RF, RI, ZS, CNT, MSS, CTR, stride_x, s_t, vocab, seg,
                 BITS: tl.constexpr, INF_KEY: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr):
    # grid (n, P): X (n, vocab); RF (n, P, 4) float32 [max, min, sum, sum of squares], RI (n, P, 4) int32
    # [finite count, non-NaN count, argmax key, argmax id] of the segment [p x seg, (p + 1) x seg); and the
    # segment's sums that the later launches' Q programs add into, zeroed: ZS, CTR (n, P), CNT, MSS (n, 2, P, R)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    tl.store(ZS + row * P + p, 0)
    tl.store(CTR + row * P + p, 0)
    j = tl.arange(0, R)
    for rnd in range(2):
        tl.store(CNT + ((row * 2 + rnd) * P + p) * R + j, tl.zeros([R], tl.int64))
        tl.store(MSS + ((row * 2 + rnd) * P + p) * R + j, tl.zeros([R], tl.int64))
    xs = X + row * stride_x
    start = p * seg
    end = tl.minimum(start + seg, vocab)
    offs = tl.arange(0, BLOCK)
    out = (row * P + p) * 4
    if tl.load(Temp + row * s_t) == 0:
        best = tl.full([BLOCK], -2147483647 - 1, tl.int32)  # below every key
        at_id = tl.zeros([BLOCK], tl.int32)
        for s in range(start, end, BLOCK):
            idx = s + offs
            ok = idx < end
            key = tl.where(ok, elem_key(tl.load(xs + idx, mask=ok, other=0.0), BITS, INF_KEY), -2147483647 - 1)
            up = key > best  # strictly: a lane keeps its first id among equal keys
            best = tl.where(up, key, best)
            at_id = tl.where(up, idx, at_id)
        top = tl.max(best, 0)
        tl.store(RI + out + 2, top)
        tl.store(RI + out + 3, tl.min(tl.where(best == top, at_id, 2147483647), 0))
    else:
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        mn = tl.full([BLOCK], float("inf"), tl.float32)
        s1 = tl.zeros([BLOCK], tl.float32)
        s2 = tl.zeros([BLOCK], tl.float32)
        nf = tl.zeros([BLOCK], tl.int32)
        nok = tl.zeros([BLOCK], tl.int32)
        nxt = tl.load(xs + start + offs, mask=start + offs < end, other=float("nan"))
        for s in range(start, end, BLOCK):
            x = nxt.to(tl.float32)
            idx = s + BLOCK + offs
            nxt = tl.load(xs + idx, mask=idx < end, other=float("nan"))  # the next block's load in flight
            num = x == x  # noqa: PLR0124 (not NaN; past the segment's end loads NaN)
            fin = tl.abs(x) < float("inf")
            mx = tl.maximum(mx, tl.where(num, x, float("-inf")))
            mn = tl.minimum(mn, tl.where(num, x, float("inf")))
            xf = tl.where(fin, x, 0.0)
            s1 += xf
            s2 += xf * xf
            nf += fin.to(tl.int32)
            nok += num.to(tl.int32)
        tl.store(RF + out, tl.max(mx, 0))
        tl.store(RF + out + 1, tl.min(mn, 0))
        tl.store(RF + out + 2, tl.sum(s1, 0))
        tl.store(RF + out + 3, tl.sum(s2, 0))
        tl.store(RI + out, tl.sum(nf, 0))
        tl.store(RI + out + 1, tl.sum(nok, 0))


@triton.jit
def seg_round(xs, start, end, Mw, c, pk, R: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
              DT: tl.constexpr):
    """Over [start, end) (a stretch of a segment): its sum of W, and per pivot (R,) the count and mass of the
    values >= it. Read as (1, BLOCK) so the (R, BLOCK) compares share its layout; each lane and pivot accumulates
    count x 2^50 + mass in one int64 (under MAX_STEPS steps neither field overflows), split once at the end."""
    offs = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    piv = to_value(pk, BITS, DT)[:, None]  # (R, 1): above -inf, so lanes past the end (-inf) pass none
    acc_z = tl.zeros([1, BLOCK], tl.int64)
    acc = tl.zeros([R, BLOCK], tl.int64)
    nxt = tl.load(xs + start + offs, mask=start + offs < end, other=float("-inf"))
    for s in range(start, end, BLOCK):
        x = nxt.to(tl.float32)
        idx = s + BLOCK + offs
        nxt = tl.load(xs + idx, mask=idx < end, other=float("-inf"))  # the next block's load in flight
        w = weight(x, Mw, c)  # (1, BLOCK)
        acc_z += w
        acc += tl.where(x >= piv, w + COUNT_ONE, 0)
    cnt = tl.sum(acc >> 50, 1)
    mss = tl.sum(acc & MASS_BITS, 1)
    return tl.sum(tl.sum(acc_z, 1), 0), cnt, mss


@triton.jit
def seg_z(xs, start, end, Mw, c, BLOCK: tl.constexpr):
    """Over [start, end): its sum of W (a row with no threshold: its kept mass)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int64)
    for s in range(start, end, BLOCK):
        idx = s + offs
        acc += weight(tl.load(xs + idx, mask=idx < end, other=float("-inf")).to(tl.float32), Mw, c)
    return tl.sum(acc, 0)


@triton.jit
def round_kernel(X, Temp, TopP, TopK, RF, RI, RS, ZS, PIV, CNT, MSS,
                 stride_x, s_t, s_p, s_k, vocab, seg, sub, cap,
                 ROUND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr,
                 R: tl.constexpr):
    # grid (n, P, Q): program (p, q) passes over [p x seg + q x sub, + sub) of segment p and adds its sums into
    # the segment's (zeroed by the range launch; int64 atomics, exact in any order). Round 1 writes RS (n, 8)
    # float32 (program (0, 0): the row's constants), ZS (n, P) int64 and, with a threshold on, its pivots
    # PIV[:, 0] (n, P, R) int64 keys (each program's copy, all equal) and CNT, MSS[:, 0] (n, P, R) int64; round 2,
    # where the bracket holds more than cap values, PIV, CNT, MSS[:, 1]
    DT: tl.constexpr = X.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    q = tl.program_id(2)
    P = tl.num_programs(1)
    xs = X + row * stride_x
    start = p * seg + q * sub
    end = tl.minimum(tl.minimum(start + sub, p * seg + seg), vocab)
    if tl.load(Temp + row * s_t) != 0:
        if ROUND == 1:
            t, top_p, top_k, M, m, Mw, c, k_on, p_on, on, nok, nf, mu, sd = row_setup(
                Temp, TopP, TopK, RF, RI, row, s_t, s_p, s_k, vocab, P, PB)
            if (p == 0) & (q == 0):
                tl.store(RS + row * 8 + tl.arange(0, 8),
                         tl.where(tl.arange(0, 8) == 0, M, tl.where(tl.arange(0, 8) == 1, m,
                                  tl.where(tl.arange(0, 8) == 2, Mw, tl.where(tl.arange(0, 8) == 3, c,
                                           tl.where(tl.arange(0, 8) == 4, nok.to(tl.float32), on.to(tl.float32)))))))
            if on:
                lo = to_key(m, BITS, DT)
                pk = first_pivots(lo, to_key(M, BITS, DT) + 1, M, t, mu, sd, top_p, top_k.to(tl.float32) / nf, p_on,
                                  k_on, R, BITS, DT)
                pk = pin(PIV + (row * 2 * P + p) * R, pk, R)
                z, cnt, mss = seg_round(xs, start, end, Mw, c, pk, R, BLOCK, BITS, DT)
                at = (row * 2 * P + p) * R + tl.arange(0, R)
                tl.atomic_add(CNT + at, cnt)
                tl.atomic_add(MSS + at, mss)
            else:
                z = seg_z(xs, start, end, Mw, c, BLOCK)
            tl.atomic_add(ZS + row * P + p, z)
        else:
            lo, hi, c_lo, _s_lo, c_hi, _s_hi, _src_lo, _src_hi, Mw, c, _k, _pz, on = bracket(
                TopP, TopK, RS, ZS, PIV, CNT, MSS, row, s_p, s_k, vocab, P, cap, 1, BITS, DT, PB, R)
            if on & (c_lo - c_hi > cap) & (hi - lo > 1):
                pk = pin(PIV + ((row * 2 + 1) * P + p) * R, even_pivots(lo, hi, R, BITS, DT), R)
                z, cnt, mss = seg_round(xs, start, end, Mw, c, pk, R, BLOCK, BITS, DT)
                at = ((row * 2 + 1) * P + p) * R + tl.arange(0, R)
                tl.atomic_add(CNT + at, cnt)
                tl.atomic_add(MSS + at, mss)


@triton.jit
def compact_kernel(X, Temp, TopP, TopK, RI, RS, ZS, PIV, CNT, MSS, LV, ST, CTR,
                   stride_x, s_t, s_p, s_k, stride_l, vocab, seg, sub, cap,
                   BITS: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr, R: tl.constexpr):
    # grid (n, P, Q): an open bracket's values in [lo, hi) into LV (n, >= vocab) in X's dtype, segment p's at its
    # offset in the row's list, in no particular order among themselves (everything that reads the list sums it
    # exactly): program (p, q) passes over its stretch of the segment and takes room a block at a time from the
    # segment's counter CTR (n, P) (zeroed by the range launch). Program (0, 0) stores the final bracket in ST
    # (n, 10) int64 [lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi, k, pz]
    DT: tl.constexpr = X.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    q = tl.program_id(2)
    P = tl.num_programs(1)
    if tl.load(Temp + row * s_t) != 0:
        lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi, _mw, _c, k, pz, _on = bracket(
            TopP, TopK, RS, ZS, PIV, CNT, MSS, row, s_p, s_k, vocab, P, cap, 2, BITS, DT, PB, R)
        if (p == 0) & (q == 0):
            f = tl.arange(0, 16)
            st = tl.where(f == 0, lo, tl.where(f == 1, hi, tl.where(f == 2, c_lo, tl.where(f == 3, s_lo, tl.where(
                f == 4, c_hi, tl.where(f == 5, s_hi, tl.where(f == 6, src_lo.to(tl.int64), tl.where(
                    f == 7, src_hi.to(tl.int64), tl.where(f == 8, k, pz)))))))))
            tl.store(ST + row * 10 + f, st, mask=f < 10)
        if hi - lo > 1:
            off, _mine, _n = list_place(RI, ZS, CNT, MSS, row, p, P, src_lo, src_hi, PB, R)
            lo_v, hi_v = to_value(lo, BITS, DT), to_value(hi, BITS, DT)
            xs = X + row * stride_x
            lv = LV + row * stride_l
            offs = tl.arange(0, BLOCK)
            start = p * seg + q * sub
            end = tl.minimum(tl.minimum(start + sub, p * seg + seg), vocab)
            nxt = tl.load(xs + start + offs, mask=start + offs < end, other=float("nan"))
            for s in range(start, end, BLOCK):
                raw = nxt
                idx = s + BLOCK + offs
                nxt = tl.load(xs + idx, mask=idx < end, other=float("nan"))  # the next block's load in flight
                x = raw.to(tl.float32)
                flag = ((x >= lo_v) & (x < hi_v)).to(tl.int32)  # NaN (past the end too): never
                got = tl.sum(flag, 0)
                if got > 0:
                    at = off + tl.atomic_add(CTR + row * P + p, got.to(tl.int64))  # this block's room
                    tl.store(lv + at + tl.cumsum(flag, 0) - 1, raw, mask=flag > 0)
