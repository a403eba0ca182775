"""probe_round's `mixed` part: where a mixed step's time goes (kvtransfer/engine/mixed.py, graphs.py).

Why apart: it builds its own pool and Step at the 7B model's shapes and times graphed and eager
mixed steps and the three attention paths over prompt rows (the decode kernel one row at a time,
the chunk kernel, SDPA flash); probe_round.py keeps the other parts. Run through
`python -m bench.probes.probe_round --only mixed`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from bench.measure.stats import summarize
from bench.measure.timing import loop_us
from kvtransfer.engine.graphs import Step
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner, graph_us
from kvtransfer.kernels import ops as K


def mixed(model, geom) -> dict:
    """Where a mixed step's time goes: 32 decode rows at position 1100 plus R - 32 rows of one prompt chunk at
    positions 512.., graphed at 256/512/1024 rows, and eager at 256..2048 from position 0 (device time from
    events; host time to return, unsynchronized); then the attention alone per layer over R rows of one prompt
    from position 0: the decode kernel (one row at a time), the chunk kernel and SDPA's flash causal attention."""
    from kvtransfer.engine.mixed import Chunk, mixed_forward, piece_table

    pool = KVPool(geom, torch.device("cuda"), 33, 2304)
    pool.kv.normal_()
    runner = StepRunner(model, pool)
    st = Step(runner, 32, cuda_graphs=True, chunk=256, max_rows=1024)
    tok = torch.randint(0, 1000, (32,), device="cuda")
    pos = torch.full((32,), 1100, dtype=torch.long, device="cuda")
    slots = torch.arange(32, device="cuda")
    ids = torch.randint(3, 1000, (2048,), device="cuda")
    out = {"plain_step_ms": loop_us(lambda: st(tok, pos, slots), 20) / 1e3, "graphed": []}
    for rows in st.sizes:
        chunk = [Chunk(ids[:rows - 32], 32, 512, False)]
        out["graphed"].append(dict(rows=rows, ms=loop_us(lambda: st.mixed(tok, pos, slots, chunk), 10) / 1e3))
        print("mixed graphed", out["graphed"][-1], flush=True)
    eager = []
    for rows in (256, 512, 1024, 2048):
        chunk = [Chunk(ids[:rows - 32], 32, 0, False)]
        mixed_forward(runner, tok, pos, slots, chunk)
        torch.cuda.synchronize()
        dev, hostt = [], []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            mixed_forward(runner, tok, pos, slots, chunk)
            hostt.append(time.perf_counter() - t0)
            b.record()
            torch.cuda.synchronize()
            dev.append(a.elapsed_time(b) / 1e3)
        eager.append(dict(rows=rows, device_ms=summarize(dev, 1e3)["median"], host_ms=summarize(hostt, 1e3)["median"]))
        print("mixed eager", eager[-1], flush=True)
    out["eager"] = eager
    att = []
    kp, vp = pool.layer(0)
    for n in (224, 1024, 2048):
        q = torch.randn(n, runner.hq, runner.d, device="cuda", dtype=torch.bfloat16)
        sl = torch.full((n,), 32, dtype=torch.long, device="cuda")
        ln = torch.arange(1, n + 1, dtype=torch.int32, device="cuda")
        table = piece_table([Chunk(ids[:n], 32, 0, True)], 4, n).cuda()
        row = dict(rows=n)
        for name, fn in (("decode_kernel", lambda: K.decode_attention(q, kp, vp, sl, ln, runner.scale)),
                         ("chunk_kernel", lambda: K.chunk_attention(q, kp, vp, table, runner.scale))):
            row[f"{name}_us"] = graph_us(fn, q.device, replays=10)  # in a graph: the host's launch cost left out
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
        kh, vh = kp[32:33, :, :n], vp[32:33, :, :n]  # (1, Hkv, n, D)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            row["flash_causal_us"] = loop_us(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                                                    enable_gqa=True), 10)
        att.append(row)
        print("attention", att[-1], flush=True)
    out["attention_per_layer"] = att
    return out
