"""GPU checks of the Triton kernels against the references (run on the device machine).

Why: the decode engine runs these kernels on the H200 inside CUDA graphs; this checks them in
bf16 on Qwen2.5-7B shapes (28 q / 4 kv heads, D=128) with ragged rows, on the small odd
shapes of the `tiny` (G=2, D=16) and `smollm2-135m` (G=3, D=64) presets, under graph
capture and replay with new indices, and with a > 2^31-element pool (int64 offsets).

Tolerances: attention is compared per row with an fp64 computation from the same rounded
inputs (`attention_gold`): max |err| <= 2e-2 * max |gold| of the row in bf16 (P and the
output are rounded to bf16, ~0.4% each; the bf16 HF reference itself is off by ~1%), 4e-3
in fp16, 1e-4 in fp32 (IEEE dots; this also catches a lost 64-position block of a 32k row,
which moves the output by ~0.2%). Norms and SiLU: within 2 bf16 ulps and bit-equal
in >= 99% of elements (`assert_bf16_close`); RoPE: rtol 1e-2, atol 4e-2 (see ROPE_TOL, the
kernel rounds once in fp32 where HF rounds each op); the residual add must be exact.
Run: python3 -m pytest tests/test_kernels_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

from bench.measure.kernel_inputs import DecodeCase, attention_gold, decode_case, ragged_lengths
from kvtransfer.kernels import ops as K

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not K.triton_available("cuda"), reason="needs triton"),
]

QWEN = (28, 4, 128)
ATT_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
# RoPE of randn inputs (|x| < ~5): HF rounds x*cos, rotate_half(x)*sin and the sum, the kernel
# once, so they may differ by ~1 ulp of the terms (2^-5 at 4..8 in bf16) even where the sum is small.
ROPE_TOL = {"rtol": 1e-2, "atol": 4e-2}


def row_rel_err(out: torch.Tensor, gold: torch.Tensor) -> float:
    """max over rows of max |out - gold| / max |gold| in that row; out, gold (B, Hq, D)."""
    err = (out.float() - gold).abs().amax(dim=(1, 2))
    return (err / gold.abs().amax(dim=(1, 2)).clamp_min(1e-6)).max().item()


def attention(case, **kw):
    return K.decode_attention(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,max_len", [(1, 32768), (8, 8192), (64, 1024)])
def test_decode_attention_qwen_shapes(batch, max_len, dtype):
    lengths = ragged_lengths(batch, max_len, seed=batch)
    lengths[0] = max_len
    case = decode_case(lengths, *QWEN, max_seq=max_len, dtype=dtype, device="cuda", seed=batch, pad_rows=2, q_scale=2.0)
    out = attention(case)  # default backend on CUDA: Triton
    assert out.shape == case.q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()  # NaN garbage past the lengths and in the scratch slot
    real = slice(0, batch)
    assert row_rel_err(out[real], attention_gold(case)[real]) <= ATT_TOL[dtype]
    if dtype == torch.bfloat16:  # sanity vs the bf16 HF-eager reference, itself a few % off
        ref = attention(case, use_triton=False)  # (bf16 scores); a wrong head or slot is O(1)
        assert row_rel_err(out[real], ref[real].float()) <= 1e-1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(4, 2, 16), (9, 3, 64)], ids=["tiny", "smollm2"])
def test_decode_attention_small_presets(heads, dtype):
    lengths = [1, 17, 300, 1000, 64, 65, 999]
    case = decode_case(lengths, *heads, max_seq=1000, dtype=dtype, device="cuda", seed=7, pad_rows=3, q_scale=2.0)
    real = slice(0, len(lengths))
    gold = attention_gold(case)[real]
    for splits in (None, 1, 256):
        out = attention(case, num_splits=splits)
        assert torch.isfinite(out).all()
        assert row_rel_err(out[real], gold) <= ATT_TOL[dtype], splits


@pytest.mark.parametrize("heads", [(4, 4, 64), (40, 2, 128)], ids=["mha-G1", "G20"])
def test_decode_attention_other_groupings(heads):
    case = decode_case([5, 700, 129], *heads, max_seq=800, dtype=torch.bfloat16, device="cuda", seed=8, pad_rows=1)
    out = attention(case)
    assert row_rel_err(out[:3], attention_gold(case)[:3]) <= ATT_TOL[torch.bfloat16]


def rope_inputs(batch, hq, hkv, d, dtype, num_slots, max_seq, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, h, d, generator=gen, device="cuda").to(dtype) for h in (hq, hkv, hkv))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    positions = torch.randint(0, max_seq, (batch,), generator=gen, device="cuda")
    emb = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((emb, emb), dim=-1)  # (B, D)
    slots = torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(seed))[:batch].to("cuda")
    return q, k, v, emb.cos(), emb.sin(), slots, positions.to(torch.int32)


@pytest.mark.parametrize("batch", [1, 64])
def test_rope_store_qwen(batch):
    hq, hkv, d = QWEN
    num_slots, max_seq = batch + 1, 1024
    q, k, v, cos, sin, slots, positions = rope_inputs(batch, hq, hkv, d, torch.bfloat16, num_slots, max_seq, batch)
    pools = [torch.randn(num_slots, hkv, max_seq, d, device="cuda").to(torch.bfloat16) for _ in range(2)]
    ref_pools = [p.clone() for p in pools]
    tri_pools = [p.clone() for p in pools]
    q_ref = K.rope_store(q, k, v, cos, sin, *ref_pools, slots, positions, use_triton=False)
    q_tri = K.rope_store(q, k, v, cos, sin, *tri_pools, slots, positions)
    torch.testing.assert_close(q_tri, q_ref, **ROPE_TOL)
    torch.testing.assert_close(tri_pools[0], ref_pools[0], **ROPE_TOL)
    assert torch.equal(tri_pools[1], ref_pools[1])
    changed = (tri_pools[0] != pools[0]).any(dim=(1, 3)) | (tri_pools[1] != pools[1]).any(dim=(1, 3))
    written = torch.zeros_like(changed)
    written[slots.long(), positions.long()] = True
    assert not (changed & ~written).any()  # nothing outside (slot, :, position) touched


def assert_bf16_close(out, ref):
    """Within 2 bf16 ulps everywhere, and bit-equal almost everywhere: both round the same fp32
    value once, which differs only by the last fp32 bits (reduction order, rsqrt/exp)."""
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=1e-3)
    assert (out != ref).float().mean().item() <= 1e-2


@pytest.mark.parametrize("batch", [1, 64])
def test_norms_and_silu_qwen_widths(batch):
    hidden, inter = 3584, 18944
    gen = torch.Generator(device="cuda").manual_seed(batch)
    x, res = (torch.randn(batch, hidden, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
    assert_bf16_close(K.rms_norm(x, w, 1e-6), K.rms_norm(x, w, 1e-6, use_triton=False))
    normed, res_out = K.add_rms_norm(x, res, w, 1e-6)
    normed_ref, res_ref = K.add_rms_norm(x, res, w, 1e-6, use_triton=False)
    assert torch.equal(res_out, res_ref)
    assert_bf16_close(normed, normed_ref)
    gate_up = torch.randn(batch, 2 * inter, generator=gen, device="cuda").to(torch.bfloat16)
    assert_bf16_close(K.silu_mul(gate_up), K.silu_mul(gate_up, use_triton=False))


def test_cuda_graph_replay_with_new_lengths_slots_positions():
    hq, hkv, d = QWEN
    batch, num_slots, max_seq = 8, 12, 2048
    gen = torch.Generator(device="cuda").manual_seed(11)
    k_pool, v_pool = (torch.randn(num_slots, hkv, max_seq, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    static = {
        "q": torch.empty(batch, hq, d, device="cuda", dtype=torch.bfloat16),
        "k": torch.empty(batch, hkv, d, device="cuda", dtype=torch.bfloat16),
        "v": torch.empty(batch, hkv, d, device="cuda", dtype=torch.bfloat16),
        "cos": torch.empty(batch, d, device="cuda"),
        "sin": torch.empty(batch, d, device="cuda"),
        "slots": torch.empty(batch, device="cuda", dtype=torch.int32),
        "positions": torch.empty(batch, device="cuda", dtype=torch.int32),
        "lengths": torch.empty(batch, device="cuda", dtype=torch.int32),
    }

    def fill(seed):
        q, k, v, cos, sin, slots, _ = rope_inputs(batch, hq, hkv, d, torch.bfloat16, num_slots, max_seq, seed)
        lengths = torch.randint(1, max_seq + 1, (batch,), generator=torch.Generator().manual_seed(seed))
        lengths[-1] = 1  # a padded row on the scratch slot
        slots[-1] = num_slots - 1
        new = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "slots": slots,
               "positions": lengths - 1, "lengths": lengths}
        for name, t in new.items():
            static[name].copy_(t)

    def step(kp, vp):
        s = static
        q_rot = K.rope_store(s["q"], s["k"], s["v"], s["cos"], s["sin"], kp, vp, s["slots"], s["positions"])
        return K.decode_attention(q_rot, kp, vp, s["slots"], s["lengths"], d**-0.5)

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(2):
            step(k_pool, v_pool)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = step(k_pool, v_pool)
    for seed in (1, 2, 3):
        fill(seed)
        k_eager, v_eager = k_pool.clone(), v_pool.clone()
        graph.replay()
        out_eager = step(k_eager, v_eager)
        torch.cuda.synchronize()
        assert torch.equal(out_static, out_eager)
        assert torch.equal(k_pool, k_eager) and torch.equal(v_pool, v_eager)


def test_pool_over_2_31_elements_uses_int64_offsets():
    # 600 slots x 4 x 8192 x 128 bf16 = 2.5e9 elements (5 GB) per pool; rows in the last slots.
    hq, hkv, d = QWEN
    num_slots, max_seq = 600, 8192
    assert num_slots * hkv * max_seq * d > 2**31
    k_pool = torch.empty(num_slots, hkv, max_seq, d, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.empty_like(k_pool)
    slots = torch.tensor([599, 598], device="cuda")
    lengths = torch.tensor([8192, 1000], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(12)
    for slot, length in ((599, 8192), (598, 1000)):
        k_pool[slot, :, :length] = torch.randn(hkv, length, d, generator=gen, device="cuda").to(torch.bfloat16)
        v_pool[slot, :, :length] = torch.randn(hkv, length, d, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v, cos, sin, _, _ = rope_inputs(2, hq, hkv, d, torch.bfloat16, num_slots, max_seq, 13)
    positions = (lengths - 1).to(torch.int32)
    k_ref, v_ref = k_pool[598:].clone(), v_pool[598:].clone()
    q_expect = K.rope_store(q, k, v, cos, sin, k_ref, v_ref, slots - 598, positions, use_triton=False)
    q_rot = K.rope_store(q, k, v, cos, sin, k_pool, v_pool, slots, positions)
    torch.testing.assert_close(q_rot, q_expect, **ROPE_TOL)
    torch.testing.assert_close(k_pool[599, :, 8191], k_ref[1, :, 8191], **ROPE_TOL)
    torch.testing.assert_close(k_pool[598, :, 999], k_ref[0, :, 999], **ROPE_TOL)
    assert torch.equal(v_pool[599, :, 8191], v[0]) and torch.equal(v_pool[598, :, 999], v[1])
    out = K.decode_attention(q_rot, k_pool, v_pool, slots, lengths, d**-0.5)
    view = DecodeCase(q_rot, k_pool[598:600], v_pool[598:600], slots - 598, lengths, scratch_slot=0)
    assert row_rel_err(out, attention_gold(view)) <= ATT_TOL[torch.bfloat16]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,bias", [(4608, 3584, True), (3584, 3584, False), (3584, 18944, False), (37, 100, True)])
def test_gemv_matches_fp64(rows, n, k, bias):
    """The Triton GEMV (batch <= GEMV_MAX_ROWS) against an fp64 product of the same bf16 inputs, odd shapes masked."""
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    got = K.linear(x, w, b)
    gold = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    err = ((got.double() - gold).abs().amax(1) / gold.abs().amax(1)).max().item()
    assert err <= 8e-3, err  # one bf16 rounding of the output (2^-8 relative) plus fp32 summation order


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("inter,hidden", [(18944, 3584), (50, 64)])
def test_gate_up_silu_matches_the_unfused_path(rows, inter, hidden):
    """The gated GEMV against GEMM + silu_mul (the path batches above GEMV_MAX_ROWS take), same roundings."""
    g = torch.Generator(device="cuda").manual_seed(rows + inter)
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=g) / hidden ** 0.5).bfloat16()
    got = K.gate_up_silu(x, w)
    ref = K.silu_mul_ref(x.double().matmul(w.double().T).bfloat16())
    assert got.shape == (rows, inter)
    err = ((got.float() - ref.float()).abs().amax(1) / ref.float().abs().amax(1)).max().item()
    assert err <= 2e-2, err  # gate and up each rounded once to bf16 before SiLU, as the unfused path
    assert torch.equal(K.gate_up_silu(x, w, max_rows=0), K.silu_mul(torch.nn.functional.linear(x, w)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunk_attention_qwen_shapes(dtype):
    """Prompt-chunk rows (a 224-row chunk at position 1,000, a 70-row one from 0, a one-row one) against the same
    rows as decode rows through the decode kernel's fp64 gold, in a graph replayed with a new table."""
    hq, hkv, d = QWEN
    g = torch.Generator(device="cuda").manual_seed(5)
    k_pool = torch.randn(4, hkv, 1536, d, device="cuda", generator=g).to(dtype)
    v_pool = torch.randn(4, hkv, 1536, d, device="cuda", generator=g).to(dtype)
    q = torch.randn(300, hq, d, device="cuda", generator=g).to(dtype)

    def gold(pieces):
        slots, lengths = torch.zeros(300, dtype=torch.long), torch.ones(300, dtype=torch.long)
        for row0, rows, slot, start in pieces.tolist():
            slots[row0:row0 + rows] = slot
            lengths[row0:row0 + rows] = torch.arange(start + 1, start + rows + 1)
        return attention_gold(DecodeCase(q, k_pool, v_pool, slots.cuda(), lengths.cuda(), 3))

    first = torch.tensor([[0, 224, 1, 1000], [224, 70, 2, 0], [294, 1, 0, 7], [0, 0, 0, 0]], dtype=torch.int32)
    second = torch.tensor([[0, 5, 3, 1500], [5, 200, 0, 300], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    table = first.cuda()
    K.chunk_attention(q, k_pool, v_pool, table, d ** -0.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.chunk_attention(q, k_pool, v_pool, table, d ** -0.5)
    for pieces in (first, second):
        table.copy_(pieces)
        graph.replay()
        rows = sum(r for _, r, _, _ in pieces.tolist())
        assert row_rel_err(out[:rows], gold(pieces)[:rows]) <= ATT_TOL[dtype]
        assert (out[rows:] == 0).all()


@pytest.mark.parametrize("page", [16, 32, 64, 256])
def test_paged_kernels_equal_the_slot_layout_bit_for_bit(page):
    """Qwen shapes, bf16: decode (64 x 8k, the split count of the slot layout), chunk and rope+store through a block
    table over shuffled blocks give the slot layout's bits (the same tiles read from elsewhere)."""
    from bench.measure.kernel_inputs import paged_copy

    lengths = ragged_lengths(64, 8192, seed=3)
    case = decode_case(lengths, *QWEN, max_seq=8192, dtype=torch.bfloat16, device="cuda", seed=3, pad_rows=2)
    kp, table = paged_copy(case.k_pool, page, seed=page)
    vp, _ = paged_copy(case.v_pool, page, seed=page)
    got = K.decode_attention(case.q, kp, vp, case.slots, case.lengths, case.scale, block_table=table)
    assert torch.equal(got, attention(case))
    pieces = torch.tensor([[0, 40, 1, 3000], [40, 24, 5, 0]], dtype=torch.int32, device="cuda")
    want = K.chunk_attention(case.q, case.k_pool, case.v_pool, pieces, case.scale)
    assert torch.equal(K.chunk_attention(case.q, kp, vp, pieces, case.scale, block_table=table), want)
    k, v = case.q[:, :4].contiguous(), case.q[:, 4:8].contiguous()
    cs = torch.randn(66, 128, device="cuda")
    positions = torch.tensor(lengths + [0, 0], device="cuda") - 1
    slot_pools = [case.k_pool.clone(), case.v_pool.clone()]
    want_q = K.rope_store(case.q, k, v, cs, cs, *slot_pools, case.slots, positions)
    got_q = K.rope_store(case.q, k, v, cs, cs, kp, vp, case.slots, positions, block_table=table)
    assert torch.equal(got_q, want_q)
    for want, got in zip(slot_pools, (kp, vp)):
        assert torch.equal(paged_copy(want, page, seed=page)[0].nan_to_num(7.0), got.nan_to_num(7.0))


@pytest.mark.parametrize("page", [0, 64], ids=["slots", "paged"])
def test_one_split_writes_the_merges_bits_qwen(page):
    """A decode step of >= 66 rows on 132 SMs takes one split a row, and stage 1 writes the output (no merge
    launch): the bits of stage 1 + the merge of that split, bf16 on Qwen shapes, a row of length 0 zeros."""
    from bench.measure.kernel_inputs import paged_copy
    from kvtransfer.kernels import triton_attention as TA
    from kvtransfer.kernels.triton_attention_split import STAGE2_HEADS, STAGE2_WARPS

    lengths = ragged_lengths(96, 2048, seed=12)
    lengths[5] = 0
    case = decode_case(lengths, *QWEN, max_seq=2048, dtype=torch.bfloat16, device="cuda", seed=12, garbage=None)
    kp, vp, table = case.k_pool, case.v_pool, None
    if page:
        kp, table = paged_copy(case.k_pool, page, seed=page)
        vp, _ = paged_copy(case.v_pool, page, seed=page)
    args = (case.q, kp, vp, case.slots, case.lengths, case.scale)
    merged = TA.decode_attention_triton(*args, num_splits=1, max_chunk=0, block_table=table,
                                        stage2=(STAGE2_WARPS, STAGE2_HEADS))
    # The default count (1 at 96 rows on 132 SMs), without the per-split cap (LONG_CHUNK: rows over 2k would merge).
    got = TA.decode_attention_triton(*args, max_chunk=0, block_table=table)
    torch.cuda.synchronize()
    assert torch.equal(got, merged)
    assert torch.equal(got[5], torch.zeros_like(got[5]))


@pytest.mark.parametrize("page", [0, 64], ids=["slots", "paged"])
def test_mixed_attention_is_both_kernels_in_one_launch_qwen(page):
    """The fused mixed-step kernel on Qwen shapes, bf16, in a graph (64 decode rows over ragged 1k-4k contexts +
    448 prompt rows, as a 512-row step): its decode rows are the decode kernel's at one split and its prompt rows
    the chunk kernel's, bit for bit (the same programs: whatever runs beside them on the SMs moves no bit), and
    within the decode kernel's fp64-gold tolerance."""
    from bench.measure.kernel_inputs import paged_copy
    from kvtransfer.kernels.triton_attention import decode_attention_triton

    lengths = ragged_lengths(64, 4096, seed=8)
    case = decode_case(lengths, *QWEN, max_seq=4096, dtype=torch.bfloat16, device="cuda", seed=8, garbage=None)
    kp, vp, table = case.k_pool, case.v_pool, None
    if page:
        kp, table = paged_copy(case.k_pool, page, seed=page)
        vp, _ = paged_copy(case.v_pool, page, seed=page)
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.cat([case.q, torch.randn(448, *QWEN[0::2], device="cuda", generator=g).to(torch.bfloat16)])
    pieces = torch.tensor([[0, 400, 1, 512], [400, 40, 2, 0], [440, 8, -1, 0], [0, 0, 0, 0]], dtype=torch.int32,
                          device="cuda")
    out = torch.empty_like(q)
    K.mixed_attention(q, kp, vp, 64, case.slots, case.lengths, pieces, case.scale, block_table=table, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.mixed_attention(q, kp, vp, 64, case.slots, case.lengths, pieces, case.scale, block_table=table, out=out)
    out.zero_()
    graph.replay()
    want_decode = decode_attention_triton(q[:64], kp, vp, case.slots, case.lengths, case.scale, num_splits=1,
                                          max_chunk=0, block_table=table)
    want_prompt = K.chunk_attention(q[64:], kp, vp, pieces, case.scale, block_table=table)
    assert torch.equal(out[:64], want_decode)
    assert torch.equal(out[64:], want_prompt)
    assert row_rel_err(out[:64], attention_gold(case)) <= ATT_TOL[torch.bfloat16]


def _compiled_kernels() -> int:
    """Triton kernels compiled so far in this process, over every @triton.jit of kvtransfer.kernels."""
    import importlib
    import pkgutil

    import kvtransfer.kernels as pkg
    from triton.runtime.jit import JITFunction

    seen, count = set(), 0
    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.name.startswith("triton_"):
            continue
        for obj in vars(importlib.import_module(f"kvtransfer.kernels.{mod.name}")).values():
            if isinstance(obj, JITFunction) and id(obj) not in seen:
                seen.add(id(obj))
                count += sum(len(caches[0]) for caches in obj.device_caches.values())
    return count


def test_the_fused_prefill_compiles_nothing_for_a_new_prompt_length():
    """A prompt of a length not seen before runs the kernels compiled for the first: the prefill's block has the
    prompt's own length, and a constexpr that followed it compiled rope+store on the serving thread for every new
    length (~0.2 s; tests/test_compile_keys.py has the CPU half). Whole prompts, then a prompt in padded chunks."""
    from kvtransfer.model.fused_prefill import chunk_cache, fused_chunk, fused_prefill
    from kvtransfer.model.spec import ModelSpec, load_model

    model = load_model(ModelSpec("smollm2-135m", "bfloat16", 0), "cuda")
    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to("cuda")

    fused_prefill(model, ids(64))
    cache = chunk_cache(model, 2 * 64 - 1)
    fused_chunk(model, ids(64), cache)
    torch.cuda.synchronize()
    before = _compiled_kernels()
    for n in (65, 97, 301, 1000):  # blocks of odd lengths and of multiples of 16, as the first
        fused_prefill(model, ids(n))
    for n in (65, 97, 120):  # 64 tokens, then the rest padded to 64 (engine.pad_chunk): blocks of n + 63
        cache = chunk_cache(model, n + 64 - 1)
        fused_chunk(model, ids(64), cache)
        fused_chunk(model, ids(64), cache, row=n - 64 - 1)
    torch.cuda.synchronize()
    assert _compiled_kernels() == before
