"""CPU checks of the kernels' torch references against HF's own eager code, and of the API.

Why: the references are what the engine runs on CPU and what the Triton kernels are judged
by, so they must equal HF's math (GQA grouping, ragged rows, padded rows on a scratch slot,
pool writes exactly where expected). Triton itself is tested in test_kernels_interp.py
(interpreter) and test_kernels_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from bench.measure.kernel_inputs import attention_gold, decode_case
from kvtransfer.kernels import ops as K

DTYPES = [torch.float32, torch.bfloat16]
# (q heads, kv heads, head dim): tiny, smollm2-135m, Qwen2.5-7B-like (scaled down D), MHA
HEADS = [(4, 2, 16), (9, 3, 64), (28, 4, 32), (4, 4, 16)]


def hf_attention_row(q_row, k, v, scale):
    """HF eager attention for one sequence: q_row (Hq, D), k/v (Hkv, L, D) -> (Hq, D)."""
    module = SimpleNamespace(num_key_value_groups=q_row.shape[0] // k.shape[0], training=False)
    out, _ = eager_attention_forward(module, q_row[None, :, None, :], k[None], v[None], None, scale)
    return out[0, 0]  # (1, 1, Hq, D) -> (Hq, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_decode_attention_ref_is_hf_eager(dtype, heads):
    hq, hkv, d = heads
    case = decode_case([7, 1, 33, 20], hq, hkv, d, max_seq=40, dtype=dtype, seed=1, pad_rows=2)
    out = K.decode_attention_ref(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    for b, (slot, length) in enumerate(zip(case.slots.tolist(), case.lengths.tolist())):
        k = case.k_pool[slot, :, :length]
        v = case.v_pool[slot, :, :length]
        torch.testing.assert_close(out[b], hf_attention_row(case.q[b], k, v, case.scale), rtol=0, atol=0)
    # Garbage (NaN) past every row's length and in the scratch slot never leaks in.
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), attention_gold(case), rtol=tol, atol=tol)


def test_decode_attention_gqa_grouping_is_hf_repeat_kv():
    # q head j must read kv head j // G: give each kv head a distinct constant V.
    case = decode_case([5, 9], 6, 3, 16, max_seq=12, dtype=torch.float32, garbage=None)
    for h in range(3):
        case.v_pool[:, h] = float(h + 1)
    out = K.decode_attention_ref(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale)
    expect = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0])[None, :, None].expand_as(out)
    torch.testing.assert_close(out, expect)


def test_decode_attention_default_backend_on_cpu_is_reference():
    case = decode_case([3, 8], 4, 2, 16, max_seq=8, dtype=torch.bfloat16)
    args = (case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale)
    assert not K.triton_available("cpu") and not K.triton_available(torch.device("cpu"))
    assert torch.equal(K.decode_attention(*args), K.decode_attention_ref(*args))


def rope_inputs(batch, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, d, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, d, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    positions = torch.randint(0, 50, (batch,), generator=gen)
    freqs = positions[:, None].float() * inv_freq[None, :]  # (B, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, D), HF layout
    return q, k, v, emb.cos() * 1.0, emb.sin() * 1.0, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS[:3])
def test_rope_store_ref_is_hf_and_writes_only_its_positions(dtype, heads):
    hq, hkv, d = heads
    batch, num_slots, max_seq = 5, 7, 50
    q, k, v, cos, sin, positions = rope_inputs(batch, hq, hkv, d, dtype)
    slots = torch.tensor([4, 0, 6, 2, 6])  # row 4 is a padded row on scratch slot 6 ...
    positions[4] = 0  # ... at position 0; row 2 is a real row in slot 6 at a later position
    positions[2] = 30
    k_pool = torch.randn(num_slots, hkv, max_seq, d).to(dtype)
    v_pool = torch.randn(num_slots, hkv, max_seq, d).to(dtype)
    k_before, v_before = k_pool.clone(), v_pool.clone()

    q_out = K.rope_store_ref(q, k, v, cos, sin, k_pool, v_pool, slots, positions.to(torch.int32))

    hf_q, hf_k = apply_rotary_pos_emb(
        q[:, :, None, :], k[:, :, None, :], cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
    )  # HF: (B, H, 1, D), cos/sin (B, 1, D) in the activation dtype
    assert torch.equal(q_out, hf_q[:, :, 0])
    touched = torch.zeros(num_slots, max_seq, dtype=torch.bool)
    for b in range(batch):
        s, p = int(slots[b]), int(positions[b])
        assert torch.equal(k_pool[s, :, p], hf_k[b, :, 0])
        assert torch.equal(v_pool[s, :, p], v[b])
        touched[s, p] = True
    mask = ~touched[:, None, :, None].expand_as(k_pool)
    assert torch.equal(k_pool[mask], k_before[mask]) and torch.equal(v_pool[mask], v_before[mask])
    assert not torch.equal(q_out, q)  # a new tensor; q itself untouched below
    assert torch.equal(q, rope_inputs(batch, hq, hkv, d, dtype)[0])


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_rms_norm_refs_are_hf(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 96, generator=gen).to(dtype)
    residual = torch.randn(6, 96, generator=gen).to(dtype)
    hf = LlamaRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=gen).to(dtype))
        weight = hf.weight.detach().clone()
        assert torch.equal(K.rms_norm(x, weight, 1e-6), hf(x))
        normed, res_out = K.add_rms_norm(x, residual, weight, 1e-6)
        hidden = residual + x  # HF decoder layer: hidden = residual + hidden
        assert torch.equal(res_out, hidden) and res_out.dtype == dtype
        assert torch.equal(normed, hf(hidden))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_ref_is_hf_mlp_activation(dtype):
    gen = torch.Generator().manual_seed(4)
    gate = torch.randn(3, 40, generator=gen).to(dtype)
    up = torch.randn(3, 40, generator=gen).to(dtype)
    out = K.silu_mul(torch.cat([gate, up], dim=-1))
    assert out.shape == (3, 40) and out.dtype == dtype
    assert torch.equal(out, F.silu(gate) * up)


def test_bad_shapes_and_dtypes_raise_value_error():
    case = decode_case([3, 4], 4, 2, 16, max_seq=8, dtype=torch.bfloat16)
    q, kp, vp, slots, lengths = case.q, case.k_pool, case.v_pool, case.slots, case.lengths
    bad_calls = [
        lambda: K.decode_attention(q[0], kp, vp, slots, lengths, 1.0),  # q 2-D
        lambda: K.decode_attention(q[:, :3], kp, vp, slots, lengths, 1.0),  # 3 q heads, 2 kv heads
        lambda: K.decode_attention(q.float(), kp, vp, slots, lengths, 1.0),  # dtype mismatch
        lambda: K.decode_attention(q, kp.transpose(1, 2), vp.transpose(1, 2), slots, lengths, 1.0),
        lambda: K.decode_attention(q, kp, vp[:1], slots, lengths, 1.0),  # pool shapes differ
        lambda: K.decode_attention(q, kp, vp, slots[:1], lengths, 1.0),  # slots not (B,)
        lambda: K.decode_attention(q, kp, vp, slots.float(), lengths, 1.0),  # float indices
        lambda: K.decode_attention(q.to(torch.int32), kp, vp, slots, lengths, 1.0),
        lambda: K.rope_store(q[..., :15], q[:, :2, :15], q[:, :2, :15], q[:, 0, :15], q[:, 0, :15], kp, vp, slots, lengths),
        lambda: K.rope_store(q, q, q[:, :2], q[:, 0], q[:, 0], kp, vp, slots, lengths),  # k heads
        lambda: K.rope_store(q, q[:, :2], q[:, :2], q[:, 0, :8], q[:, 0], kp, vp, slots, lengths),
        lambda: K.rms_norm(q, q[0, 0], 1e-6),  # x 3-D
        lambda: K.rms_norm(q[:, 0], q[0, 0, :8], 1e-6),  # weight size
        lambda: K.add_rms_norm(q[:, 0], q[:, 1, :8], q[0, 0], 1e-6),  # residual shape
        lambda: K.silu_mul(q[:, 0, :15]),  # odd width
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} did not raise")


def test_import_does_not_import_triton():
    code = "import sys, kvtransfer.kernels.ops as k; assert 'triton' not in sys.modules; print(k.triton_available('cpu'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_linear_and_gate_up_silu_fall_back_to_torch_on_cpu():
    """Off CUDA (or above GEMV_MAX_ROWS) the projections are plain F.linear, and gate_up_silu is GEMM + silu_mul."""
    from kvtransfer.kernels import ops as K

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 24, generator=g), torch.randn(10, 24, generator=g), torch.randn(10, generator=g)
    assert torch.equal(K.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(K.gate_up_silu(x, w), K.silu_mul_ref(F.linear(x, w)))
    with pytest.raises(ValueError, match="even row count"):
        K.gate_up_silu(x, w[:9])
    with pytest.raises(ValueError, match="columns"):
        K.linear(x, w[:, :5])


def _chunk_case(dtype, hq=4, hkv=2, d=16, seed=7):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(4, hkv, 160, d, generator=g).to(dtype)
    v_pool = torch.randn(4, hkv, 160, d, generator=g).to(dtype)
    q = torch.randn(96, hq, d, generator=g).to(dtype)
    # (first row, rows, slot, start): a chunk after a long past, one from position 0 longer than a 64-row
    # block, a 4-row chunk, an unused piece; rows 78..79 and 84..95 belong to none
    pieces = torch.tensor([[0, 5, 1, 130], [5, 73, 0, 0], [80, 4, 3, 17], [0, 0, 0, 0]], dtype=torch.int32)
    return q, k_pool, v_pool, pieces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_attention_ref_is_the_decode_reference_row_by_row(dtype):
    """A chunk row at position p attends exactly as a decode row of length p + 1 in the same slot."""
    q, k_pool, v_pool, pieces = _chunk_case(dtype)
    out = K.chunk_attention(q, k_pool, v_pool, pieces, 0.25)  # CPU: the reference
    slots, lengths = torch.zeros(96, dtype=torch.long), torch.ones(96, dtype=torch.long)
    for row0, rows, slot, start in pieces.tolist():
        slots[row0:row0 + rows] = slot
        lengths[row0:row0 + rows] = torch.arange(start + 1, start + rows + 1)
    want = K.decode_attention_ref(q, k_pool, v_pool, slots, lengths, 0.25)
    inside = torch.zeros(96, dtype=torch.bool)
    for row0, rows, _, _ in pieces.tolist():
        inside[row0:row0 + rows] = True
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (out[inside].float() - want[inside].float()).abs().max() <= tol
    assert (out[~inside] == 0).all()


def test_chunk_attention_refuses_bad_pieces():
    q, k_pool, v_pool, pieces = _chunk_case(torch.float32)
    with pytest.raises(ValueError, match=r"\(P, 4\) int32"):
        K.chunk_attention(q, k_pool, v_pool, pieces.long(), 0.25)
