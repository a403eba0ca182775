"""Probe for the step-speed and serving-throughput work: where the remaining time goes, measured, not guessed.

Why: the batch-1 step sits above its floor with the narrow GEMMs short of the memory bandwidth, and a served
prefill stalls decodes longer than the same prefill takes in the ttft bench (bench/results/probe-* has the
figures). This measures, on one GPU, in one process:
  gemv     the Triton GEMV vs cuBLAS per projection shape and row count, in a CUDA graph (weights rotated
           past L2)
  step     the graphed step at batch 1/2/4/8 x 1k with and without the GEMV
  prefill  HF's prefill at 512/1024/1536 tokens: wall, GPU time, kernels launched; alone and beside a
           thread that holds the GIL in bursts (the server's event loop streaming tokens)
  host     the scheduler's per-step host work at batch 32 vs bare graph replay
  served   the local prefill's time in-process through the engine, then inside a colocated server
  shapes   the fused prefill at prompt lengths it has not seen yet against lengths it has, with SDPA free to
           pick its backend and with the cuDNN backend excluded (served prompts vary in length)
  mixed    a mixed step's device and host time at 256..2048 rows, graphed and eager, and its attention
           over prompt rows: the decode kernel, the chunk kernel, flash causal attention (probe_mixed.py)
Prints one JSON object; `--only` picks parts.

    python -m bench.probes.probe_round --model qwen2.5-7b --out result.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.measure.stats import summarize
from bench.probes import probe_mixed, probe_served
from bench.measure.timing import loop_us
from kvtransfer.engine.graphs import Step
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner, graph_us
from kvtransfer.geometry import CacheGeometry
from kvtransfer.kernels import ops as K
from kvtransfer.model.prefill import logits_digest, prefill
from kvtransfer.model.spec import ModelSpec, load_model


def gemv(model) -> list[dict]:
    lay = model.model.layers[0]
    a, m = lay.self_attn, lay.mlp
    shapes = {"qkv": (torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                      None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])),
              "o": (a.o_proj.weight, None), "gate_up": (torch.cat([m.gate_proj.weight, m.up_proj.weight]), None),
              "down": (m.down_proj.weight, None), "lm_head": (model.lm_head.weight, None)}
    rows = []
    for name, (w, b) in shapes.items():
        nbytes = w.numel() * w.element_size()
        copies = [w.clone() for _ in range(max(1, -(-400 * 2**20 // nbytes)))]  # > L2 many times over
        gated = name == "gate_up"
        for mrows in (1, 2, 4, 8):
            x = torch.randn(mrows, w.shape[1], device="cuda", dtype=w.dtype)

            def run(fn):
                def calls():
                    for c in copies * 3:
                        fn(c)
                return graph_us(calls, torch.device("cuda")) / (3 * len(copies))

            def cublas(c):
                y = F.linear(x, c, b)
                return K.silu_mul(y) if gated else y

            def tri(c):
                return K.gate_up_silu(x, c, max_rows=8) if gated else K.linear(x, c, b, max_rows=8)

            try:
                t_tri = run(tri)
                ref, got = cublas(w).float(), tri(w).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
            except Exception as e:  # noqa: BLE001 - a probe reports what failed
                t_tri, err = None, repr(e)[:200]
            t_cub = run(cublas)
            rows.append(dict(name=name, rows=mrows, n=w.shape[0], k=w.shape[1], mib=nbytes / 2**20,
                             cublas_us=t_cub, triton_us=t_tri, cublas_tbs=nbytes / t_cub / 1e6,
                             triton_tbs=None if t_tri is None else nbytes / t_tri / 1e6, rel_err=err))
            print("gemv", rows[-1], flush=True)
    return rows


def step(model, geom) -> list[dict]:
    pool = KVPool(geom, torch.device("cuda"), 8, 1024 + 8)
    pool.kv.normal_()
    out = []
    for gemv_rows in (0, None):
        runner = StepRunner(model, pool, gemv_rows=gemv_rows)
        st = Step(runner, 8, cuda_graphs=True)
        for b in (1, 2, 4, 8):
            tok = torch.randint(0, 1000, (b,), device="cuda")
            pos = torch.full((b,), 1023, dtype=torch.long, device="cuda")
            slots = torch.arange(b, device="cuda")
            us = loop_us(lambda: st(tok, pos, slots), 20)
            ref = runner.forward(tok[:1], pos[:1], slots[:1]).float()
            out.append(dict(gemv=gemv_rows is None, batch=b, step_ms=us / 1e3,
                            row0_rel=((st(tok, pos, slots)[0].float() - ref[0]).norm() / ref[0].norm()).item()))
            print("step", out[-1], flush=True)
    return out


class GilHog:
    """A thread that runs pure-Python work in bursts (`busy_us` every `period_us`), as an event loop streaming tokens."""

    def __init__(self, busy_us: float, period_us: float):
        self.busy, self.period, self.stop = busy_us / 1e6, period_us / 1e6, False
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop:
            end = time.perf_counter() + self.busy
            while time.perf_counter() < end:
                sum(range(50))
            time.sleep(max(0.0, self.period - self.busy))

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop = True
        self.t.join()


def walls_ms(fn, hog) -> float:
    walls = []
    for _ in range(6):
        torch.cuda.synchronize()
        with GilHog(*hog) if hog else _Null():
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    return summarize(walls[1:], 1e3)["median"]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


def prefills(model) -> list[dict]:
    """HF's forward against the fused prefill (kvtransfer/model/fused_prefill.py, what both servers run)."""
    out = []
    for n in (512, 1024, 1536):
        ids = torch.randint(3, 1000, (1, n), device="cuda")
        ref, got = prefill(model, ids, fused=False)[1].float(), prefill(model, ids)[1].float()
        out.append(dict(tokens=n, fused_vs_hf_rel_l2=((got - ref).norm() / ref.norm()).item(),
                        same_argmax=bool(got.argmax() == ref.argmax())))
        print("prefill", out[-1], flush=True)
        paths = (("hf", lambda: prefill(model, ids, fused=False)), ("fused", lambda: prefill(model, ids)))
        for hog in (None, (100, 700), (1000, 2000)):
            out.append(dict(tokens=n, hog_us=hog, **{f"{name}_wall_ms": walls_ms(fn, hog) for name, fn in paths}))
            print("prefill", out[-1], flush=True)
        for name, fn in paths:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu_us = sum(getattr(e, "device_time_total", 0) for e in kern)
            out.append(dict(tokens=n, path=name, gpu_ms=gpu_us / 1e3, kernels=len(kern)))
            print("prefill", out[-1], flush=True)
    return out


def host(model, geom) -> dict:
    """Bare replay vs the scheduler's step body (host tensors in, argmax, tolist, per-row Python) at batch 32."""
    pool = KVPool(geom, torch.device("cuda"), 32, 1024 + 8)
    pool.kv.normal_()
    st = Step(StepRunner(model, pool), 32, cuda_graphs=True)
    tok = torch.randint(0, 1000, (32,), device="cuda")
    pos = torch.full((32,), 1023, dtype=torch.long, device="cuda")
    slots = torch.arange(32, device="cuda")
    bare = loop_us(lambda: st(tok, pos, slots), 20) / 1e3
    last, lengths, sl = [1] * 32, [1023] * 32, list(range(32))

    def body():
        t = torch.tensor(last, dtype=torch.long).to("cuda", non_blocking=True)
        p = torch.tensor(lengths, dtype=torch.long).to("cuda", non_blocking=True)
        s = torch.tensor(sl, dtype=torch.long).to("cuda", non_blocking=True)
        logits = st(t, p, s)
        nxt = logits.argmax(dim=-1).tolist()
        for j in range(32):
            last[j] = nxt[j] % 1000
        return nxt

    walls = []
    for _ in range(40):
        t0 = time.perf_counter()
        body()
        walls.append(time.perf_counter() - t0)
    with GilHog(100, 700):
        hogged = []
        for _ in range(40):
            t0 = time.perf_counter()
            body()
            hogged.append(time.perf_counter() - t0)
    return dict(batch=32, bare_replay_ms=bare, scheduler_body_ms=summarize(walls[5:], 1e3)["median"],
                scheduler_body_hogged_ms=summarize(hogged[5:], 1e3)["median"],
                digest_of_one_row_ms=timeit_ms(lambda: logits_digest(st(tok, pos, slots)[0])))


def shapes(model) -> dict:
    """Fused prefill wall time (synchronized) at new and at repeated lengths, per SDPA backend set."""
    from torch.nn.attention import SDPBackend

    from kvtransfer.model import fused_prefill

    sets = {"default": None, "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
            "flash_only": [SDPBackend.FLASH_ATTENTION], "cudnn_only": [SDPBackend.CUDNN_ATTENTION]}
    out, base = {}, 700
    for name, backends in sets.items():
        rows = []
        for i in range(6):
            n = base + 37 * i + 1  # never seen before in this process
            ids = torch.randint(3, 1000, (1, n), device="cuda")
            for label in ("new", "again"):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fused_prefill.SDPA_BACKENDS = backends  # the set the fused prefill runs its attention under
                try:
                    prefill(model, ids)
                    torch.cuda.synchronize()
                    rows.append(dict(tokens=n, seen=label, ms=(time.perf_counter() - t0) * 1e3))
                except Exception as e:  # noqa: BLE001 - a backend that cannot run these shapes
                    rows.append(dict(tokens=n, seen=label, error=repr(e)[:200]))
        base += 400
        out[name] = rows
        fused_prefill.SDPA_BACKENDS = sets["no_cudnn"]
        print(f"shapes {name}:", [(r["tokens"], r["seen"], round(r.get("ms", -1), 1)) for r in rows], flush=True)
    out["cudnn_sdp_enabled"] = torch.backends.cuda.cudnn_sdp_enabled()
    return out


def timeit_ms(fn) -> float:
    walls = []
    for _ in range(6):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return summarize(walls[1:], 1e3)["median"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--only", default="gemv,step,prefill,host")
    p.add_argument("--out", default="")
    p.add_argument("--logs", default="/tmp/probe-logs", help="the served part's server log")
    a = p.parse_args(argv)
    model = load_model(ModelSpec(a.model, "bfloat16", 0), "cuda")
    geom = CacheGeometry.from_config(model.config, torch.bfloat16)
    res = {"model": a.model, "device": torch.cuda.get_device_name()}
    parts = a.only.split(",")
    with torch.inference_mode():
        for part in parts:
            t0 = time.perf_counter()
            try:
                res[part] = {"gemv": lambda: gemv(model), "step": lambda: step(model, geom),
                             "prefill": lambda: prefills(model), "host": lambda: host(model, geom),
                             "served": lambda: probe_served.served(a.model, model, a.logs),
                             "shapes": lambda: shapes(model), "mixed": lambda: probe_mixed.mixed(model, geom)}[part]()
            except Exception as e:  # noqa: BLE001
                res[part] = {"error": repr(e)[:500]}
            print(f"{part}: {time.perf_counter() - t0:.1f} s", flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
