"""One long row among short ones in the decode kernel: the split rule as it is, the old rule's count (6 programs an
SM), and the per-split cap `max_chunk` (1k / 2k / 4k positions) at 2 programs an SM. Qwen2.5-7B's heads, bf16, a
paged pool of 64-position blocks whose rows hold 32,768 positions (the default server's), 28 launches (one a layer)
in a CUDA graph timed by bench/probes/chunk_attention.py's `graph_ms` (median of 20 replays). Cases: 33 rows (32 at
1,024 + one at 32,000: the interference bench's step after its long prompt), 64 rows with one at 32,000, and the
uniform 64 x 1,024 and 128 x 1,024 (what a cap costs when no row is long). Each arm's output against fp32 torch
attention (max abs diff) and its bits against the rule as it is.

Run on the device: python3 bench/results/fused-h100-2026-12-07/long_row.py"""

import functools
import json

import torch
import triton

from bench.probes.chunk_attention import D, HKV, HQ, LAYERS, PAGE, graph_ms
from kvtransfer.kernels import triton_attention as TA

MAX_SEQ = 32768


def build(lengths_list, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = len(lengths_list)
    width = MAX_SEQ // PAGE
    need = [-(-n // PAGE) for n in lengths_list]
    blocks = sum(need) + 1
    kp = torch.randn(blocks, HKV, PAGE, D, device="cuda", generator=g).to(torch.bfloat16)
    vp = torch.randn(blocks, HKV, PAGE, D, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.zeros(rows, width, dtype=torch.int32, device="cuda")
    nxt = 1
    for r, n in enumerate(need):
        table[r, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32, device="cuda")
        nxt += n
    q = torch.randn(rows, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.arange(rows, dtype=torch.int32, device="cuda")
    lengths = torch.tensor(lengths_list, dtype=torch.int32, device="cuda")
    return q, kp, vp, slots, lengths, table


def reference(q, kp, vp, lengths, table):
    out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    for r, n in enumerate(lengths.tolist()):
        ids = table[r, : -(-n // PAGE)].long()
        k = kp[ids].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :n].float()  # (Hkv, n, D)
        v = vp[ids].permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :n].float()
        qq = q[r].float().view(HKV, HQ // HKV, D)
        p = torch.softmax(qq @ k.transpose(1, 2) * D ** -0.5, -1)
        out[r] = (p @ v).reshape(HQ, D)
    return out


CASES = {"33 = 32 x 1k + 1 x 32k": [1024] * 32 + [32000], "64 = 63 x 1k + 1 x 32k": [1024] * 63 + [32000],
         "64 x 1k": [1024] * 64, "128 x 1k": [1024] * 128}
sms = torch.cuda.get_device_properties(0).multi_processor_count
for name, lens in CASES.items():
    q, kp, vp, slots, lengths, table = build(lens)
    want = reference(q, kp, vp, lengths, table)
    base = None
    arms = [("as is", {}), ("6 programs an SM", {"num_splits": min(TA.MAX_SPLITS, max(1, min(
        triton.cdiv(6 * sms, len(lens) * HKV), triton.cdiv(MAX_SEQ, TA.BLOCK_N)))), "max_chunk": 0})]
    arms += [(f"cap {c}", {"max_chunk": c}) for c in (1024, 2048, 4096)]
    for arm, kw in arms:
        out = torch.empty_like(q)

        def layers(kw=kw, out=out):
            for _ in range(LAYERS):
                TA.decode_attention_triton(q, kp, vp, slots, lengths, D ** -0.5, block_table=table, out=out, **kw)

        ms = graph_ms(functools.partial(layers), replays=20)
        base = out.clone() if base is None else base
        print(json.dumps({"case": name, "arm": arm, "kwargs": kw, "ms_28_layers": round(ms, 4),
                          "default_splits": TA.default_num_splits(len(lens), HQ, HKV, MAX_SEQ, q.device),
                          "max_abs_diff_vs_fp32": round((out.float() - want).abs().max().item(), 5),
                          "same_bits_as_is": bool(torch.equal(out, base))}), flush=True)
