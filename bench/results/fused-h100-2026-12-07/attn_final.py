"""The decode kernel at one split: stage 1 writing the output (FINAL, the default there since this tree) against
stage 1 + the merge of that one split (forced by passing the merge's own launch as `stage2`), Qwen2.5-7B's heads,
bf16, the paged pool of 64-position blocks (bench/probes/chunk_attention.py's `case`), 28 calls (one a layer) in a
CUDA graph, timed by that probe's `graph_ms` (the engine's graph timer), median of 20 replays.

Run on the device: python3 bench/results/fused-h100-2026-12-07/attn_final.py (prints one JSON line per case)."""

import functools
import json

import torch

from bench.probes.chunk_attention import LAYERS, D, case, graph_ms
from kvtransfer.kernels import triton_attention as TA
from kvtransfer.kernels.triton_attention_split import STAGE2_HEADS, STAGE2_WARPS


def layers(q, kp, vp, rows, lengths, table, out, stage2):
    for _ in range(LAYERS):
        TA.decode_attention_triton(q, kp, vp, rows, lengths, D ** -0.5, num_splits=1, block_table=table, out=out,
                                   stage2=stage2)


for batch, context in ((72, 1024), (128, 1024), (256, 1024), (128, 4096)):
    q, kp, vp, table, rows, lengths, _ = case(batch, context, 0, 0)
    out = torch.empty_like(q)
    row = {"batch": batch, "context": context, "num_splits_default": TA.default_num_splits(batch, 28, 4, context,
                                                                                            q.device)}
    outs = {}
    for arm, stage2 in (("final", None), ("merge", (STAGE2_WARPS, STAGE2_HEADS))):
        ms = graph_ms(functools.partial(layers, q, kp, vp, rows, lengths, table, out, stage2), replays=20)
        row[f"{arm}_ms_28_layers"] = round(ms, 4)
        outs[arm] = out.clone()
    row["same_bits"] = bool(torch.equal(outs["final"], outs["merge"]))
    print(json.dumps(row), flush=True)
