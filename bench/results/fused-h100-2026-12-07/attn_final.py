"""The decode kernel at one split: stage 1 writing the output (FINAL, the default there since this tree) against
stage 1 + the merge of that one split (forced by passing the merge's own launch as `stage2`), Qwen2.5-7B's heads,
bf16, the paged pool of 16-position blocks, 28 calls (one a layer) in a CUDA graph, median of 20 replays after 3.

Run on the device: python3 bench/results/fused-h100-2026-12-07/attn_final.py (prints one JSON line per case)."""

import json
import statistics

import torch

from bench.measure.kernel_inputs import decode_case, paged_copy
from kvtransfer.kernels import triton_attention as TA
from kvtransfer.kernels.triton_attention_split import STAGE2_HEADS, STAGE2_WARPS


def run(args, table, out, stage2):
    for _ in range(28):
        TA.decode_attention_triton(*args, num_splits=1, block_table=table, out=out, stage2=stage2)


for batch, context in ((72, 1024), (128, 1024), (256, 1024), (128, 4096)):
    case = decode_case([context] * batch, 28, 4, 128, max_seq=context, dtype=torch.bfloat16, device="cuda", seed=1,
                       garbage=None)
    kp, table = paged_copy(case.k_pool, 16)
    vp, _ = paged_copy(case.v_pool, 16)
    splits = TA.default_num_splits(batch, 28, 4, context, torch.device("cuda"))
    out = torch.empty_like(case.q)
    row = {"batch": batch, "context": context, "num_splits": splits}
    outs = {}
    args = (case.q, kp, vp, case.slots, case.lengths, case.scale)
    for arm, stage2 in (("final", None), ("merge", (STAGE2_WARPS, STAGE2_HEADS))):
        run(args, table, out, stage2)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(args, table, out, stage2)
        times = []
        for i in range(23):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b))
        row[f"{arm}_ms_28_layers"] = round(statistics.median(times), 4)
        outs[arm] = out.clone()
    row["same_bits"] = bool(torch.equal(outs["final"], outs["merge"]))
    print(json.dumps(row), flush=True)
