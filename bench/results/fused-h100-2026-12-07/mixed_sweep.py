"""The fused mixed attention's launch, swept: the grid's order (chunk programs first, the default, or decode
programs first), warps 4/8, stages 2/3; Qwen2.5-7B's heads, bf16, the paged pool of 16-position blocks; a 512-row
step's shape: 64 decode rows over 1,024 positions + 448 prompt rows at 512-959, and 128 decode rows + 384 prompt
rows; 28 launches (one a layer) in a CUDA graph, median of 20 replays after 3. Prints one JSON line per case; each
arm's bits against the default's.

Run on the device: python3 bench/results/fused-h100-2026-12-07/mixed_sweep.py"""

import functools
import itertools
import json
import statistics

import torch

from bench.measure.kernel_inputs import decode_case, paged_copy
from kvtransfer.kernels.triton_mixed_attention import mixed_attention_triton


def run(args, kwargs):
    for _ in range(28):
        mixed_attention_triton(*args, **kwargs)


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for i in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


for decode_rows, prompt_rows in ((64, 448), (128, 384)):
    case = decode_case([1024] * decode_rows + [960], 28, 4, 128, max_seq=1024, dtype=torch.bfloat16, device="cuda",
                       seed=3, garbage=None)
    kp, table = paged_copy(case.k_pool, 16)
    vp, _ = paged_copy(case.v_pool, 16)
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.cat([case.q[:decode_rows],
                   torch.randn(prompt_rows, 28, 128, device="cuda", generator=g).to(torch.bfloat16)])
    # the prompt rows: one piece of the extra row's slot (its table row), positions 512.. (576.. at 384 rows)
    pieces = torch.tensor([[0, prompt_rows, int(case.slots[decode_rows]), 960 - prompt_rows]], dtype=torch.int32,
                          device="cuda")
    slots, lengths = case.slots[:decode_rows], case.lengths[:decode_rows]
    want = None
    for decode_first, warps, stages in itertools.product((False, True), (4, 8), (2, 3)):
        out = torch.empty_like(q)
        ms = timed(functools.partial(run, (q, kp, vp, decode_rows, slots, lengths, pieces, case.scale, table),
                                     {"out": out, "num_stages": stages, "num_warps": warps,
                                      "decode_first": decode_first}))
        want = out.clone() if want is None else want
        print(json.dumps({"decode_rows": decode_rows, "prompt_rows": prompt_rows, "decode_first": decode_first,
                          "num_warps": warps, "num_stages": stages, "ms_28_layers": round(ms, 4),
                          "same_bits_as_default": bool(torch.equal(out, want))}), flush=True)
