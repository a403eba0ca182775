"""Triton per-row sampling: temperature, top-k and nucleus thresholds and one inverse-CDF draw, without a sort.

Why: the decode step's draw (kvtransfer/engine/sampler.py, which states the definition) used to sort every row;
at a 152k vocabulary that sort cost a large share of a decode step. Here one program takes one row and finds the
kept set's threshold by a search over the row's values instead: a few streaming passes over the row, the rest
over the few candidates.

The threshold tau = max(tau_k, tau_p) is the largest value v with pred(v) = (count(l >= v) >= k) or
(mass(l >= v) >= top_p * Z): both sides are monotone in v, so one search finds the larger threshold directly.
The search keeps a bracket [lo, hi) with pred(lo) true and pred(hi) false, in "keys": a value's bits in the
logits' dtype as a signed integer in value order (sign-magnitude to two's complement; -0.0 and +0.0 share key 0),
16 bits for bf16/fp16, 32 for fp32. A round evaluates pred at R pivots at once (an (R, BLOCK) compare, count and
mass accumulated per lane and reduced once per pass) and keeps the sub-bracket where pred turns; the bracket is
closed when hi = lo + 1, and then tau = lo, exactly. Per row, in one program:

1. the max M (a greedy row: its argmax, NaN the max and ties to the lowest id as torch's, and nothing more);
2. Z = sum w, with pred at the ladder M - t * (16, 8, 4, 2) (no pivots when neither threshold is on: all kept);
3. rarely, rounds over the row (R = 4, keys split evenly) while the bracket holds more than half the row;
4. the list: every aligned group of 16 bytes of the row holding a candidate, stored whole (values and group
   index, in id order: a prefix sum over groups places them, never timing). The candidates are every value
   >= lo when at most half the row is (the draw then runs over the list too), else the bracket's, the values
   >= hi entering the rounds as their count and mass;
5. rounds over the list (R = 8: 3 bits of the key a round) until the bracket closes;
6. the draw: target = u x mass(l >= tau), then a running sum of the kept weights in id order (block prefix sums
   and a carry) until it passes the target, over the list or the row (stopping there); past the end (float
   rounding), the last kept id.

Traffic per row of V values of b bytes: passes 1, 2 and 4 read the row (3 V b; from L2 at decode batch sizes,
the logits just written), 4 writes the groups holding candidates, and 5-6 read them (a few hundred to a few
thousand values for common settings). With neither threshold: 1, 2 and a draw over the row (half of it on
average). Pass 2 carries the exp and R compares per value, pass 4 a scan per group of 16 bytes; both are bound
by instruction issue on one SM, so a row's time does not grow with the batch until the rows outnumber the SMs.
Nothing depends on the batch: a row gives the same token alone or in any batch.

The uniform is computed here as `sampler.uniform` does (SplitMix64 in uint64, its top 53 bits), so a captured
draw is this one launch. Sums are float32 (per-lane partials, then a tree); the torch reference sums in another
order (float64), so the two agree except where a mass lands within float rounding of a threshold or of the
target. w = exp2((l - M) * log2(e) / t), the factor capped at the largest float32 (t -> 0 keeps w finite).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # row values per step of a pass over the row (halved for fp32: 8 KB a step either way)
LIST_BLOCK = 1024  # listed values per step of a pass over the compacted list
ROW_PIVOTS = 4  # pivots per round over the row (the ladder's rungs)
LIST_PIVOTS = 8  # pivots per round over the list
NUM_WARPS = 16
MAX_ROUNDS = 64  # per loop, a bound only: a round splits the key range 5 or 9 ways
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}  # +inf: NaNs are above


@triton.jit
def _key(v, BITS: tl.constexpr, DT: tl.constexpr):
    """float32 values (exact in DT) -> int64 keys in value order: DT's bits, sign-magnitude to two's complement."""
    if BITS == 16:
        b = v.to(DT).to(tl.int16, bitcast=True).to(tl.int64)
        k = tl.where(b < 0, -(b & 0x7FFF), b)
    else:
        b = v.to(tl.int32, bitcast=True).to(tl.int64)
        k = tl.where(b < 0, -(b & 0x7FFFFFFF), b)
    return k


@triton.jit
def _value(k, BITS: tl.constexpr, DT: tl.constexpr):
    """int64 keys -> their float32 values (the inverse of _key)."""
    if BITS == 16:
        v = tl.where(k < 0, -k - 32768, k).to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    else:
        v = tl.where(k < 0, -k - 2147483647 - 1, k).to(tl.int32).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _elem_key(x, BITS: tl.constexpr, INF_KEY: tl.constexpr):
    """A block of DT values -> int32 keys, NaN (either sign: torch's bf16 NaN is 0xFFFF) the largest, as torch's
    argmax takes it. The NaN test is on the bits: a magnitude past infinity's."""
    if BITS == 16:
        b = x.to(tl.int16, bitcast=True).to(tl.int32)
        mag = b & 0x7FFF
    else:
        b = x.to(tl.int32, bitcast=True)
        mag = b & 0x7FFFFFFF
    return tl.where(mag > INF_KEY, 2147483647, tl.where(b < 0, -mag, b))


@triton.jit
def _mix(z):
    """SplitMix64's finalizer on uint64 (products wrap mod 2**64)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _uniform(seed, position):
    """int64 seed and position -> float64 in [0, 1): bit for bit `sampler.uniform`."""
    s = seed.to(tl.uint64, bitcast=True)
    p = position.to(tl.uint64, bitcast=True)
    z = _mix(_mix(s) + (p + 1) * 0x9E3779B97F4A7C15)
    return (z >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2**-53


@triton.jit
def _argmax(xs, vocab, BITS: tl.constexpr, INF_KEY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -2147483647 - 1, tl.int32)  # below every key
    at_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        ok = idx < vocab
        k = tl.where(ok, _elem_key(tl.load(xs + idx, mask=ok, other=0.0), BITS, INF_KEY), -2147483647 - 1)
        up = k > best  # strictly: a lane keeps its first id among equal keys
        best = tl.where(up, k, best)
        at_id = tl.where(up, idx, at_id)
    top = tl.max(best, 0)
    return tl.min(tl.where(best == top, at_id, vocab), 0).to(tl.int64)


@triton.jit
def _row_range(xs, vocab, BLOCK: tl.constexpr):
    """The row's max and min as float32. Lanes past the end load the row's first value: no masks in the loop."""
    offs = tl.arange(0, BLOCK)
    first = tl.load(xs)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    nxt = tl.load(xs + offs, mask=offs < vocab, other=first)
    for start in range(0, vocab, BLOCK):
        x = nxt.to(tl.float32)
        idx = start + BLOCK + offs
        nxt = tl.load(xs + idx, mask=idx < vocab, other=first)  # the next block's load in flight
        mx = tl.maximum(mx, x)
        mn = tl.minimum(mn, x)
    return tl.max(mx, 0), tl.min(mn, 0)


@triton.jit
def _row_round(xs, vocab, M, c, pv, R: tl.constexpr, PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Over the row: Z = sum w, and per pivot (R,) count(l >= pv) and mass(l >= pv) (zeros without PIVOTS).
    The row is read as (1, BLOCK) so the (R, BLOCK) compares share its layout (no shuffle through shared
    memory)."""
    offs = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    piv = pv[:, None]  # (R, 1)
    acc_z = tl.zeros([1, BLOCK], tl.float32)
    acc_c = tl.zeros([R, BLOCK], tl.int32)
    acc_m = tl.zeros([R, BLOCK], tl.float32)
    nxt = tl.load(xs + offs, mask=offs < vocab, other=0.0)
    for start in range(0, vocab, BLOCK):
        raw = nxt
        ok = start + offs < vocab
        idx = start + BLOCK + offs
        nxt = tl.load(xs + idx, mask=idx < vocab, other=0.0)  # the next block's load in flight
        x = raw.to(tl.float32)
        w = tl.where(ok, tl.exp2((x - M) * c), 0.0)  # (1, BLOCK)
        acc_z += w
        if PIVOTS:
            ge = (x >= piv) & ok  # (R, BLOCK)
            acc_c += ge.to(tl.int32)
            acc_m += tl.where(ge, w, 0.0)
    return tl.sum(tl.sum(acc_z, 1), 0), tl.sum(acc_c, 1), tl.sum(acc_m, 1)


@triton.jit
def _list_round(lv, n, hi_c, M, c, pv, R: tl.constexpr, LBLOCK: tl.constexpr):
    """Over the list's first n values: per pivot (R,) count and mass of the values in [pv, hi_c) (2-D as in
    _row_round; the list's other values, below the candidates or NaN padding, never count)."""
    offs = tl.arange(0, LBLOCK)[None, :]  # (1, LBLOCK)
    piv = pv[:, None]  # (R, 1)
    acc_c = tl.zeros([R, LBLOCK], tl.int32)
    acc_m = tl.zeros([R, LBLOCK], tl.float32)
    for start in range(0, n, LBLOCK):
        idx = start + offs
        x = tl.load(lv + idx, mask=idx < n, other=float("nan")).to(tl.float32)
        w = tl.exp2((x - M) * c)
        ge = (x >= piv) & (x < hi_c)  # (R, LBLOCK)
        acc_c += ge.to(tl.int32)
        acc_m += tl.where(ge, w, 0.0)
    return tl.sum(acc_c, 1), tl.sum(acc_m, 1)


@triton.jit
def _narrow(lo, hi, c_lo, w_lo, c_hi, w_hi, pk, cnt, mass, k, pz):
    """The bracket after pred at pivots pk (R,) int64 keys, with their counts and masses: the highest true pivot
    is the new lo, the lowest false one the new hi, each with its count and mass (at lo: the kept set's size and
    mass if lo is tau). k and pz are the thresholds' bars, past reach when off."""
    pred = (cnt.to(tl.int64) >= k) | (mass >= pz)  # (R,)
    new_lo = tl.max(tl.where(pred, pk, lo), 0)
    new_hi = tl.min(tl.where(pred, hi, pk), 0)
    at = pred & (pk == new_lo)
    moved = tl.max(at.to(tl.int32), 0) > 0
    c_lo = tl.where(moved, tl.max(tl.where(at, cnt.to(tl.int64), 0), 0), c_lo)
    w_lo = tl.where(moved, tl.max(tl.where(at, mass, 0.0), 0), w_lo)
    at = (pk == new_hi) & (cnt.to(tl.int64) < k) & (mass < pz)  # not pred
    moved = tl.max(at.to(tl.int32), 0) > 0
    c_hi = tl.where(moved, tl.max(tl.where(at, cnt.to(tl.int64), 0), 0), c_hi)
    w_hi = tl.where(moved, tl.max(tl.where(at, mass, 0.0), 0), w_hi)
    return new_lo, new_hi, c_lo, w_lo, c_hi, w_hi


@triton.jit
def _pivots(lo, hi, R: tl.constexpr):
    """R keys spread evenly over (lo, hi) (some may repeat or equal lo when the bracket is narrow; one is inside
    whenever hi - lo >= 2)."""
    j = tl.arange(0, R).to(tl.int64)
    return lo + ((hi - lo) * (j + 1)) // (R + 1)


@triton.jit
def _mixed_pivots(lo, hi, R: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """R keys in (lo, hi): half spread evenly over the values, half over the keys. Over the values, a crowded
    bracket's population shrinks fast (keys crowd near 0, where a logit body has few values); over the keys, it
    closes in a bounded number of rounds whatever the data. (_narrow needs no order among pivots.)"""
    j = tl.arange(0, R)
    half = j < R // 2
    f = ((j % (R // 2)) + 1).to(tl.float32) / (R // 2 + 1)
    lo_v, hi_v = _value(lo, BITS, DT), _value(hi, BITS, DT)
    v = lo_v * (1.0 - f) + hi_v * f  # no overflow at the float range's ends
    by_key = lo + ((hi - lo) * ((j % (R // 2)) + 1).to(tl.int64)) // (R // 2 + 1)
    finite = tl.abs(v) < float("inf")  # false for NaN too: an infinite end (a row with -inf logits)
    k = tl.where(half & finite, _key(tl.where(finite, v, 0.0), BITS, DT), by_key)
    return tl.minimum(tl.maximum(k, lo + 1), hi - 1)


@triton.jit
def _compact(xs, vocab, lo_v, hi_v, lv, lg, BLOCK: tl.constexpr, G: tl.constexpr):
    """Lists, in id order, every aligned group of G ids with a value in [lo_v, hi_v): its G values (as stored,
    NaN past the row's end) into lv and its index into lg. Returns the number of groups. Whole groups, so each
    thread's G values (one 16-byte load) are stored as loaded: one scan of BLOCK / G flags per block, and no
    scatter of single values."""
    rows = tl.arange(0, BLOCK // G)  # (BLOCK / G,)
    cols = tl.arange(0, G)[None, :]  # (1, G)
    offs = rows[:, None] * G + cols  # (BLOCK / G, G)
    ng = tl.zeros([], tl.int32)
    nxt = tl.load(xs + offs, mask=offs < vocab, other=float("nan"))
    for start in range(0, vocab, BLOCK):
        raw = nxt
        idx = start + BLOCK + offs
        nxt = tl.load(xs + idx, mask=idx < vocab, other=float("nan"))  # the next block's load in flight
        x = raw.to(tl.float32)
        flag = tl.max(((x >= lo_v) & (x < hi_v)).to(tl.int32), 1)  # (BLOCK / G,): the group has a candidate
        slot = ng + tl.cumsum(flag, 0) - 1
        tl.store(lv + slot[:, None] * G + cols, raw, mask=(flag[:, None] > 0) & (cols < G))
        tl.store(lg + slot, start // G + rows, mask=flag > 0)
        ng += tl.sum(flag, 0)
    return ng


@triton.jit
def _draw_row(xs, vocab, M, c, tau, tgt, BLOCK: tl.constexpr):
    """The first id of the row (in id order) whose running kept mass passes tgt; -1 and the last kept id."""
    offs = tl.arange(0, BLOCK)
    carry = tl.zeros([], tl.float32)
    tok = tl.full([], -1, tl.int32)
    last = tl.full([], -1, tl.int32)
    start = tl.zeros([], tl.int32)
    nxt = tl.load(xs + offs, mask=offs < vocab, other=float("-inf"))
    while (tok < 0) & (start < vocab):
        x = nxt.to(tl.float32)
        ids = start + offs
        idx = start + BLOCK + offs
        nxt = tl.load(xs + idx, mask=idx < vocab, other=float("-inf"))
        kept = (ids < vocab) & (x >= tau)
        w = tl.where(kept, tl.exp2((x - M) * c), 0.0)
        run = tl.cumsum(w, 0) + carry  # (BLOCK,) non-decreasing
        first = tl.min(tl.where(kept & (run > tgt), ids, 2147483647), 0)
        tok = tl.where(first < 2147483647, first, tok)
        last = tl.maximum(last, tl.max(tl.where(kept, ids, -1), 0))
        carry = tl.max(run, 0)
        start += BLOCK
    return tok, last


@triton.jit
def _draw_list(lv, lg, n, M, c, tau, tgt, LBLOCK: tl.constexpr, G: tl.constexpr):
    """_draw_row over the list's first n values (groups ascending; the id of value j is lg[j // G] * G + j % G)."""
    offs = tl.arange(0, LBLOCK)
    carry = tl.zeros([], tl.float32)
    tok = tl.full([], -1, tl.int32)
    last = tl.full([], -1, tl.int32)
    start = tl.zeros([], tl.int32)
    while (tok < 0) & (start < n):
        j = start + offs
        ok = j < n
        x = tl.load(lv + j, mask=ok, other=float("nan")).to(tl.float32)
        ids = tl.load(lg + j // G, mask=ok, other=0) * G + j % G
        kept = x >= tau  # NaN padding never
        w = tl.where(kept, tl.exp2((x - M) * c), 0.0)
        run = tl.cumsum(w, 0) + carry
        first = tl.min(tl.where(kept & (run > tgt), ids, 2147483647), 0)
        tok = tl.where(first < 2147483647, first, tok)
        last = tl.maximum(last, tl.max(tl.where(kept, ids, -1), 0))
        carry = tl.max(run, 0)
        start += LBLOCK
    return tok, last


@triton.jit
def _sample_kernel(
    X, Temp, TopP, TopK, Seed, Pos, Out, ListV, ListG,
    stride_x, s_t, s_p, s_k, s_s, s_q, stride_lv, stride_lg,
    vocab, cap,
    BITS: tl.constexpr, INF_KEY: tl.constexpr, BLOCK: tl.constexpr, LBLOCK: tl.constexpr, G: tl.constexpr,
    RP: tl.constexpr, RL: tl.constexpr, MAX_ROUNDS: tl.constexpr,
):
    # grid (n,): one program per row of X (n, vocab); Out (n,) int64; scratch per row: ListV (n, >= vocab) in
    # X's dtype, ListG (n, >= vocab / G) int32.
    DT: tl.constexpr = X.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    xs = X + row * stride_x
    t = tl.load(Temp + row * s_t).to(tl.float32)
    if t == 0.0:
        tok = _argmax(xs, vocab, BITS, INF_KEY, BLOCK)
    else:
        top_p = tl.load(TopP + row * s_p).to(tl.float32)
        top_k = tl.load(TopK + row * s_k).to(tl.int64)
        lv = ListV + row * stride_lv
        lg = ListG + row * stride_lg
        M, m = _row_range(xs, vocab, BLOCK)
        c = tl.minimum(1.4426950408889634 / t, 3.4028234663852886e38)
        k_on = (top_k > 0) & (top_k < vocab)
        p_on = top_p < 1.0
        k = tl.where(k_on, top_k, 1 << 62)  # count(l >= v) >= k: never when off
        lo = _key(m, BITS, DT)  # int64: pred(min) holds (everything counts)
        hi = _key(M, BITS, DT) + 1  # nothing is above M
        c_lo = lo * 0 + vocab
        c_hi = lo * 0
        w_hi = tl.zeros([], tl.float32)
        # round 1: Z and the ladder M - t * (16, 8, 4, 2), ascending
        rung = tl.arange(0, RP)
        ladder = tl.maximum(M - t * tl.exp2((RP - rung).to(tl.float32)), m)  # below the min: the min
        pk = tl.minimum(tl.maximum(_key(ladder, BITS, DT), lo), hi - 1)
        if k_on | p_on:
            z, cnt, mass = _row_round(xs, vocab, M, c, _value(pk, BITS, DT), RP, True, BLOCK)
            pz = tl.where(p_on, top_p * z, float("inf"))
            lo, hi, c_lo, w_lo, c_hi, w_hi = _narrow(lo, hi, c_lo, z, c_hi, w_hi, pk, cnt, mass, k, pz)
        else:  # every token kept: tau = the min, the bracket closed at once
            z, cnt, mass = _row_round(xs, vocab, M, c, _value(pk, BITS, DT), RP, False, BLOCK)
            pz = top_p * z
            hi = lo + 1
            w_lo = z
        rounds = 0
        while (c_lo - c_hi > cap) & (hi - lo > 1) & (rounds < MAX_ROUNDS):  # a crowded bracket: a deep threshold
            rk = _mixed_pivots(lo, hi, RP, BITS, DT)
            _, r_cnt, r_mass = _row_round(xs, vocab, M, c, _value(rk, BITS, DT), RP, True, BLOCK)
            lo, hi, c_lo, w_lo, c_hi, w_hi = _narrow(lo, hi, c_lo, w_lo, c_hi, w_hi, rk, r_cnt, r_mass, k, pz)
            rounds += 1
        # the list: every value >= lo when they fit (the draw then runs over it too), else the bracket's values
        # (the values >= hi then enter the rounds as their count and mass, and the draw runs over the row)
        whole = c_lo <= cap
        n = tl.zeros([], tl.int32)
        if whole | (hi - lo > 1):
            c_off = tl.where(whole, 0, c_hi)
            w_off = tl.where(whole, 0.0, w_hi)
            hi_c = tl.where(whole, float("inf"), _value(hi, BITS, DT))
            n = _compact(xs, vocab, _value(lo, BITS, DT), hi_c, lv, lg, BLOCK, G) * G
            rounds = 0
            while (hi - lo > 1) & (rounds < MAX_ROUNDS):
                lk = _pivots(lo, hi, RL)
                l_cnt, l_mass = _list_round(lv, n, hi_c, M, c, _value(lk, BITS, DT), RL, LBLOCK)
                lo, hi, c_lo, w_lo, c_hi, w_hi = _narrow(lo, hi, c_lo, w_lo, c_hi, w_hi, lk, l_cnt + c_off,
                                                         l_mass + w_off, k, pz)
                rounds += 1
        tau = _value(lo, BITS, DT)
        # target = u * kept mass in float64, compared as float32: run > target <=> run > (target rounded down)
        target = _uniform(tl.load(Seed + row * s_s), tl.load(Pos + row * s_q)) * w_lo.to(tl.float64)
        tgt = target.to(tl.float32)
        tgt = tl.where(tgt.to(tl.float64) > target, (tgt.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True),
                       tgt)
        if whole:
            found, last = _draw_list(lv, lg, n, M, c, tau, tgt, LBLOCK, G)
        else:
            found, last = _draw_row(xs, vocab, M, c, tau, tgt, BLOCK)
        tok = tl.maximum(tl.where(found >= 0, found, last), 0).to(tl.int64)
    tl.store(Out + row, tok)


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  seed: torch.Tensor, position: torch.Tensor, *, block: int | None = None,
                  list_block: int = LIST_BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """logits (n, vocab) bf16/fp16/fp32 with unit last stride; per row (n,) temperature, top_p (float), top_k,
    seed, position (int) in any strides -> (n,) int64 tokens, one launch (checked by the caller). block /
    list_block: values per step (the tests make them small to cross block edges at a small vocab)."""
    n, vocab = logits.shape
    dev = logits.device
    out = torch.empty(n, dtype=torch.long, device=dev)
    if n == 0:
        return out
    group = 16 // logits.element_size()  # values per listed group: one 16-byte load
    if block is None:
        block = BLOCK * 2 // logits.element_size()
    groups = triton.cdiv(vocab, group)
    list_v = torch.empty(n, groups * group, dtype=logits.dtype, device=dev)
    list_g = torch.empty(n, groups, dtype=torch.int32, device=dev)
    _sample_kernel[(n,)](
        logits, temperature, top_p, top_k, seed, position, out, list_v, list_g,
        logits.stride(0), temperature.stride(0), top_p.stride(0), top_k.stride(0), seed.stride(0),
        position.stride(0), list_v.stride(0), list_g.stride(0),
        vocab, max(vocab // 32, 1024),  # cap: list at most this many candidates (a list holds up to 8x as many)
        BITS=32 if logits.dtype == torch.float32 else 16, INF_KEY=_INF_BITS[logits.dtype],
        BLOCK=block, LBLOCK=list_block, G=group, RP=ROW_PIVOTS, RL=LIST_PIVOTS, MAX_ROUNDS=MAX_ROUNDS,
        num_warps=num_warps,
    )
    return out
