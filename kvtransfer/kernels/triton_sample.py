"""Triton per-row sampling: temperature, top-k and nucleus thresholds and one inverse-CDF draw, with no sort,
each row cut over several programs.

Why: a sort of every row (152k logits) cost a large share of a decode step, and one program a row leaves all but
a few SMs idle at small batches. Here each row is cut into P segments, one program each (grid (n, P)), P picked
from the batch so that the launch fills the GPU a few times over (`programs_for`); the two passes that cost most
a value (the rounds) and the compaction cut each segment once more, over Q programs (grid (n, P, Q),
`splits_for`), that add their sums into the segment's. The definition is
kvtransfer/engine/sampler.py's: thresholds by value with ties kept, one inverse-CDF draw in id order with the
uniform of (seed, position). The threshold tau = max(tau_k, tau_p) is the largest value v with pred(v) =
(count(l >= v) >= k) or (mass(l >= v) >= top_p x Z): both sides are monotone in v, so one search finds the larger
threshold directly. It keeps a bracket [lo, hi) with pred(lo) true and pred(hi) false, over value keys
(triton_keys.py), and tau = lo once hi = lo + 1. This is the draw `sampler.sample` runs on CUDA: the step's, a
prompt's first token's, the prefill worker's.

Batch invariance. A row must draw the same token whatever P and Q are and whatever else is in its batch (a prompt's
first token is drawn alone on one server and inside a batch on another). So every sum that crosses programs is
exact: a token's weight w = exp2((l - M) x log2(e) / t) in [0, 1] is taken in fixed point, W = floor(w x 2^40)
as int64, and counts and masses are int64 sums (added across a segment's Q programs by int64 atomics), the same
in any order and any partition. Maxima are order-free;
the draw compares integer running sums with floor(u x kept mass). Nothing float is computed twice: M, m and
c = log2(e) / t are stored once by round 1 and read back by the later launches (so every launch weighs with the
same bits), and every pivot goes through memory before it is used (`pin`: a tensor may be recomputed for each
layout it is used in, and a float step need not give the same bits twice; a pivot counted at one key and
narrowed at another would break the search). The one thing that does depend on P, a float estimate of the
row's mean and spread that places the first pivots, moves where the search looks, never what it finds.

Resolution: 2^-40 a token. A weight loses less than 2^-40 to the floor, so a row's sums are off by less than
vocab x 2^-40 (1.4e-7 at a 152k vocabulary) against Z >= 1 (the max weighs 1), about float32's own rounding of
w; tokens 27.7 x t below the max weigh 0 (under 2^-40 each, under vocab x 2^-40 of the mass together). The int64
sums hold up to 2^23 tokens a row (vocab x 2^40 < 2^63). The torch reference sums float32 weights in float64,
so the two draw the same token except where a mass lands within that rounding of top_p x Z or of the target,
as with any float sum in another order.

A fixed sequence of six launches, no host sync and no data-dependent host control flow (capturable in a CUDA
graph); a row with nothing to do in a launch skips it. Per row of V values in segments of S = V / P:
1. range (n, P): per segment the max and min, the count, sum and sum of squares of the finite values, the count
   of non-NaN ones; for a greedy row only its argmax (NaN the max, ties to the lowest id, as torch's). It zeroes
   the segment's sums that the Q programs of the later launches add into.
2. round 1 (n, P, Q): M (the segments' max; program 0 stores the row's constants), then per segment Z_s = sum W
   and, when a threshold is on, the count and mass at R = 8 pivots: rungs M - t x (2, 5, 10), where a peaked
   row's thresholds fall, and 5 around the threshold of a Gaussian body of the row's mean and spread (for top_p
   its exponentially tilted quantile, for top_k its quantile), where a flat row's fall.
3. round 2 (n, P, Q): each program reduces round 1's partials to the bracket; a row whose bracket still holds more
   than `cap` values counts 8 more pivots spread evenly over its values (a flat row: tau deep in the body).
4. compact (n, P, Q): the values in [lo, hi), each segment's at its offset in the row's list (a prefix sum of
   the per-segment counts at lo and hi, from the partials), in no order among themselves (each program takes
   room a block at a time from its segment's counter; all that reads the list sums it exactly, so the order
   reaches no result); program (0, 0) stores the bracket.
5. search (n, P): each program closes the bracket over the list, the same steps in each (so no launch is
   needed to share the result): rounds of 16 pivots (half spread over the values, half over the keys, as in
   mixed_pivots), each also moving lo and hi onto the smallest and largest values present (nothing lies
   between, so their counts and masses are unchanged). Then its segment's kept mass and count: those at hi
   (partials) plus its slice of the list at or above tau.
6. draw (n,): target = floor(u x K), K the kept mass (the segments' sum); the segment where their running sum
   passes the target; in it, block sums, then one block's running sum (int64) to the first id past the target.
   Past the end (K = 0, or u x K rounding up to K): the last kept id.

Round passes carry an exp2 and 8 compare-and-adds a value (count and mass packed in one int64 accumulator per
lane and pivot, the count from bit 50), range and compact a compare or two. A peaked row does passes 1, 2 and
4; a flat row also 3. The rest (reductions over P partials, the list's rounds, one segment's scan) is small.
Launches 1-4 are in triton_sample_passes.py, 5 and 6 here, what all compute alike in triton_sample_bracket.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtransfer.kernels.triton_keys import INF_BITS, mixed_pivots, to_key, to_value, uniform
from kvtransfer.kernels.triton_sample_bracket import BIG, list_place, narrow, pin, row_consts, seg_at, weight
from kvtransfer.kernels.triton_sample_passes import compact_kernel, range_kernel, round_kernel

BLOCK = 512  # values per step of a round's pass over a segment (8 int64 accumulators a value)
STREAM_BLOCK = 2048  # values per step of the light passes (range, compact, draw)
LIST_BLOCK = 128  # listed values per step of a list round ((RL, LIST_BLOCK) accumulators: no spills)
NUM_WARPS = 4  # at or below 8's time at every batch measured, a fifth less at 32 and 64
SEARCH_WARPS = 4  # the list search is a chain of small reductions: fewer warps, shorter ones
CAP = 4096  # a bracket holding more values than this after round 1 gets round 2
SMALL_BATCH = 32  # up to this many rows, P aims at 4 programs per SM; past it at 2 (`programs_for`)
MAX_PROGRAMS = 32  # per row
STREAM_WAVES = 4  # the heavy passes (rounds, compaction) cut each segment in Q so that n x P x Q fills this x SMs
MAX_SPLITS = 16  # Q, at most
MIN_SPLIT_BLOCKS = 2  # a stretch of a segment is at least this many round blocks
ALIGN = 16  # a segment's length is a multiple of this many values
MAX_STEPS = 1000  # steps of `block` per segment: the packed per-lane counts and masses stay below bit 63
R = 8  # pivots per row round
RL = 16  # pivots per list round
MAX_ROUNDS = 64  # list rounds, a bound only: each one narrows the bracket



@triton.jit
def _search_kernel(Temp, RI, RS, ZS, CNT, MSS, LV, ST, LPIV, KSEG, KCNT, TAU,
                   s_t, stride_l,
                   BITS: tl.constexpr, LBLOCK: tl.constexpr, PB: tl.constexpr, R: tl.constexpr,
                   RL: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    # grid (n, P): each program closes its row's bracket over the list (the same steps in each; LPIV (n, P, RL)
    # int64 holds its pivots), then writes its segment's kept count and mass KCNT, KSEG (n, P) int64 (at or above
    # tau); program 0 writes TAU (n,) int64
    DT: tl.constexpr = LV.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    if tl.load(Temp + row * s_t) != 0:
        st = ST + row * 10
        lo, hi, c_lo, s_lo, c_hi, s_hi = (tl.load(st), tl.load(st + 1), tl.load(st + 2), tl.load(st + 3),
                                          tl.load(st + 4), tl.load(st + 5))
        src_lo, src_hi = tl.load(st + 6).to(tl.int32), tl.load(st + 7).to(tl.int32)
        k, pz = tl.load(st + 8), tl.load(st + 9)
        _M, _m, Mw, c, _nok, _on = row_consts(RS, row)
        pi = tl.arange(0, PB)
        if hi - lo > 1:
            off, mine, n = list_place(RI, ZS, CNT, MSS, row, p, P, src_lo, src_hi, PB, R)
            seg_c, seg_m = seg_at(RI, ZS, CNT, MSS, row, P, src_hi, PB, R)
            kcnt = tl.sum(tl.where(pi == p, seg_c, 0), 0)  # this segment's values >= hi
            kseg = tl.sum(tl.where(pi == p, seg_m, 0), 0)
            c_off, s_off = c_hi, s_hi  # the list holds [lo, hi): the values >= hi enter as their count and mass
            lv = LV + row * stride_l
            offs = tl.arange(0, LBLOCK)[None, :]  # (1, LBLOCK)
            rounds = 0
            while (hi - lo > 1) & (rounds < MAX_ROUNDS):
                pk = pin(LPIV + (row * P + p) * RL, mixed_pivots(lo, hi, RL, BITS, DT), RL)
                piv = to_value(pk, BITS, DT)[:, None]  # (RL, 1)
                lo_v, hi_v = to_value(lo, BITS, DT), to_value(hi, BITS, DT)
                acc_c = tl.zeros([RL, LBLOCK], tl.int32)
                acc_m = tl.zeros([RL, LBLOCK], tl.int64)
                least = tl.full([1, LBLOCK], BIG, tl.int64)  # the smallest and largest keys in [lo, hi)
                most = tl.full([1, LBLOCK], -BIG, tl.int64)
                for s in range(0, n, LBLOCK):
                    j = s + offs
                    x = tl.load(lv + j, mask=j < n, other=float("-inf")).to(tl.float32)
                    ge = x >= piv  # (RL, LBLOCK); -inf past the end: below every pivot
                    acc_c += ge.to(tl.int32)
                    acc_m += tl.where(ge, weight(x, Mw, c), 0)
                    inb = (x >= lo_v) & (x < hi_v)
                    kx = to_key(x, BITS, DT)
                    least = tl.minimum(least, tl.where(inb, kx, BIG))
                    most = tl.maximum(most, tl.where(inb, kx, -BIG))
                cnt = tl.sum(acc_c, 1).to(tl.int64) + c_off
                mss = tl.sum(acc_m, 1) + s_off
                # the ends onto the values: no value lies in [lo, least) or above most below hi, so the count and
                # mass at least are lo's (pred true) and above most hi's (pred false)
                least = tl.min(tl.min(least, 1), 0)
                most = tl.max(tl.max(most, 1), 0)
                lo = tl.where(least < BIG, least, lo)
                hi = tl.where(most > -BIG, most + 1, hi)
                lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo, src_hi = narrow(lo, hi, c_lo, s_lo, c_hi, s_hi, src_lo,
                                                                        src_hi, pk, cnt, mss, k, pz, 0, RL)
                rounds += 1
            tau_v = to_value(lo, BITS, DT)
            o1 = tl.arange(0, LBLOCK)
            for s in range(off, off + mine, LBLOCK):  # this segment's slice of the list, at or above tau
                j = s + o1
                x = tl.load(lv + j, mask=j < off + mine, other=float("-inf")).to(tl.float32)
                kept = (j < off + mine) & (x >= tau_v)
                kcnt += tl.sum(kept.to(tl.int64), 0)
                kseg += tl.sum(tl.where(kept, weight(x, Mw, c), 0), 0)
        else:  # closed by the row rounds (or no threshold): tau = lo, its per-segment partials
            seg_c, seg_m = seg_at(RI, ZS, CNT, MSS, row, P, src_lo, PB, R)
            kcnt = tl.sum(tl.where(pi == p, seg_c, 0), 0)
            kseg = tl.sum(tl.where(pi == p, seg_m, 0), 0)
        tl.store(KCNT + row * P + p, kcnt)
        tl.store(KSEG + row * P + p, kseg)
        if p == 0:
            tl.store(TAU + row, lo)


@triton.jit
def _draw_kernel(X, Temp, Seed, Pos, RI, RS, KSEG, KCNT, TAU, Out,
                 stride_x, s_t, s_s, s_q, vocab, seg, P,
                 BITS: tl.constexpr, BLOCK: tl.constexpr, PB: tl.constexpr):
    # grid (n,): Out (n,) int64, the token
    DT: tl.constexpr = X.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    pi = tl.arange(0, PB)
    pm = pi < P
    if tl.load(Temp + row * s_t) == 0:  # greedy: the segments' argmax, ties to the lowest id
        keys = tl.load(RI + (row * P + pi) * 4 + 2, mask=pm, other=-2147483647 - 1)
        ids = tl.load(RI + (row * P + pi) * 4 + 3, mask=pm, other=2147483647)
        tok = tl.min(tl.where(keys == tl.max(keys, 0), ids, 2147483647), 0).to(tl.int64)
    else:
        _M, _m, Mw, c, _nok, _on = row_consts(RS, row)
        tau_v = to_value(tl.load(TAU + row), BITS, DT)
        kseg = tl.load(KSEG + row * P + pi, mask=pm, other=0)  # (PB,)
        kcnt = tl.load(KCNT + row * P + pi, mask=pm, other=0)
        run = tl.cumsum(kseg, 0)  # (PB,) the kept mass up to each segment's end
        u = uniform(tl.load(Seed + row * s_s), tl.load(Pos + row * s_q))
        tgt = (u * tl.sum(kseg, 0).to(tl.float64)).to(tl.int64)  # run > u x K <=> run > floor(u x K)
        at = tl.min(tl.where(run > tgt, pi, PB), 0)  # the segment where the running sum passes the target
        passed = at < PB
        last = tl.max(tl.where(kcnt > 0, pi, -1), 0)  # else the last kept id: the last segment keeping any
        q = tl.where(passed, at, last)
        tgt = tl.where(passed, tgt, BIG)
        carry = tl.sum(tl.where(pi < q, kseg, 0), 0)
        xs = X + row * stride_x
        offs = tl.arange(0, BLOCK)
        tok = tl.full([], -1, tl.int64)
        last_id = tl.full([], -1, tl.int64)
        s = tl.maximum(q, 0) * seg
        end = tl.where(q >= 0, tl.minimum(s + seg, vocab), 0)
        nxt = tl.load(xs + s + offs, mask=s + offs < end, other=float("-inf"))
        while (tok < 0) & (s < end):
            idx = s + offs
            ok = idx < end
            x = nxt.to(tl.float32)
            nxt = tl.load(xs + idx + BLOCK, mask=idx + BLOCK < end, other=float("-inf"))  # the next block in flight
            kept = ok & (x >= tau_v)
            w = tl.where(kept, weight(x, Mw, c), 0)
            total = tl.sum(w, 0)
            if carry + total > tgt:  # the target is in this block: its running sum
                first = tl.min(tl.where(kept & (tl.cumsum(w, 0) + carry > tgt), idx, 2147483647), 0)
                tok = first.to(tl.int64)
            carry += total
            last_id = tl.maximum(last_id, tl.max(tl.where(kept, idx, -1), 0).to(tl.int64))
            s += BLOCK
        tok = tl.maximum(tl.where(tok >= 0, tok, last_id), 0)
    tl.store(Out + row, tok)


def programs_for(n: int, device: torch.device) -> int:
    """Programs per row for a batch of n rows: the power of two at or below w x SMs / n (w = 4 up to SMALL_BATCH
    rows, 2 past it), 1 to MAX_PROGRAMS. Measured on an H200 (132 SMs, vocab 152,064, the split draw captured:
    bench/results/sample-split-h200-2026-12-02/): the fastest P was 32 at 1 and 8 rows, 16 at 32 and 4 at 64; more
    programs than that add reductions and list rounds per row without filling the GPU more."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    waves = 4 if n <= SMALL_BATCH else 2
    per_row = max(1, waves * sms // max(n, 1))
    return min(MAX_PROGRAMS, 1 << (per_row.bit_length() - 1))


def splits_for(n: int, programs: int, seg: int, block: int, device: torch.device) -> int:
    """Q, the programs each segment's heavy passes (rounds, compaction) are cut into: the power of two at or below
    STREAM_WAVES x SMs / (n x P), at most MAX_SPLITS and at most seg / (MIN_SPLIT_BLOCKS x block) (no stretch
    shorter than that), at least 1. The partition sets no result: the stretches' sums are exact. Measured on an
    H200 (bench/results/sample-q-h200-2026-12-03/), the captured draw over Q: the fastest Q was 4-8 at 1 row, 1-2
    at 8, 1 at 32 and 2 at 64 (a tenth off Q = 1's time at 1 and 64 rows); past that, more programs cost more."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    q = min(MAX_SPLITS, STREAM_WAVES * sms // max(n * programs, 1), seg // (MIN_SPLIT_BLOCKS * block))
    return 1 << (max(q, 1).bit_length() - 1)


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  seed: torch.Tensor, position: torch.Tensor, *, programs_per_row: int | None = None,
                  splits: int | None = None, block: int = BLOCK, stream_block: int = STREAM_BLOCK,
                  list_block: int = LIST_BLOCK, cap: int = CAP, num_warps: int = NUM_WARPS,
                  search_warps: int = SEARCH_WARPS) -> torch.Tensor:
    """logits (n, vocab) bf16/fp16/fp32 with unit last stride; per row (n,) temperature, top_p (float), top_k,
    seed, position (int) in any strides -> (n,) int64 tokens, as `sample_triton` (checked by the caller): six
    launches, scratch from torch.empty, no host sync. programs_per_row: P (None: from the batch, `programs_for`);
    splits: Q, the programs per segment of the rounds and the compaction (None: `splits_for`); the tokens depend
    on neither. block, stream_block, list_block: values per step (the tests make them small at a small vocab);
    cap: the bracket size past which round 2 runs."""
    n, vocab = logits.shape
    dev = logits.device
    out = torch.empty(n, dtype=torch.long, device=dev)
    if n == 0:
        return out
    if vocab >= 1 << 23:
        raise ValueError(f"vocab {vocab} >= 2**23: the int64 fixed-point sums could overflow")
    want = programs_per_row if programs_per_row is not None else programs_for(n, dev)
    seg = triton.cdiv(triton.cdiv(vocab, max(want, 1)), ALIGN) * ALIGN
    seg = min(seg, MAX_STEPS * block)  # a huge row gets more programs: a lane's packed sums stay in bounds
    P = triton.cdiv(vocab, seg)
    PB = max(2, triton.next_power_of_2(P))
    want_q = splits if splits is not None else splits_for(n, P, seg, block, dev)
    sub = triton.cdiv(triton.cdiv(seg, max(want_q, 1)), ALIGN) * ALIGN  # a segment's stretch per program
    Q = triton.cdiv(seg, sub)
    bits = 32 if logits.dtype == torch.float32 else 16

    def scratch(*shape, dtype=torch.int64):
        return torch.empty(*shape, dtype=dtype, device=dev)

    rf, ri = scratch(n, P, 4, dtype=torch.float32), scratch(n, P, 4, dtype=torch.int32)  # range partials
    rs, st = scratch(n, 8, dtype=torch.float32), scratch(n, 10)  # a row's constants; its bracket at compaction
    zs, piv = scratch(n, P), scratch(n, 2, P, R)  # Z_s; each program's pivots, rounds 1 and 2
    cnt, mss = scratch(n, 2, P, R), scratch(n, 2, P, R)  # per-segment counts and masses at the pivots
    lv, lpiv = scratch(n, vocab, dtype=logits.dtype), scratch(n, P, RL)  # the list; the list rounds' pivots
    kseg, kcnt, tau = scratch(n, P), scratch(n, P), scratch(n)  # each segment's kept mass and count; tau's key
    ctr = scratch(n, P)  # the list's room taken so far, per segment (compaction)
    params = (temperature, top_p, top_k)
    strides = (temperature.stride(0), top_p.stride(0), top_k.stride(0))
    sx = logits.stride(0)
    grid, stream = (n, P), (n, P, Q)
    range_kernel[grid](logits, temperature, rf, ri, zs, cnt, mss, ctr, sx, strides[0], vocab, seg, BITS=bits,
                       INF_KEY=INF_BITS[logits.dtype], BLOCK=stream_block, R=R, num_warps=num_warps)
    for rnd in (1, 2):
        round_kernel[stream](logits, *params, rf, ri, rs, zs, piv, cnt, mss, sx, *strides, vocab, seg, sub, cap,
                             ROUND=rnd, BITS=bits, BLOCK=block, PB=PB, R=R, num_warps=num_warps)
    compact_kernel[stream](logits, *params, ri, rs, zs, piv, cnt, mss, lv, st, ctr, sx, *strides, lv.stride(0),
                           vocab, seg, sub, cap, BITS=bits, BLOCK=stream_block, PB=PB, R=R, num_warps=num_warps)
    _search_kernel[grid](temperature, ri, rs, zs, cnt, mss, lv, st, lpiv, kseg, kcnt, tau, strides[0], lv.stride(0),
                         BITS=bits, LBLOCK=list_block, PB=PB, R=R, RL=RL, MAX_ROUNDS=MAX_ROUNDS,
                         num_warps=search_warps)
    _draw_kernel[(n,)](logits, temperature, seed, position, ri, rs, kseg, kcnt, tau, out, sx, strides[0],
                       seed.stride(0), position.stride(0), vocab, seg, P, BITS=bits, BLOCK=stream_block, PB=PB,
                       num_warps=num_warps)
    return out
