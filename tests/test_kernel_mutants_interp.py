"""One-line kernel bugs the interpreter tests let through, each pinned by a test here (Triton interpreter, CPU).

A mutation pass over the Triton kernels (kvtransfer/kernels/triton_rope.py, triton_norm.py, triton_attention.py,
triton_attention_split.py, triton_chunk_attention.py, triton_mixed_attention.py, triton_paging.py, triton_gemv.py,
triton_matmul.py; not the sampling kernels): ~100 one-line mutants planted by hand (a mask's < made <=, a dropped
mask or rounding, a stride taken from the wrong tensor, a constant changed, a grid rounded down, a range check
removed) and run against tests/test_kernels_interp.py and tests/test_invariant_interp.py. Most died there; the ones
that lived sat on paths those tests never reach:

- every RoPE case has a power-of-two head dim, cos/sin built as cat(a, a) (so the halves' cos/sin are
  interchangeable) and contiguous q/k/v/cos/sin, and its tolerances absorb the rounding of cos/sin to the
  activation dtype;
- the rope+store range checks were tried with positions out of range only, never a slot or a table entry outside
  the pool (documented as skipped, triton_paging.position_offset);
- the norms' and SiLU's roundings to the activation dtype sit below the tolerances, and no row is all zeros (where
  the norm's eps is all that keeps it finite);
- no decode attention row had scores far below zero (the online softmax's running max starts at -inf: a start at 0
  underflows every probability), and the by-count merge never saw a row of length 0 (one split writes it itself) or
  a head dim cut over several merge programs;
- the chunk and fused mixed kernels were only given a q as contiguous as their output;
- the batch-1 GEMV (triton_gemv.py) had no interpreter test at all (its autotuner cannot time on CPU: here each
  config is launched alone).

Equivalent mutants are listed in the pass's report, not here. Small shapes: the file runs on CPU in seconds. Run with
`TRITON_INTERPRET=1 python -m pytest tests/test_kernel_mutants_interp.py`; skipped otherwise, as
tests/test_kernels_interp.py (whose interpreter caveats hold: fp32 -> bf16 truncates, so exact checks here use fp32
and fp16).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton interpreter tests", allow_module_level=True)
pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's numpy use

from bench.measure.kernel_inputs import attention_gold, decode_case, paged_copy
from kvtransfer.kernels import ops as K
from kvtransfer.kernels import reference as R


def _rel_err(out, gold):
    return ((out.float() - gold.float()).abs().max() / gold.float().abs().max()).item()


def _rope_inputs(dtype, d, batch=3, hq=6, hkv=2, num_slots=4, max_seq=16, seed=41, tied=False):
    """RoPE inputs whose cos/sin halves differ (HF's are cat(a, a); the kernel's contract is the full (B, D) rows)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    ang = torch.randn(batch, d, generator=gen) * 3
    if tied:
        ang = torch.cat((ang[:, :d // 2], ang[:, :d // 2]), dim=-1)
    cos, sin = ang.cos() * 1.1, ang.sin() * 1.1
    pools = [torch.randn(num_slots, hkv, max_seq, d, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.tensor([2, 0, 3][:batch])
    positions = torch.tensor([15, 0, 7][:batch], dtype=torch.int32)
    return q, k, v, cos, sin, pools, slots, positions


def _rope_both(q, k, v, cos, sin, pools, slots, positions, **kw):
    ref_pools, tri_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    q_ref = K.rope_store(q, k, v, cos, sin, *ref_pools, slots, positions, use_triton=False, **kw)
    q_tri = K.rope_store(q, k, v, cos, sin, *tri_pools, slots, positions, use_triton=True, **kw)
    return q_ref, ref_pools, q_tri, tri_pools


@pytest.mark.parametrize("d", [80, 64], ids=["D80-not-pow2", "D64"])
def test_rope_store_untied_halves_and_a_head_dim_not_a_power_of_two(d):
    """Kills, in triton_rope.py: `mask_half = offs <= HALF` and `x2 = tl.load(ptr + BLOCK_HALF, ...)` (equal to the
    right ones at a power-of-two D: BLOCK_HALF == HALF); `c2 = tl.load(Cos + b * stride_cb + offs, ...)` and
    `s2 = tl.load(Sin + b * stride_sb + offs, ...)` (the first half's cos/sin for the second half: the same values
    when cos/sin are cat(a, a), as in the other tests)."""
    q, k, v, cos, sin, pools, slots, positions = _rope_inputs(torch.float32, d)
    q_ref, ref_pools, q_tri, tri_pools = _rope_both(q, k, v, cos, sin, pools, slots, positions)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tri_pools[0], ref_pools[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(tri_pools[1], ref_pools[1])


def test_rope_store_rounds_cos_sin_to_the_activation_dtype():
    """The kernel's math exactly: cos/sin rounded to fp16 first, products and sum in fp32, one rounding (fp16: the
    interpreter rounds to nearest there). Kills `c1 = tl.load(Cos + ...).to(tl.float32)` without `.to(act_ty)` (an
    fp32 cos: within the other tests' tolerance)."""
    q, k, v, cos, sin, pools, slots, positions = _rope_inputs(torch.float16, 64, tied=True)
    _, _, q_tri, tri_pools = _rope_both(q, k, v, cos, sin, pools, slots, positions)
    c, s = cos.to(torch.float16).float()[:, None, :], sin.to(torch.float16).float()[:, None, :]

    def rotated(x):
        x = x.float()
        return (x * c + R.rotate_half(x) * s).to(torch.float16)

    assert torch.equal(q_tri, rotated(q))
    assert torch.equal(tri_pools[0][slots, :, positions.long()], rotated(k))


def test_rope_store_strided_views_of_a_fused_projection():
    """q, k as views of one fused qkv row (HF's q/k/v are slices of it), v contiguous, sin a view of a wider tensor:
    every stride differs from its neighbour's. Kills in rope_store_triton's launch: `q.stride(0), q.stride(1)` for
    q_out's strides, `k.stride(0), k.stride(1)` for v's, `cos.stride(0)` for sin's."""
    q, k, v, cos, sin, pools, slots, positions = _rope_inputs(torch.float32, 64)
    batch, hq, d = q.shape
    hkv = k.shape[1]
    qkv = torch.randn(batch, hq + 2 * hkv, d)
    qkv[:, :hq], qkv[:, hq:hq + hkv] = q, k
    q_view, k_view = qkv[:, :hq], qkv[:, hq:hq + hkv]
    wide = torch.randn(batch, 3 * d)
    wide[:, d:2 * d] = sin
    sin_view = wide[:, d:2 * d]
    assert not (q_view.is_contiguous() or k_view.is_contiguous() or sin_view.is_contiguous())
    q_ref, ref_pools, q_tri, tri_pools = _rope_both(q_view, k_view, v, cos, sin_view, pools, slots, positions)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tri_pools[0], ref_pools[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(tri_pools[1], ref_pools[1])


def _guarded(pool: torch.Tensor) -> torch.Tensor:
    """The pool with a guard slot (block) on each side, one buffer: view [1:-1] is the (contiguous) pool, so a write
    to slot -1 or slot S lands in a guard instead of outside any tensor."""
    buf = torch.full((pool.shape[0] + 2, *pool.shape[1:]), 7.0, dtype=pool.dtype)
    buf[1:-1] = pool
    return buf


def test_rope_store_skips_slots_and_blocks_outside_the_pool():
    """A row whose slot (slot layout), table row or table entry lies outside the pool writes nothing
    (triton_paging.position_offset); the one good row still writes. The pools sit between guard slots, so a write
    past either end is seen. Kills in position_offset: `(row >= 0)` or `(row < num_blocks)` dropped from the slot
    layout's in_range, `(row >= 0)` dropped from the paged `inside`, `(block >= 0)` or `(block < num_blocks)`
    dropped from the paged in_range."""
    q, k, v, cos, sin, pools, _, _ = _rope_inputs(torch.float32, 16, batch=3, num_slots=4, max_seq=32)
    positions = torch.tensor([3, 5, 9], dtype=torch.int32)
    for slots in (torch.tensor([-1, 4, 1]), torch.tensor([1, -1, 4])):  # slot -1, slot == S: skipped
        bufs = [_guarded(p) for p in pools]
        K.rope_store(q, k, v, cos, sin, *(b[1:-1] for b in bufs), slots, positions, use_triton=True)
        good = int((slots == 1).nonzero())
        for before, after in zip(pools, bufs):
            changed = (_guarded(before) != after).any(dim=(1, 3)).nonzero().tolist()
            assert changed == [[2, int(positions[good])]], changed  # slot 1 is the buffer's 2
    paged = [paged_copy(p, 8, seed=3, spare=1) for p in pools]  # 4 blocks a slot, 17 blocks
    table = paged[0][1].clone()
    num_blocks = paged[0][0].shape[0]
    table[2, 1] = -1  # an unallocated entry
    table[3, 1] = num_blocks  # an entry past the pool
    positions = torch.tensor([12, 13, 9], dtype=torch.int32)  # all in their rows' second block
    for slots in (torch.tensor([2, 3, 1]), torch.tensor([-1, 3, 1])):
        bufs = [_guarded(p) for p, _ in paged]
        K.rope_store(q, k, v, cos, sin, *(b[1:-1] for b in bufs), slots, positions, use_triton=True,
                     block_table=table)
        for (before, _), after in zip(paged, bufs):
            changed = (_guarded(before).nan_to_num(7.0) != after.nan_to_num(7.0)).flatten(1).any(1).nonzero()
            assert changed.flatten().tolist() == [int(table[1, 1]) + 1], changed


def test_rms_norm_rounds_the_normalized_value_before_the_weight():
    """bf16 x with an fp32 weight of powers of two: HF's weight * h.to(bf16) is exact in fp32, so every output is a
    bf16 value times a power of two (whatever rounding mode the interpreter has). Kills
    `h = (x * rstd).to(act_ty).to(tl.float32)` without the rounding (within test_rms_norm_fp32_weight_promotes_like_hf's
    tolerance)."""
    gen = torch.Generator().manual_seed(43)
    x = torch.randn(3, 100, generator=gen).to(torch.bfloat16)
    w = 2.0 ** torch.randint(-1, 2, (100,), generator=gen).float()
    out = K.rms_norm(x, w, 1e-6, use_triton=True)
    assert out.dtype == torch.float32
    h = out / w
    assert torch.equal(h.to(torch.bfloat16).float(), h)
    torch.testing.assert_close(out, K.rms_norm(x, w, 1e-6), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_a_zero_row_is_zero(dtype):
    """A zero row (a padding row's hidden state) normalizes to zeros: eps keeps rsqrt finite. Kills
    `rstd = tl.math.rsqrt(var)` (eps dropped: 0 * inf = NaN; elsewhere eps = 1e-6 moves nothing the tolerances
    see), in rms_norm and add_rms_norm alike; a large eps checks that it is added, not multiplied."""
    gen = torch.Generator().manual_seed(44)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    x[1] = 0
    w = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    out = K.rms_norm(x, w, 1e-6, use_triton=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    normed, res = K.add_rms_norm(x, -x, w, 1e-6, use_triton=True)
    assert torch.equal(normed, torch.zeros_like(normed)) and torch.equal(res, torch.zeros_like(res))
    small = x * 0.01
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(K.rms_norm(small, w, 0.5, use_triton=True), K.rms_norm(small, w, 0.5),
                               rtol=tol, atol=tol)


def test_silu_mul_rounds_silu_before_the_multiply():
    """fp16 (the interpreter rounds to nearest there): silu(g) rounded to fp16, then times u, rounded: the bits of
    the reference (HF's act(gate) * up) except where torch's and numpy's sigmoid differ by an fp32 ulp across an
    fp16 rounding edge (rare). Kills `act = g * tl.sigmoid(g)` without the rounding (a double rounding: most
    elements within one fp16 ulp, the tolerance of test_norms_and_silu_match_reference)."""
    gen = torch.Generator().manual_seed(45)
    gate_up = (torch.randn(4, 2 * 256, generator=gen) * 3).to(torch.float16)
    got, want = K.silu_mul(gate_up, use_triton=True), K.silu_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert (got != want).sum().item() <= 2, (got != want).sum().item()


def _far_below_zero(batch=3, rows=0, hq=4, hkv=2, d=16, max_seq=128, seed=46):
    """q, pools whose every score is about -180 in log2 units (q . k * scale * log2 e): q = 4 everywhere, keys -8 plus
    a little noise. The softmax is shift invariant, so the output is an ordinary average of V; a running max
    started at 0 instead of -inf gives exp2(-180) = 0 for every probability (fp32 underflows below 2^-149)."""
    gen = torch.Generator().manual_seed(seed)
    k_pool = -8 + 0.05 * torch.randn(4, hkv, max_seq, d, generator=gen)
    v_pool = torch.randn(4, hkv, max_seq, d, generator=gen)
    q = torch.full((batch + rows, hq, d), 4.0) + 0.05 * torch.randn(batch + rows, hq, d, generator=gen)
    return q, k_pool, v_pool


@pytest.mark.parametrize("splits", [{"num_splits": 1}, {"num_splits": 3}, {"split_size": 64}],
                         ids=["one-split", "three-splits", "fixed-splits"])
def test_decode_attention_with_every_score_far_below_zero(splits):
    """Kills `m_i = tl.full([BLOCK_H], 0.0, tl.float32)` in decode_program (the running max's -inf start made 0: the
    scores of the other tests are within a few units of 0, where any start works) and `m = 0.0` for
    `m = float("-inf")` in triton_attention_split.merge_split_partials (the fixed-split merge: every weight 0)."""
    q, k_pool, v_pool = _far_below_zero()
    slots, lengths = torch.tensor([2, 0, 3]), torch.tensor([128, 37, 100])
    out = K.decode_attention(q, k_pool, v_pool, slots, lengths, 0.25, use_triton=True, **splits)
    ref = K.decode_attention(q, k_pool, v_pool, slots, lengths, 0.25, use_triton=False)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) <= 1e-5


def test_chunk_attention_with_every_score_far_below_zero():
    """Kills `m_i = tl.full([BLOCK_M], 0.0, tl.float32)` in triton_chunk_attention.chunk_program (as the decode
    kernel's: all probabilities underflow)."""
    q, k_pool, v_pool = _far_below_zero(batch=0, rows=70)
    pieces = torch.tensor([[0, 5, 1, 60], [5, 65, 2, 0]], dtype=torch.int32)
    out = K.chunk_attention(q, k_pool, v_pool, pieces, 0.25, use_triton=True)
    ref = K.chunk_attention(q, k_pool, v_pool, pieces, 0.25, use_triton=False)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) <= 1e-5


def test_decode_attention_merge_of_a_row_of_length_zero():
    """By count, a row of length 0 among rows merged over 3 splits: no split is active, the merge writes zeros (the
    other tests' length-0 rows take one split, whose stage 1 writes the zeros itself). Kills, in
    triton_attention_split._decode_stage2, `m = tl.where(m == float("-inf"), 0.0, m)` dropped and
    `denom = tl.sum(w, 0)` without the 1e-30 floor (0 / 0)."""
    case = decode_case([0, 50, 130, 0], 4, 2, 16, max_seq=160, dtype=torch.float32, seed=47)
    out = K.decode_attention(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale,
                             use_triton=True, num_splits=3)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[3], torch.zeros_like(out[3]))
    assert _rel_err(out, attention_gold(case)) <= 1e-5


def test_decode_attention_merge_over_several_head_dim_programs():
    """128 splits: the merge's tile is 128 splits x 32 dims, so a head dim of 80 takes 3 programs, the last one part
    full (elsewhere one program covers D). The output is a slice of a buffer with a guard row. Kills, in
    _decode_stage2, `offs_d = tl.arange(0, BLOCK_DS)` (pid_d's offset dropped) and the store's `mask=mask_d`
    dropped (dims 80..95 written into the next head, past the last one into the guard)."""
    case = decode_case([150, 1, 64, 65, 200], 6, 2, 80, max_seq=200, dtype=torch.float32, seed=48)
    buf = torch.full((6, 6, 80), 7.0)
    out = K.decode_attention(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale,
                             use_triton=True, num_splits=128, out=buf[:5])
    assert (buf[5] == 7.0).all()
    assert _rel_err(out, attention_gold(case)) <= 1e-5


def _wide(rows: int, hq: int, d: int, extra_heads: int = 3) -> torch.Tensor:
    """A (rows, Hq + extra, D) buffer of 7.0: its first Hq heads are an output with a row stride that is not Hq * D
    (a slice of a wider tensor), the rest a guard."""
    return torch.full((rows, hq + extra_heads, d), 7.0)


def test_attention_kernels_into_an_output_strided_unlike_q():
    """q contiguous, `out` a view of a wider buffer: the kernels must take out's strides for out, not q's. Kills
    `q.stride(0), q.stride(1)` for `out.stride(0), out.stride(1)` in the launches of chunk_attention_triton and
    mixed_attention_triton, and in decode_attention_triton's stage-1 launch (read at one split only, where stage 1
    writes the output: the strided-q test of test_kernels_interp.py merges 2 splits, whose merge has its own
    strides). The other tests' outputs have q's strides."""
    gen = torch.Generator().manual_seed(49)
    hq, hkv, d = 4, 2, 16
    k_pool, v_pool = (torch.randn(4, hkv, 160, d, generator=gen) for _ in range(2))
    q = torch.randn(100, hq, d, generator=gen)
    pieces = torch.tensor([[0, 5, 1, 130], [5, 73, 0, 0], [80, 1, 3, 17], [81, 15, -1, 0]], dtype=torch.int32)
    buf = _wide(96, hq, d)
    got = K.chunk_attention(q[4:], k_pool, v_pool, pieces, 0.25, use_triton=True, out=buf[:, :hq])
    want = K.chunk_attention(q[4:], k_pool, v_pool, pieces, 0.25, use_triton=True, out=torch.full((96, hq, d), 7.0))
    assert torch.equal(got, want) and (buf[:, hq:] == 7.0).all()
    slots, lengths = torch.tensor([0, 2, 3, 1]), torch.tensor([40, 1, 150, 9])
    buf = _wide(100, hq, d)
    got = K.mixed_attention(q, k_pool, v_pool, 4, slots, lengths, pieces, 0.25, use_triton=True, out=buf[:, :hq])
    want = K.mixed_attention(q, k_pool, v_pool, 4, slots, lengths, pieces, 0.25, use_triton=True,
                             out=torch.full((100, hq, d), 7.0))
    assert torch.equal(got, want) and (buf[:, hq:] == 7.0).all()
    covered = list(range(4 + 78)) + [4 + 80]
    ref = K.mixed_attention(q, k_pool, v_pool, 4, slots, lengths, pieces, 0.25, use_triton=False)
    assert _rel_err(got[covered], ref[covered]) <= 1e-5
    buf = _wide(4, hq, d)  # one split: stage 1 writes the output itself (FINAL), through out's strides
    got = K.decode_attention(q[:4], k_pool, v_pool, slots, lengths, 0.25, use_triton=True, num_splits=1,
                             out=buf[:, :hq])
    assert torch.equal(got, K.decode_attention(q[:4], k_pool, v_pool, slots, lengths, 0.25, use_triton=True,
                                               num_splits=1))
    assert (buf[:, hq:] == 7.0).all()


def _gemv_inputs(n, k, seed):
    """fp16 x (1, K) of multiples of 2^-10 below 2 and weights in {-1, 0, 1}: every fp32 sum is exact (numerators
    below 2^24), so the kernel's sum order cannot move a bit and the expected outputs are exact. x is the front of
    a (1, K + 1) row whose last element is 1, so reading x past K shows."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.ones(1, k + 1, dtype=torch.float16)
    row[:, :k] = (torch.randint(-2047, 2048, (1, k), generator=gen) / 1024).to(torch.float16)
    w = torch.randint(-1, 2, (n, k), generator=gen).to(torch.float16)
    bias = (torch.randint(-2047, 2048, (n,), generator=gen) / 1024).to(torch.float16)
    return row[:, :k], w, bias


def _exact(x, w, bias=None):
    y = (x.double() @ w.double().T).float()  # exact (see _gemv_inputs)
    return y if bias is None else y + bias.float()


def test_gemv_under_the_interpreter_every_config(monkeypatch):
    """triton_gemv.py had no interpreter test (its autotuner cannot time on CPU): each config alone, plain, with a
    bias and gated, N = 37 (no config's BLOCK_N divides it) and K = 300 (a partial last K block in each), against
    exact sums rounded to fp16 (the gated form: silu(g) in fp16 with g and up rounded first, as silu_mul of the
    unfused path; at most one element where numpy's and torch's sigmoid round apart). Kills in triton_gemv.py:
    `k_ok = cols <= K`, `(n // meta["BLOCK_N"],)` for the grid, the bias dropped, `u_rows` one row early,
    `g = y` and `up = tl.sum(acc_u, axis=1)` without their rounding to fp16, and SiLU(g) not rounded before the
    multiply."""
    from kvtransfer.kernels import triton_gemv as TG

    n, k = 37, 300
    x, w, bias = _gemv_inputs(2 * n, k, seed=50)
    plain = _exact(x, w[:n]).to(torch.float16)
    biased = _exact(x, w[:n], bias[:n]).to(torch.float16)
    y = _exact(x, w)
    g, up = y[:, :n].to(torch.float16).float(), y[:, n:].to(torch.float16).float()
    gated = ((g * torch.sigmoid(g)).to(torch.float16).float() * up).to(torch.float16)
    for config in list(TG._gemv_kernel.configs):
        monkeypatch.setattr(TG._gemv_kernel, "configs", [config])
        assert torch.equal(TG.gemv_triton(x, w[:n]), plain), config
        assert torch.equal(TG.gemv_triton(x, w[:n], bias=bias[:n]), biased), config
        got = TG.gemv_triton(x, w, gated=True)
        assert (got != gated).sum().item() <= 1, (config, (got != gated).sum().item())


def test_chunk_attention_reads_no_key_past_the_last_rows_position():
    """Positions past each piece's last row hold NaN (not yet written: a later step's K/V): the kernel must not load
    them, as 0 * NaN in P @ V is NaN. Kills `mask_n = offs_n <= end` in triton_chunk_attention._tile (key `end` is
    causally masked out of the scores, but its V is loaded; the other tests' pools are finite there)."""
    gen = torch.Generator().manual_seed(51)
    k_pool, v_pool = (torch.randn(4, 2, 160, 16, generator=gen) for _ in range(2))
    pieces = torch.tensor([[0, 5, 1, 60], [5, 70, 2, 0], [75, 1, 3, 17]], dtype=torch.int32)
    for _, rows, slot, start in pieces.tolist():
        k_pool[slot, :, start + rows:] = float("nan")
        v_pool[slot, :, start + rows:] = float("nan")
    q = torch.randn(76, 4, 16, generator=gen)
    out = K.chunk_attention(q, k_pool, v_pool, pieces, 0.25, use_triton=True)
    ref = K.chunk_attention(q, k_pool, v_pool, pieces, 0.25, use_triton=False)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) <= 1e-5


def test_mixed_attention_with_two_head_blocks():
    """G = 20 query heads a kv head: two head blocks of 16 a decode row (the other mixed tests have G <= 4, one block).
    Kills `grid = (chunk_programs + d * kv_heads,)` in mixed_attention_triton (the second head block's programs
    never launched)."""
    gen = torch.Generator().manual_seed(52)
    k_pool, v_pool = (torch.randn(3, 2, 64, 16, generator=gen) for _ in range(2))
    q = torch.randn(5, 40, 16, generator=gen)
    slots, lengths = torch.tensor([2, 0]), torch.tensor([50, 7])
    pieces = torch.tensor([[0, 3, 1, 10]], dtype=torch.int32)
    got = K.mixed_attention(q, k_pool, v_pool, 2, slots, lengths, pieces, 0.25, use_triton=True)
    ref = K.mixed_attention(q, k_pool, v_pool, 2, slots, lengths, pieces, 0.25, use_triton=False)
    assert _rel_err(got, ref) <= 1e-5
