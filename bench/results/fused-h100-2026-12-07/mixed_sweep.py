"""The fused mixed attention's launch, swept: the grid's order (chunk programs first, the default, or decode
programs first), warps 4/8, stages 2/3; Qwen2.5-7B's heads, bf16, the paged pool of 64-position blocks
(bench/probes/chunk_attention.py's `case`); a 512-row step's shape: 64 decode rows over 1,024 positions + 448
prompt rows at 512-959, and 128 decode rows + 384 prompt rows at 576-959; 28 launches (one a layer) in a CUDA
graph, timed by that probe's `graph_ms`, median of 20 replays. Prints one JSON line per case; each arm's bits
against the default's.

Run on the device: python3 bench/results/fused-h100-2026-12-07/mixed_sweep.py"""

import functools
import itertools
import json

import torch

from bench.probes.chunk_attention import LAYERS, D, case, graph_ms
from kvtransfer.kernels.triton_mixed_attention import mixed_attention_triton


def layers(args, kwargs):
    for _ in range(LAYERS):
        mixed_attention_triton(*args, **kwargs)


for decode_rows, prompt_rows in ((64, 448), (128, 384)):
    q, kp, vp, table, rows, lengths, pieces = case(decode_rows, 1024, prompt_rows, 960 - prompt_rows)
    want = None
    for decode_first, warps, stages in itertools.product((False, True), (4, 8), (2, 3)):
        out = torch.empty_like(q)
        args = (q, kp, vp, decode_rows, rows, lengths, pieces, D ** -0.5, table)
        kwargs = {"out": out, "num_stages": stages, "num_warps": warps, "decode_first": decode_first}
        ms = graph_ms(functools.partial(layers, args, kwargs), replays=20)
        want = out.clone() if want is None else want
        print(json.dumps({"decode_rows": decode_rows, "prompt_rows": prompt_rows, "decode_first": decode_first,
                          "num_warps": warps, "num_stages": stages, "ms_28_layers": round(ms, 4),
                          "same_bits_as_default": bool(torch.equal(out, want))}), flush=True)
