"""Triton kernels vs the torch references under the Triton interpreter, on small CPU tensors.

Why: CI and the developer machines have no GPU; the interpreter runs the same kernel code
(indexing, masks, split-K merge, early exits) on CPU. Run with
`TRITON_INTERPRET=1 python -m pytest tests/test_kernels_interp.py`; skipped otherwise (the
variable must be set before triton is imported; `make test` runs it so) or when triton is missing.
Interpreter caveats (Triton 3.6-3.7): fp32 -> bf16 conversion truncates instead of rounding to
nearest, and tl.dot on bf16 is wrong (the attention kernel upcasts its dots for CPU tensors),
so bf16 checks here use >= 1-ulp tolerances; fp32/fp16 checks are tight. Triton 3.9.0's
interpreter refuses the RoPE kernel's mask (a block mask & a scalar: "mask has unsupported
dtype"); `make test` installs 3.7.0 beside a CPU torch.
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
from kvtransfer.kernels.triton_attention import choose_num_splits

# max |err| / max |gold| allowed per dtype (bf16 doubled for the interpreter's truncation)
ATT_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _att(case, **kw):
    return K.decode_attention(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale, **kw)


def _rel_err(out, gold):
    return ((out.float() - gold).abs().max() / gold.abs().max()).item()


def _pools(case, page):
    """case's pools as they are (page 0: the slot layout, no table), or paged copies of `page` positions a block."""
    if not page:
        return case.k_pool, case.v_pool, None
    (kp, table), (vp, _) = paged_copy(case.k_pool, page), paged_copy(case.v_pool, page)
    return kp, vp, table


@pytest.mark.parametrize(
    "heads",
    [(4, 2, 16), (9, 3, 64), (28, 4, 32), (4, 4, 16), (40, 2, 16), (6, 2, 80)],
    ids=["tiny-G2", "smollm2-G3", "qwen-G7", "mha-G1", "G20-two-head-blocks", "D80-not-pow2"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference(heads, dtype):
    hq, hkv, d = heads
    case = decode_case([150, 1, 64, 65, 200], hq, hkv, d, max_seq=200, dtype=dtype, seed=2, pad_rows=2, q_scale=2.0)
    gold = attention_gold(case)
    ref = _att(case, use_triton=False)
    out = _att(case, use_triton=True)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    real = slice(0, 5)  # padded rows: any finite output
    assert _rel_err(out[real], gold[real]) <= ATT_TOL[dtype]
    assert _rel_err(ref[real], gold[real]) <= ATT_TOL[dtype] * 2


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 256])
def test_decode_attention_any_split_count(num_splits):
    case = decode_case([130, 1, 64, 129], 4, 2, 16, max_seq=130, dtype=torch.float32, seed=3)
    out = _att(case, use_triton=True, num_splits=num_splits)
    assert _rel_err(out, attention_gold(case)) <= 1e-5


def test_decode_attention_fp16_int32_indices_and_strided_q():
    case = decode_case([33, 90, 2], 9, 3, 64, max_seq=96, dtype=torch.float16, seed=4, index_dtype=torch.int32)
    qkv = torch.randn(3, 9 + 6, 64).to(torch.float16)  # q as a view of a fused projection
    qkv[:, :9] = case.q
    case.q = qkv[:, :9]
    assert not case.q.is_contiguous()
    out = _att(case, use_triton=True)
    assert _rel_err(out, attention_gold(case)) <= ATT_TOL[torch.float16]


def test_decode_attention_edge_lengths():
    # Length 0 -> zeros (reference: empty softmax -> zeros); length > max_seq -> clamped.
    case = decode_case([10, 10], 4, 2, 16, max_seq=16, dtype=torch.float32, garbage=None)
    case.lengths = torch.tensor([0, 99])
    out = _att(case, use_triton=True)
    ref = _att(case, use_triton=False)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_choose_num_splits_examples():
    # The documented examples (132 SMs, an H100 or H200; Qwen2.5-7B: 4 kv heads, 1 head block), ~2 programs an SM.
    assert choose_num_splits(1, 4, 1, 32768, 132) == 66
    assert choose_num_splits(8, 4, 1, 32768, 132) == 9
    assert choose_num_splits(32, 4, 1, 8192, 132) == 3
    assert choose_num_splits(64, 4, 1, 1024, 132) == 2
    assert choose_num_splits(66, 4, 1, 1024, 132) == 1
    assert choose_num_splits(1, 4, 1, 64, 132) == 1  # short pool: chunks >= BLOCK_N
    assert choose_num_splits(512, 8, 2, 4096, 132) == 1


def _rope_case(dtype, batch=4, hq=9, hkv=3, d=64, num_slots=6, max_seq=24, seed=5):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    ang = torch.randn(batch, d // 2, generator=gen) * 3
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos() * 1.1, emb.sin() * 1.1  # attention scaling folded in
    pools = [torch.randn(num_slots, hkv, max_seq, d, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.tensor([3, 0, 5, 5][:batch])
    positions = torch.tensor([23, 0, 7, 0][:batch], dtype=torch.int32)
    return q, k, v, cos, sin, pools, slots, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_store_matches_reference(dtype):
    q, k, v, cos, sin, pools, slots, positions = _rope_case(dtype)
    ref_pools = [p.clone() for p in pools]
    tri_pools = [p.clone() for p in pools]
    q_ref = K.rope_store(q, k, v, cos, sin, *ref_pools, slots, positions, use_triton=False)
    q_tri = K.rope_store(q, k, v, cos, sin, *tri_pools, slots, positions, use_triton=True)
    # ~1 ulp of the terms (|x| < ~5): HF rounds each product and the sum, the kernel once.
    tol = {torch.float32: 1e-6, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype]
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-2, atol=tol)
    torch.testing.assert_close(tri_pools[0], ref_pools[0], rtol=1e-2, atol=tol)
    assert torch.equal(tri_pools[1], ref_pools[1])  # v is copied, not computed
    changed = (tri_pools[0] != pools[0]).any(dim=(1, 3))  # (S, T): only the written positions
    expect = torch.zeros_like(changed)
    expect[slots.long(), positions.long()] = True
    assert torch.equal(changed, expect)


def test_rope_store_skips_out_of_range_positions():
    q, k, v, cos, sin, pools, slots, positions = _rope_case(torch.float32)
    before = [p.clone() for p in pools]
    positions = torch.tensor([24, -1, 7, 0], dtype=torch.int32)  # rows 0, 1 out of range
    K.rope_store(q, k, v, cos, sin, *pools, slots, positions, use_triton=True)
    for p, b in zip(pools, before):
        assert torch.equal(p[3], b[3]) and torch.equal(p[0], b[0])
        assert not torch.equal(p[5], b[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100, 3584])
def test_norms_and_silu_match_reference(dtype, hidden):
    gen = torch.Generator().manual_seed(6)
    x, res = (torch.randn(3, hidden, generator=gen).to(dtype) for _ in range(2))
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6, use_triton=True), K.rms_norm(x, w, 1e-6), rtol=tol, atol=tol)
    n_tri, r_tri = K.add_rms_norm(x, res, w, 1e-6, use_triton=True)
    n_ref, r_ref = K.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(n_tri, n_ref, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # interpreter truncates to bf16
        torch.testing.assert_close(r_tri, r_ref, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(r_tri, r_ref)
    gate_up = torch.randn(3, 2 * hidden, generator=gen).to(dtype)
    torch.testing.assert_close(K.silu_mul(gate_up, use_triton=True), K.silu_mul(gate_up), rtol=tol, atol=tol)


def test_rms_norm_fp32_weight_promotes_like_hf():
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.rand(64) + 0.5
    out = K.rms_norm(x, w, 1e-5, use_triton=True)
    ref = K.rms_norm(x, w, 1e-5)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3)  # h is rounded (truncated) to bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 80)], ids=["G2", "D80-not-pow2"])
def test_chunk_attention_matches_reference(dtype, heads):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(11)
    k_pool = torch.randn(4, hkv, 160, d, generator=g).to(dtype)
    v_pool = torch.randn(4, hkv, 160, d, generator=g).to(dtype)
    q = (torch.randn(96, hq, d, generator=g) * 2).to(dtype)
    # a chunk after a long past, one from 0 longer than a 64-row block, a one-row chunk, an unused piece
    pieces = torch.tensor([[0, 5, 1, 130], [5, 73, 0, 0], [80, 1, 3, 17], [0, 0, 0, 0]], dtype=torch.int32)
    ref = K.chunk_attention(q, k_pool, v_pool, pieces, d ** -0.5, use_triton=False)
    out = K.chunk_attention(q, k_pool, v_pool, pieces, d ** -0.5, use_triton=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert _rel_err(out, ref.float()) <= ATT_TOL[dtype]
    assert (out[78:80] == 0).all() and (out[81:] == 0).all()  # rows in no chunk


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_attention_into_a_shared_output(use_triton):
    """A mixed step's attention output is one tensor: the decode rows' kernel writes rows :d and the chunk kernel
    the rest in place (runner.py), its padding rows zeroed by a piece of slot -1 (mixed.piece_table). Each writes
    what it returns alone, on its own rows only: the 7.0 fill survives outside them."""
    hq, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(13)
    k_pool, v_pool = (torch.randn(4, hkv, 160, d, generator=g) for _ in range(2))
    q = torch.randn(100, hq, d, generator=g)
    case = decode_case([40, 1, 150, 9], hq, hkv, d, max_seq=160, dtype=torch.float32, seed=4)
    pieces = torch.tensor([[0, 5, 1, 130], [5, 73, 0, 0], [80, 1, 3, 17], [0, 0, 0, 0], [81, 15, -1, 0]],
                          dtype=torch.int32)  # rows 78..79: no piece; 81..95: padding; 96..99: the caller's
    alone = K.chunk_attention(q[:96], k_pool, v_pool, pieces[:4], d ** -0.5, use_triton=use_triton)
    out = torch.full((104, hq, d), 7.0)
    K.chunk_attention(q[:96], k_pool, v_pool, pieces, d ** -0.5, use_triton=use_triton, out=out[4:100])
    covered = list(range(0, 78)) + [80]
    assert torch.equal(out[4:100][covered], alone[covered])
    assert (out[4:100][81:96] == 0).all() and (out[4:100][78:80] == 7.0).all()
    assert (out[:4] == 7.0).all() and (out[100:] == 7.0).all()
    dec = torch.full((6, hq, d), 7.0)
    K.decode_attention(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale, use_triton=use_triton,
                       out=dec[1:5])
    assert torch.equal(dec[1:5], _att(case, use_triton=use_triton))
    assert (dec[0] == 7.0).all() and (dec[5] == 7.0).all()
    with pytest.raises(ValueError, match="out must be"):
        K.chunk_attention(q, k_pool, v_pool, pieces, d ** -0.5, use_triton=use_triton, out=out[:10])


def _p_rounding_case():
    """Two keys whose probabilities differ by less than fp16 resolves, over values +1000 and -1000.

    One head, D 16, scale 1/4: scores 0 and -1e-4, so exp(-1e-4) = 0.9999 rounds to 1.0 in fp16. With P rounded
    to the KV dtype before @ V (what the kernels and HF do) the two values cancel exactly: output 0. Left in fp32,
    P leaves 1000 x 1e-4 / 2 = 0.05 in the output's first channel, far above fp16's error at 0.
    """
    d = 16
    k_pool = torch.zeros(1, 1, 4, d, dtype=torch.float16)
    v_pool = torch.zeros(1, 1, 4, d, dtype=torch.float16)
    k_pool[0, 0, 1, 0] = -4e-4  # score -1e-4 (q = e0, scale 1/4)
    v_pool[0, 0, 0, 0], v_pool[0, 0, 1, 0] = 1000.0, -1000.0
    q = torch.zeros(1, 1, d, dtype=torch.float16)
    q[0, 0, 0] = 1.0
    return q, k_pool, v_pool, d ** -0.5


def test_attention_kernels_round_p_to_the_kv_dtype():
    """Pins the rounding of P that bit-matching HF depends on (tolerance tests cannot see it)."""
    q, k_pool, v_pool, scale = _p_rounding_case()
    lengths, slots = torch.tensor([2]), torch.tensor([0])
    ref = K.decode_attention(q, k_pool, v_pool, slots, lengths, scale, use_triton=False)
    out = K.decode_attention(q, k_pool, v_pool, slots, lengths, scale, use_triton=True)
    assert ref[0, 0, 0].item() == 0.0  # the reference rounds the softmax to fp16: the values cancel
    assert abs(out[0, 0, 0].item()) < 1e-3, out[0, 0, 0].item()
    pieces = torch.tensor([[0, 1, 0, 1]], dtype=torch.int32)  # one prompt row at position 1: keys 0 and 1
    chunk = K.chunk_attention(q, k_pool, v_pool, pieces, scale, use_triton=True)
    assert abs(chunk[0, 0, 0].item()) < 1e-3, chunk[0, 0, 0].item()


# The paged pool (kernels/triton_paging.py): the same K/V scattered over shuffled blocks through a block table
# must give the bits the slot layout gives. The tiles, splits and reduction order are the same; only where each
# position is read from changes. Pages below BLOCK_N (a tile spans blocks: a table load per position) and at or
# above it (a tile in one block: one load per tile), and table columns past the rows' lengths naming a NaN block.
PAGES = [16, 32, 64, 128]


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_paged_equals_slots(page, dtype):
    case = decode_case([150, 1, 64, 65, 256, 17], 9, 3, 64, max_seq=256, dtype=dtype, seed=21, pad_rows=2)
    kp, table = paged_copy(case.k_pool, page, seed=page, width=256 // page + 2)
    vp, _ = paged_copy(case.v_pool, page, seed=page, width=256 // page + 2)
    for use_triton in (False, True):
        want = _att(case, use_triton=use_triton, num_splits=3 if use_triton else None)
        got = K.decode_attention(case.q, kp, vp, case.slots, case.lengths, case.scale, use_triton=use_triton,
                                 block_table=table, **({"num_splits": 3} if use_triton else {}))
        assert torch.equal(got, want), (use_triton, page)


@pytest.mark.parametrize("block_n", [16, 32, 128])
def test_decode_attention_other_tile_widths(block_n):
    # The probe's sweep (bench/probes/chunk_attention.py --decode-sweep) times other stage-1 tile widths: each must
    # still give the attention, paged (tiles across 64-position pages, and 128-wide tiles over two) or not.
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    case = decode_case([150, 1, 64, 65, 256, 17], 9, 3, 64, max_seq=256, dtype=torch.float32, seed=22, pad_rows=2)
    gold = attention_gold(case)
    kp, table = paged_copy(case.k_pool, 64, seed=5, width=6)
    vp, _ = paged_copy(case.v_pool, 64, seed=5, width=6)
    for splits in (None, 3):
        out = decode_attention_triton(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale,
                                      num_splits=splits, block_n=block_n)
        assert _rel_err(out[:6], gold[:6]) <= 1e-5, (block_n, splits)
        paged = decode_attention_triton(case.q, kp, vp, case.slots, case.lengths, case.scale, num_splits=splits,
                                        block_table=table, block_n=block_n)
        assert torch.equal(paged, out), (block_n, splits)
    for bad in (8, 48):
        with pytest.raises(ValueError, match="block_n"):
            decode_attention_triton(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale,
                                    block_n=bad)


def test_decode_attention_merge_launches_give_the_same_bits():
    # The probe's --pair-sweep times stage 2 at other launches (warps, query heads a program, taken in turn). Heads
    # taken in turn are the same tile each, so they give the default's bits, the heads past Hq (7 a program over 9)
    # left alone; the H100 run agreed (bench/results/splits-h100-2026-12-06). Other warp counts lay the tile out
    # otherwise: on that GPU they changed the last bits (the interpreter has no warps), so they are held to the
    # attention itself.
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    case = decode_case([150, 1, 64, 65, 256, 17], 9, 3, 64, max_seq=256, dtype=torch.float32, seed=23, pad_rows=2)
    gold = attention_gold(case)
    for splits in (None, 3):
        want = decode_attention_triton(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale,
                                       num_splits=splits)
        assert _rel_err(want[:6], gold[:6]) <= 1e-5
        for stage2 in ((4, 7), (4, 9), (4, 4), (1, 1), (2, 7)):
            got = decode_attention_triton(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale,
                                          num_splits=splits, stage2=stage2)
            if stage2[0] == 4:
                assert torch.equal(got, want), (splits, stage2)
            assert _rel_err(got[:6], gold[:6]) <= 1e-5, (splits, stage2)


@pytest.mark.parametrize("page", [0, 16], ids=["slots", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_split_writes_the_output_without_a_merge(dtype, page, monkeypatch):
    # At one split by count stage 1 writes the rows' output itself: the bits of stage 1 + the merge of that split
    # (a merge sweep's launch forces the merge), a row of length 0 zeros as the merge writes, and no merge launch.
    from kvtransfer.kernels import triton_attention as TA

    case = decode_case([150, 0, 64, 65, 200], 9, 3, 64, max_seq=256, dtype=dtype, seed=29, pad_rows=2)
    kp, vp, table = _pools(case, page)
    args = (case.q, kp, vp, case.slots, case.lengths, case.scale)
    merged = TA.decode_attention_triton(*args, num_splits=1, max_chunk=0, block_table=table,
                                        stage2=(4, 1))  # the merge's own
    out = torch.full_like(case.q, float("nan"))
    monkeypatch.setattr(TA, "merge_splits", lambda *a, **k: pytest.fail("one split launched a merge"))
    got = TA.decode_attention_triton(*args, num_splits=1, max_chunk=0, block_table=table, out=out)
    assert got is out
    assert torch.equal(got, merged)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    gold = attention_gold(case)
    assert _rel_err(got[:5], gold[:5]) <= ATT_TOL[dtype]


@pytest.mark.parametrize("page", [0, 16], ids=["slots", "paged"])
def test_a_long_row_is_cut_at_max_chunk(page, monkeypatch):
    # One long row among short ones (the straggler a split count from the batch alone leaves: its few programs read
    # the whole row while the rest wait): with max_chunk, the grid holds cdiv(max_seq, max_chunk) splits, the long
    # row takes chunks of max_chunk, the short ones keep ceil(L / count) and their bits. Seen through the partials
    # the merge receives: each of the long row's splits holds the log-sum-exp of its own max_chunk positions.
    from kvtransfer.kernels import triton_attention as TA

    case = decode_case([40, 500, 60, 0], 4, 2, 16, max_seq=512, dtype=torch.float32, seed=31)
    kp, vp, table = _pools(case, page)
    args = (case.q, kp, vp, case.slots, case.lengths, case.scale)
    seen, merge = {}, TA.merge_splits

    def record(mid_o, mid_lse, *a, **k):
        seen.update(mid_lse=mid_lse.clone(), divisor=k["divisor"], max_chunk=k["max_chunk"])
        return merge(mid_o, mid_lse, *a, **k)

    monkeypatch.setattr(TA, "merge_splits", record)
    got = TA.decode_attention_triton(*args, num_splits=2, max_chunk=64, block_table=table)
    assert _rel_err(got, attention_gold(case)) <= 1e-5
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    assert seen["mid_lse"].shape == (4, 4, 8) and (seen["divisor"], seen["max_chunk"]) == (2, 64)
    q = case.q[1].view(2, 2, 16)  # (Hkv, G, D): row 1, 500 positions in 8 splits of 64
    k = case.k_pool[case.slots[1], :, :500]  # (Hkv, 500, D)
    s = torch.einsum("hgd,htd->hgt", q, k).reshape(4, 500) * case.scale
    want = torch.stack([torch.logsumexp(s[:, j * 64:(j + 1) * 64], -1) for j in range(8)], -1) / 0.6931471805599453
    assert torch.allclose(seen["mid_lse"][1], want, atol=1e-4)
    uncapped = TA.decode_attention_triton(*args, num_splits=2, max_chunk=0, block_table=table)
    assert torch.equal(got[[0, 2, 3]], uncapped[[0, 2, 3]])  # the short rows' edges: 64 positions, one split
    with pytest.raises(ValueError, match="multiple of 64"):
        TA.decode_attention_triton(*args, max_chunk=100, block_table=table)


@pytest.mark.parametrize("page", [0, 16], ids=["slots", "paged"])
def test_short_rows_keep_the_counts_chunks_under_a_cap_above_the_tile(page, monkeypatch):
    # A cap of two tiles, 2 splits by count: a row of 200 is cut at 128 (ceil(200 / 2) rounded to the tile, at the
    # cap), one of 120 at 64 (its own ceil(L / 2): the cap does not bind), one of 500 at the cap (4 splits); the merge
    # cuts them at the same edges (it reads only the splits stage 1 wrote). Seen through the partials' log-sum-exp.
    from kvtransfer.kernels import triton_attention as TA

    case = decode_case([200, 120, 500], 4, 2, 16, max_seq=512, dtype=torch.float32, seed=33)
    kp, vp, table = _pools(case, page)
    seen, merge = {}, TA.merge_splits

    def record(mid_o, mid_lse, *a, **k):
        seen["mid_lse"] = mid_lse.clone()
        return merge(mid_o, mid_lse, *a, **k)

    monkeypatch.setattr(TA, "merge_splits", record)
    got = TA.decode_attention_triton(case.q, kp, vp, case.slots, case.lengths, case.scale, num_splits=2,
                                     max_chunk=128, block_table=table)
    assert _rel_err(got, attention_gold(case)) <= 1e-5
    assert seen["mid_lse"].shape == (3, 4, 4)
    for row, (n, chunk) in enumerate([(200, 128), (120, 64), (500, 128)]):
        q = case.q[row].view(2, 2, 16)
        s = torch.einsum("hgd,htd->hgt", q, case.k_pool[case.slots[row], :, :n]).reshape(4, n) * case.scale
        want = torch.stack([torch.logsumexp(s[:, j:j + chunk], -1) for j in range(0, n, chunk)], -1)
        want = want / 0.6931471805599453  # log2 units, as the kernel keeps them
        assert torch.allclose(seen["mid_lse"][row, :, :want.shape[1]], want, atol=1e-4), row


def test_the_cap_grows_to_keep_the_grid_at_max_splits(monkeypatch):
    # A pool longer than MAX_SPLITS x max_chunk: the cap rises to cdiv(max_seq, MAX_SPLITS) (rounded to the tile),
    # so no row needs more splits than the merge folds, and every position is still read.
    from kvtransfer.kernels import triton_attention as TA

    case = decode_case([1100, 3], 2, 1, 16, max_seq=1152, dtype=torch.float32, seed=32)
    seen, merge = {}, TA.merge_splits

    def record(mid_o, *a, **k):
        seen.update(splits=mid_o.shape[2], max_chunk=k["max_chunk"])
        return merge(mid_o, *a, **k)

    monkeypatch.setattr(TA, "merge_splits", record)
    monkeypatch.setattr(TA, "MAX_SPLITS", 4)
    got = TA.decode_attention_triton(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale,
                                     num_splits=1, max_chunk=64)
    assert _rel_err(got, attention_gold(case)) <= 1e-5
    assert seen == {"splits": 4, "max_chunk": 320}  # cdiv(1152, 4) = 288, rounded up to 64


@pytest.mark.parametrize("page", PAGES)
def test_chunk_attention_paged_equals_slots(page):
    g = torch.Generator().manual_seed(12)
    k_pool, v_pool = (torch.randn(4, 2, 256, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(96, 4, 16, generator=g) * 2).to(torch.bfloat16)
    pieces = torch.tensor([[0, 5, 1, 130], [5, 73, 0, 0], [80, 1, 3, 17], [0, 0, 0, 0]], dtype=torch.int32)
    kp, table = paged_copy(k_pool, page, seed=page)
    vp, _ = paged_copy(v_pool, page, seed=page)
    for use_triton in (False, True):
        want = K.chunk_attention(q, k_pool, v_pool, pieces, 0.25, use_triton=use_triton)
        got = K.chunk_attention(q, kp, vp, pieces, 0.25, use_triton=use_triton, block_table=table)
        assert torch.equal(got, want), (use_triton, page)


@pytest.mark.parametrize("page", [16, 64])
def test_rope_store_paged_writes_the_slot_layouts_positions(page):
    q, k, v, cos, sin, pools, slots, positions = _rope_case(torch.bfloat16, max_seq=128)
    paged = [paged_copy(p, page, seed=page) for p in pools]
    table = paged[0][1]
    for use_triton in (False, True):
        want_pools = [p.clone() for p in pools]
        got_pools = [p.clone() for p, _ in paged]
        want_q = K.rope_store(q, k, v, cos, sin, *want_pools, slots, positions, use_triton=use_triton)
        got_q = K.rope_store(q, k, v, cos, sin, *got_pools, slots, positions, use_triton=use_triton,
                             block_table=table)
        assert torch.equal(got_q, want_q)
        for want, got in zip(want_pools, got_pools):  # every block, written or not, as the slot layout has it
            assert torch.equal(paged_copy(want, page, seed=page)[0].nan_to_num(7.0), got.nan_to_num(7.0)), use_triton


def test_rope_store_paged_skips_positions_past_the_table():
    q, k, v, cos, sin, pools, slots, positions = _rope_case(torch.float32, max_seq=64)
    paged = [paged_copy(p, 16, seed=1, spare=0) for p in pools]
    table = paged[0][1]
    positions = torch.tensor([64, 0, 1000, -1], dtype=torch.int32)  # row 1 alone is inside its row's 4 blocks
    got = [p.clone() for p, _ in paged]
    K.rope_store(q, k, v, cos, sin, *got, slots, positions, use_triton=True, block_table=table)
    for before, after in zip(paged, got):
        changed = (before[0] != after).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [int(table[slots[1], 0])], changed


def _mixed_case(dtype, page=0):
    """A mixed step's attention inputs: 5 decode rows (+2 padding rows on the scratch slot) over a pool of 6 slots,
    then 96 prompt rows in pieces over the same pool: a chunk after a long past, one from 0 longer than a 64-row
    block, a one-row chunk, an unused piece, padding rows (slot -1); prompt rows 78..79 are in no piece."""
    hq, hkv, d = 8, 2, 16
    case = decode_case([150, 1, 64, 65, 200], hq, hkv, d, max_seq=256, dtype=dtype, seed=5, pad_rows=2,
                       garbage=None, q_scale=2.0)
    g = torch.Generator().manual_seed(17)
    q = torch.cat([case.q, (torch.randn(96, hq, d, generator=g) * 2).to(dtype)])  # (103, Hq, D)
    pieces = torch.tensor([[0, 5, 1, 130], [5, 73, 0, 0], [80, 1, 3, 17], [0, 0, 0, 0], [81, 15, -1, 0]],
                          dtype=torch.int32)
    k_pool, v_pool, table = case.k_pool, case.v_pool, None
    if page:
        k_pool, table = paged_copy(case.k_pool, page, seed=page)
        v_pool, _ = paged_copy(case.v_pool, page, seed=page)
    return q, k_pool, v_pool, table, case, pieces


@pytest.mark.parametrize("page", [0, 16], ids=["slots", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_attention_is_both_kernels_in_one_launch(dtype, page):
    """The fused mixed-step kernel (triton_mixed_attention.py): its decode rows are the decode kernel's at one split
    and its prompt rows the chunk kernel's, bit for bit; the reference path is the two references; rows in no piece
    keep what `out` held."""
    q, kp, vp, table, case, pieces = _mixed_case(dtype, page)
    d, scale = case.q.shape[0], case.scale
    out = torch.full_like(q, 7.0)
    got = K.mixed_attention(q, kp, vp, d, case.slots, case.lengths, pieces, scale, use_triton=True,
                            block_table=table, out=out)
    assert got is out
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    one_split = decode_attention_triton(q[:d], kp, vp, case.slots, case.lengths, scale, num_splits=1, max_chunk=0,
                                        block_table=table)
    assert torch.equal(got[:d], one_split)
    chunk = torch.full_like(q[d:], 7.0)
    K.chunk_attention(q[d:], kp, vp, pieces, scale, use_triton=True, block_table=table, out=chunk)
    assert torch.equal(got[d:], chunk)
    assert (got[d + 78:d + 80] == 7.0).all() and (got[d + 81:] == 0).all()
    ref = K.mixed_attention(q, kp, vp, d, case.slots, case.lengths, pieces, scale, use_triton=False, block_table=table)
    covered = list(range(d + 78)) + [d + 80]
    assert _rel_err(got[covered], ref[covered].float()) <= ATT_TOL[dtype]
    assert torch.equal(ref[:d], K.decode_attention(q[:d], kp, vp, case.slots, case.lengths, scale, use_triton=False,
                                                   block_table=table))
    assert (ref[d + 78:d + 80] == 0).all()  # a new output: zero outside the pieces


def test_mixed_attention_grid_order_moves_no_bit():
    """The sweep's DECODE_FIRST (the decode programs take the grid's first ids): every program does the same work,
    so the output is the default order's bit for bit, both kinds of rows written."""
    from kvtransfer.kernels.triton_mixed_attention import mixed_attention_triton

    q, kp, vp, table, case, pieces = _mixed_case(torch.bfloat16, 16)
    d = case.q.shape[0]
    args = (q, kp, vp, d, case.slots, case.lengths, pieces, case.scale, table)
    want = mixed_attention_triton(*args, out=torch.full_like(q, 7.0))
    got = mixed_attention_triton(*args, out=torch.full_like(q, 7.0), decode_first=True)
    assert torch.equal(got, want)
    assert not (want[:d] == 7.0).any() and not (want[d:d + 78] == 7.0).any()


def test_mixed_attention_with_no_rows_of_one_kind():
    """All decode rows (no prompt rows) or all prompt rows (no decode rows): the same as the one kernel alone."""
    q, kp, vp, _, case, pieces = _mixed_case(torch.float32)
    d, scale = case.q.shape[0], case.scale
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    only_decode = K.mixed_attention(q[:d], kp, vp, d, case.slots, case.lengths, pieces[:0], scale, use_triton=True)
    assert torch.equal(only_decode, decode_attention_triton(q[:d], kp, vp, case.slots, case.lengths, scale,
                                                            num_splits=1, max_chunk=0))
    none = case.slots[:0]
    only_prompt = K.mixed_attention(q[d:], kp, vp, 0, none, none, pieces, scale, use_triton=True)
    assert torch.equal(only_prompt, K.chunk_attention(q[d:], kp, vp, pieces, scale, use_triton=True))


def test_mixed_attention_fuses_where_one_split_fills_the_sms():
    from kvtransfer.kernels.triton_mixed_attention import fuses

    assert fuses(64, 4, 1, 132) and fuses(33, 4, 1, 132)  # Qwen2.5-7B on an H100: 256 and 132 programs
    assert not fuses(32, 4, 1, 132) and not fuses(0, 4, 1, 132)
    assert fuses(2, 2, 2, 8) and not fuses(1, 2, 2, 8)
    assert K.mixed_attention_fuses(4, 8, 2, torch.device("cpu"), use_triton=True)  # 8 SMs assumed off CUDA
    assert not K.mixed_attention_fuses(4, 8, 2, torch.device("cpu"), use_triton=False)
    assert not K.mixed_attention_fuses(3, 8, 2, torch.device("cpu"), use_triton=True)


def test_mixed_attention_fuses_only_where_no_row_outgrows_the_split_cap(monkeypatch):
    # The fused launch reads a decode row with one program a kv head: in a pool whose rows can be longer than the
    # decode kernel's per-split cap, a long row would hold the step, so the two kernels take it (the decode kernel
    # cuts long rows); with the cap off, as before.
    from kvtransfer.kernels import triton_attention as TA

    cpu = torch.device("cpu")
    assert K.mixed_attention_fuses(4, 8, 2, cpu, use_triton=True, max_seq=TA.LONG_CHUNK)
    assert not K.mixed_attention_fuses(4, 8, 2, cpu, use_triton=True, max_seq=TA.LONG_CHUNK + 1)
    monkeypatch.setattr(TA, "LONG_CHUNK", 0)
    assert K.mixed_attention_fuses(4, 8, 2, cpu, use_triton=True, max_seq=32768)


@pytest.mark.parametrize("mode,max_seq", [("fused", 128), ("two", 128), ("fused", 2048)],
                         ids=["fused", "two", "fused-long-rows"])
def test_a_mixed_step_takes_the_fused_launch_where_it_fuses(mode, max_seq, monkeypatch):
    """The runner's mixed step under the interpreter (tiny: 2 kv heads, 8 SMs assumed): with 4 decode rows it fuses
    (4 x 2 programs) by default and runs the two kernels under MIXED_ATTENTION "two", or in a pool of rows longer
    than the decode kernel's per-split cap (LONG_CHUNK, 1,024); either way its decode rows match the plain step and
    its prompt's last row the whole prefill, within the mixed step's fp32 tolerance."""
    from kvtransfer.engine import runner as runner_module
    from kvtransfer.engine.mixed import Chunk, mixed_forward
    from kvtransfer.engine.pool import KVPool
    from kvtransfer.geometry import CacheGeometry
    from kvtransfer.kernels import triton_mixed_attention as tm
    from kvtransfer.model.prefill import prefill, random_prompt
    from kvtransfer.model.spec import ModelSpec, load_model
    from kvtransfer.model.streaming import cache_layers

    tiny = load_model(ModelSpec("tiny", "float32", 0))
    pool = KVPool(CacheGeometry.from_config(tiny.config, torch.float32), torch.device("cpu"), slots=6,
                  max_seq=max_seq)
    r = runner_module.StepRunner(tiny, pool, use_triton=True, gemv="off")
    decoding = [random_prompt(tiny.config.vocab_size, n, seed=n)[0] for n in (20, 33, 9, 40)]
    for slot, p in enumerate(decoding):
        cache, _ = prefill(tiny, p[None])
        for i, (k, v) in enumerate(cache_layers(cache)):
            pool.layer(i)[0][slot, :, :len(p)] = k[0]
            pool.layer(i)[1][slot, :, :len(p)] = v[0]
    tokens, positions, slots = torch.tensor([5, 9, 11, 13]), torch.tensor([20, 33, 9, 40]), torch.arange(4)
    plain = r.forward(tokens, positions, slots)
    calls = []
    launch = tm.mixed_attention_triton
    monkeypatch.setattr(tm, "mixed_attention_triton", lambda *a, **kw: calls.append(a[3]) or launch(*a, **kw))
    monkeypatch.setattr(runner_module, "MIXED_ATTENTION", mode)
    prompt = random_prompt(tiny.config.vocab_size, 30, seed=7)[0]
    _, whole_logits = prefill(tiny, prompt[None])
    dec, lasts = mixed_forward(r, tokens, positions, slots, [Chunk(prompt, 4, 0, True)])
    assert (dec - plain).abs().max().item() <= 1e-4
    assert (lasts[0] - whole_logits).abs().max().item() <= 1e-4
    assert calls == ([4] * 4 if (mode, max_seq) == ("fused", 128) else [])  # 4 layers, 4 decode rows each
