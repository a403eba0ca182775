"""Per-call GPU time of the decode-step kernels on one GPU; prints one JSON line.

Why: the decode engine's step time is dominated by attention over the KV pool, which should
run near the memory floor; this measures decode_attention beside that floor (valid K/V bytes
over the device-to-device copy bandwidth measured in the same run) and beside SDPA with a
mask, plus a split-count sweep to tune `choose_num_splits`, and the small fused ops at
B=1 and B=64. Shapes: Qwen2.5-7B (28 q / 4 kv heads, D=128, hidden 3584, MLP 18944), bf16,
lengths ragged in [L/2, L]. Times are medians of triton.testing.do_bench (L2 flushed per
call). Run on the GPU machine: python3 -m bench.probes.kernels; `--only paging`: the decode kernel through a
block table at several page sizes beside the slot layout (paging_rows).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from bench.measure.kernel_inputs import decode_case, ragged_lengths
from kvtransfer.kernels import ops as K

Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 28, 4, 128, 3584, 18944
CASES = [(1, 1024), (1, 32768), (8, 32768), (64, 1024), (32, 1024), (64, 8192)]
SWEEP_CASES = [(1, 32768), (8, 32768), (64, 1024)]
SWEEP_SPLITS = [8, 16, 32, 64, 128, 256]


def _us(fn) -> float:
    from triton.testing import do_bench

    return round(do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3, 2)


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = _us(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 30) / (t * 1e-6)


def _sdpa(case, batch):
    # The baseline: SDPA over the whole slot (row b in slot b, a view), bool mask of valid positions.
    max_seq = case.k_pool.shape[2]
    q4 = case.q[:, :, None, :]  # (B, Hq, 1, D)
    k4, v4 = case.k_pool[:batch], case.v_pool[:batch]  # (B, Hkv, T, D)
    mask = (torch.arange(max_seq, device="cuda")[None, :] < case.lengths[:, None])[:, None, None, :]
    return lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=case.scale, enable_gqa=True)


def attention_rows(bandwidth: float) -> tuple[list[dict], dict]:
    from kvtransfer.kernels.triton_attention import default_num_splits

    rows, sweeps = [], {}
    for batch, max_len in CASES:
        lengths = ragged_lengths(batch, max_len, seed=batch + max_len)
        case = decode_case(lengths, Q_HEADS, KV_HEADS, HEAD_DIM, max_seq=max_len, dtype=torch.bfloat16,
                           device="cuda", seed=1, garbage=None, shuffle=False)
        args = (case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale)
        valid_bytes = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * case.k_pool.element_size()
        splits = default_num_splits(batch, Q_HEADS, KV_HEADS, max_len, case.q.device)
        out = K.decode_attention(*args, use_triton=True)
        row = {"batch": batch, "max_len": max_len, "valid_tokens": sum(lengths), "num_splits": splits,
               "triton_us": _us(lambda: K.decode_attention(*args, use_triton=True)),
               "floor_us": round(valid_bytes / bandwidth * 1e6, 2)}
        row["pct_of_floor"] = round(100 * row["floor_us"] / row["triton_us"], 1)
        try:
            sdpa = _sdpa(case, batch)
            ref = sdpa()[:, :, 0, :]
            row["sdpa_us"] = _us(sdpa)
            row["max_abs_diff_vs_sdpa"] = round((out.float() - ref.float()).abs().max().item(), 5)
        except RuntimeError as exc:  # a baseline that cannot run (or runs out of memory) is reported, not fatal
            row["sdpa_error"] = str(exc).splitlines()[0][:200]
        rows.append(row)
        if (batch, max_len) in SWEEP_CASES:
            sweeps[f"{batch}x{max_len}"] = {
                s: _us(lambda s=s: K.decode_attention(*args, use_triton=True, num_splits=s)) for s in SWEEP_SPLITS
            }
        del case, args, out
        torch.cuda.empty_cache()
    return rows, sweeps


PAGING_CASES = [(1, 1024), (1, 32768), (64, 1024), (64, 8192), (256, 2048)]
PAGES = [16, 32, 64, 128, 256]


def paging_rows(bandwidth: float) -> list[dict]:
    """decode_attention through a block table over shuffled blocks (bench.measure.kernel_inputs.paged_copy) beside
    the slot layout, per page size: what a page costs the decode kernel. Outputs checked equal bit for bit."""
    from bench.measure.kernel_inputs import paged_copy

    rows = []
    for batch, max_len in PAGING_CASES:
        lengths = ragged_lengths(batch, max_len, seed=batch + max_len)
        case = decode_case(lengths, Q_HEADS, KV_HEADS, HEAD_DIM, max_seq=max_len, dtype=torch.bfloat16,
                           device="cuda", seed=1, garbage=None, shuffle=True)
        valid_bytes = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * case.k_pool.element_size()
        want = K.decode_attention(case.q, case.k_pool, case.v_pool, case.slots, case.lengths, case.scale)
        row = {"batch": batch, "max_len": max_len, "floor_us": round(valid_bytes / bandwidth * 1e6, 2),
               "slots_us": _us(lambda: K.decode_attention(case.q, case.k_pool, case.v_pool, case.slots, case.lengths,
                                                          case.scale))}
        for page in PAGES:
            kp, table = paged_copy(case.k_pool, page, seed=page)
            vp, _ = paged_copy(case.v_pool, page, seed=page)
            got = K.decode_attention(case.q, kp, vp, case.slots, case.lengths, case.scale, block_table=table)
            row[f"page{page}_us"] = _us(lambda: K.decode_attention(case.q, kp, vp, case.slots, case.lengths,
                                                                   case.scale, block_table=table))
            row[f"page{page}_equal"] = bool(torch.equal(got, want))
            del kp, vp
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del case, want
        torch.cuda.empty_cache()
    return rows


def small_ops() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    for batch in (1, 64):
        x, res, w = randn(batch, HIDDEN), randn(batch, HIDDEN), randn(HIDDEN)
        gate_up = randn(batch, 2 * INTER)
        q, k, v = randn(batch, Q_HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM), randn(batch, KV_HEADS, HEAD_DIM)
        cos, sin = torch.rand(batch, HEAD_DIM, device="cuda"), torch.rand(batch, HEAD_DIM, device="cuda")
        k_pool = torch.zeros(batch + 1, KV_HEADS, 1024, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.zeros_like(k_pool)
        slots = torch.arange(batch, device="cuda")
        positions = torch.full((batch,), 100, device="cuda", dtype=torch.int32)
        ops = {
            "rms_norm": lambda t: K.rms_norm(x, w, 1e-6, use_triton=t),
            "add_rms_norm": lambda t: K.add_rms_norm(x, res, w, 1e-6, use_triton=t),
            "silu_mul": lambda t: K.silu_mul(gate_up, use_triton=t),
            "rope_store": lambda t: K.rope_store(q, k, v, cos, sin, k_pool, v_pool, slots, positions, use_triton=t),
        }
        for name, op in ops.items():
            rows.append({"op": name, "batch": batch, "triton_us": _us(lambda: op(True)), "torch_us": _us(lambda: op(False))})
    return rows


def main() -> int:
    if not torch.cuda.is_available() or not K.triton_available("cuda"):
        print(json.dumps({"error": "needs a CUDA GPU and triton"}))
        return 1
    import triton

    start = time.monotonic()
    bandwidth = copy_bandwidth()
    if sys.argv[1:] == ["--only", "paging"]:
        print(json.dumps({"bench": "kernels-paging", "device": torch.cuda.get_device_name(0),
                          "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "paging": paging_rows(bandwidth),
                          "wall_s": round(time.monotonic() - start, 1)}))
        return 0
    attention, sweeps = attention_rows(bandwidth)
    result = {
        "bench": "kernels",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16",
        "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden": HIDDEN, "inter": INTER},
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "attention": attention,
        "split_sweep_us": sweeps,
        "small_ops": small_ops(),
        "sdpa": "F.scaled_dot_product_attention(q (B,Hq,1,D), slot views (B,Hkv,T,D), bool mask (B,1,1,T), enable_gqa=True)",
    }
    result["wall_s"] = round(time.monotonic() - start, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
