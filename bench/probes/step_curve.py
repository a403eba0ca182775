"""The mixed step's time against its size, at the mix a serving workload settles into (issue #39's two targets).

Why: served closed-loop, each step carries d decode rows and p prompt rows, and in the steady state the prompt work
keeps pace with the answers: p / d = P / (O - 1) for prompts of P tokens and O output tokens (each request feeds P
prompt rows, the last of which gives the first token, and O - 1 decode rows). A step of R = p + d rows then
yields R O / (P + O - 1) tokens: one per decode row, and the first tokens of the prompts it finishes (d O / (O - 1)
in all), so (docs/architecture.md, "What bounds serving against the compute roofline"):
  output tok/s / roofline = R x t_r / T(R)   (the step's efficiency; t_r = one fed token's time at the GEMM rate)
  ITL p50 ~ T(R)                               (each running stream gets one token per step)
Both of #39's targets (>= 75% of the roofline; ITL p50 <= 1.5x the decode step at the concurrency) are then bounds on
one curve, T(R), which this measures: for each size R, the graphed mixed step of d = R (O - 1) / (P + O - 1) decode
rows at --context beside one chunk of the rest (its rows centred on position P / 2, a prompt's mean), built and
timed by mixed_step.py as for profile_mixed.py (no profiler: median of --runs synchronized replays), with the
decode-only step at d rows and at each --itl-batches, and the GEMM rate of the model's shapes measured after them,
on a warm GPU (bench/measure/roofline.py), for t_r. The pool's rows hold --pool-seq positions (a server's, by
default), so the kernels take the grids they take served. One model load for every size. Prints a table and one
JSON line.

    python -m bench.probes.step_curve --model qwen2.5-7b --sizes 256,384,448,512,640,768,1024
    python -m bench.probes.step_curve --model tiny --device cpu --sizes 24,32 --context 48 --input-len 40 \
        --output-len 8 --itl-batches 4 --no-roofline
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from bench.measure import roofline
from bench.probes.mixed_step import build, timed
from kvtransfer.engine import runner as runner_module
from kvtransfer.engine.graphs import buckets
from kvtransfer.engine.runner import MIXED_ATTENTIONS
from kvtransfer.engine.sampler import first_token, next_tokens
from kvtransfer.kernels import ops
from kvtransfer.model.spec import ModelSpec, load_config, load_model


def mix(rows: int, input_len: int, output_len: int) -> int:
    """Decode rows of a `rows`-row step in the steady state: (O - 1) of every (P + O - 1) rows fed (>= 1)."""
    return max(1, round(rows * (output_len - 1) / (input_len + output_len - 1)))


def step_args(a, rows: int, batch: int) -> SimpleNamespace:
    """mixed_step.build's arguments for a `rows`-row step of `batch` decode rows and one prompt chunk in every
    other row (the bucket's free rows first, as a served step: mixed.lay_out), centred on position input_len / 2."""
    prompt = rows - batch
    start = max(0, min(a.input_len - prompt, a.input_len // 2 - prompt // 2))
    return SimpleNamespace(model=a.model, device=a.device, dtype=a.dtype, mixed=rows, batch=batch, context=a.context,
                           pieces=1, prompt_start=start, prompt_len=max(a.input_len, prompt), max_batch=a.max_batch,
                           page=a.page, eager=a.eager, no_side_stream=False, fill_bucket=True, pool_seq=a.pool_seq,
                           staged=True)


def time_size(a, model, rows: int) -> dict:
    """One size's step at the steady mix, and the decode-only step of its decode rows: medians in ms."""
    d = mix(rows, a.input_len, a.output_len)
    st, b, tok, pos, slots, chunks = build(step_args(a, rows, d), model)
    prompt = sum(c.ids.shape[0] for c in chunks)

    def body():  # as profile_mixed: the step, then the greedy picks of its decode rows and finished prompts
        logits, lasts = st.mixed(tok, pos, slots, chunks)
        return next_tokens(logits), [first_token(lasts[j]) for j, c in enumerate(chunks) if c.last]

    step_ms, _ = timed(body, tok.device, a.runs)
    decode_ms, _ = timed(lambda: next_tokens(st(tok, pos, slots)), tok.device, a.runs)
    return {"rows": d + prompt, "step_rows": st.rows_for(d, prompt), "decode_rows": d, "prompt_rows": prompt,
            "prompt_start": chunks[0].start, "attention": attention_ran(st.runner, b), "step_ms": step_ms,
            "decode_only_ms": decode_ms}


def attention_ran(runner, bucket: int) -> str:
    """What the step's attention ran, as the runner decides it (runner.py): "fused" (one launch) or "two" (the decode
    and chunk kernels). --attention fused does not override the per-split cap: pool rows longer than it run two."""
    fuses = ops.mixed_attention_fuses(bucket, runner.hq, runner.hkv, runner.device, max_seq=runner.pool.max_seq)
    return "fused" if runner_module.MIXED_ATTENTION == "fused" and fuses else "two"


def time_decode(a, model, batch: int) -> float:
    """The decode-only step of `batch` rows (the ITL target's denominator at that concurrency), median ms."""
    b = next(x for x in buckets(a.max_batch) if x >= batch)
    st, _, tok, pos, slots, _ = build(step_args(a, 2 * b, batch), model)
    return timed(lambda: next_tokens(st(tok, pos, slots)), tok.device, a.runs)[0]


def measure(a, model) -> dict:
    return {"steps": [time_size(a, model, rows) for rows in a.sizes],
            "decode_step_ms": {str(c): time_decode(a, model, c) for c in a.itl_batches}}


def t_r_us(fig: dict, input_len: int, output_len: int) -> float:
    """One fed token's time at the roofline (us): the request's time there (its output tokens over
    roofline.run_figures' roofline_output_tok_s) over the P + O - 1 tokens it feeds."""
    return output_len / fig["roofline_output_tok_s"] / (input_len + output_len - 1) * 1e6


def figures(r: dict, a, t_r_us: float | None) -> dict:
    """Each step's efficiency (rows x t_r / T) and its time against 1.5x each decode step."""
    for s in r["steps"]:
        s["efficiency"] = s["rows"] * t_r_us / (s["step_ms"] * 1e3) if t_r_us else None
        s["itl_over_decode_step"] = {c: s["step_ms"] / ms for c, ms in r["decode_step_ms"].items()}
    return r


def report(r: dict) -> None:
    batches = list(r["decode_step_ms"])
    ran = "/".join(sorted({s["attention"] for s in r["steps"]}))
    print(f"mixed steps ({ran} attention, pool rows of {r['pool_seq']}) at the steady mix of "
          f"{r['input_len']} in / {r['output_len']} out "
          f"on {r['device']} "
          f"({r['gpu']}); t_r {r['t_r_us'] or float('nan'):.2f} us a fed token at {r['gemm_tflops'] or 0:.0f} TFLOP/s; "
          f"decode step " + ", ".join(f"{c} rows {ms:.2f} ms" for c, ms in r["decode_step_ms"].items()))
    print("| rows | decode + prompt | step ms | us a row | efficiency | "
          + " | ".join(f"step / decode step at {c}" for c in batches) + " |")
    print("| --- " * (5 + len(batches)) + "|")
    for s in r["steps"]:
        eff = f"{100 * s['efficiency']:.1f}%" if s["efficiency"] is not None else "-"
        print(f"| {s['rows']} | {s['decode_rows']} + {s['prompt_rows']} | {s['step_ms']:.2f} | "
              f"{1e3 * s['step_ms'] / s['rows']:.1f} | {eff} | "
              + " | ".join(f"{s['itl_over_decode_step'][c]:.2f}x" for c in batches) + " |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="", help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--sizes", default="256,384,448,512,640,768,1024", help="the steps' rows, comma-separated")
    p.add_argument("--input-len", type=int, default=1024, help="the workload's mean prompt (README serve: 1024)")
    p.add_argument("--output-len", type=int, default=128, help="the workload's output tokens")
    p.add_argument("--context", type=int, default=1024, help="the decode rows' context")
    p.add_argument("--itl-batches", default="64,128", help="decode-only steps to price ITL against (concurrencies)")
    p.add_argument("--max-batch", type=int, default=256, help="the engine's --max-batch: its buckets")
    p.add_argument("--page", type=int, default=64, help="the pool's --kv-block-tokens (0: slots)")
    p.add_argument("--pool-seq", type=int, default=0,
                   help="the pool rows' positions, a server's --max-seq-len (0: the model's context, as a server with "
                        "default flags; the rows use only the blocks they need); the kernels' grids follow it")
    p.add_argument("--eager", action="store_true", help="no CUDA graph (the engine's --no-cuda-graphs)")
    p.add_argument("--attention", choices=MIXED_ATTENTIONS, default=None,
                   help="the steps' attention (default: the engine's, runner.MIXED_ATTENTION); fused only where the "
                        "runner fuses: pool rows no longer than the decode kernel's per-split cap, so not in a "
                        "server's 32k rows (--pool-seq); the table says what ran")
    p.add_argument("--runs", type=int, default=10, help="timed steps per size (median, after 3 warm-up)")
    p.add_argument("--no-roofline", action="store_true", help="skip the GEMM rate (no efficiency column)")
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        a.sizes = [int(x) for x in a.sizes.split(",")]
        a.itl_batches = [int(x) for x in a.itl_batches.split(",")] if a.itl_batches else []
    except ValueError:
        parser.error("--sizes and --itl-batches take comma-separated integers")
    if a.input_len < 2 or a.output_len < 2:
        parser.error("--input-len and --output-len must be >= 2 (a step needs decode and prompt rows)")
    if not a.sizes or min(a.sizes) < 2:
        parser.error("--sizes: every step needs >= 2 rows")
    for rows in a.sizes:  # the decode rows' bucket must fit --max-batch and leave the step's other half to prompts
        d = mix(rows, a.input_len, a.output_len)
        b = next((x for x in buckets(a.max_batch) if x >= d), 0)
        if not b or 2 * b > rows:
            parser.error(f"--sizes {rows}: its {d} decode rows (bucket {b or 'none'}) need --max-batch >= {d} and "
                         f"a step of >= 2x their bucket; raise the size or --max-batch, or lower --output-len")
    if any(not 1 <= c <= a.max_batch for c in a.itl_batches):
        parser.error(f"--itl-batches must lie in 1..--max-batch ({a.max_batch})")
    dev = torch.device(a.device)
    a.dtype = a.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    spec = ModelSpec(a.model, a.dtype, 0)
    model = load_model(spec, dev)
    a.pool_seq = a.pool_seq or model.config.max_position_embeddings
    saved = runner_module.MIXED_ATTENTION
    runner_module.MIXED_ATTENTION = a.attention or saved  # read at each forward (and capture)
    try:
        with torch.inference_mode():
            r = measure(a, model)
    finally:
        runner_module.MIXED_ATTENTION = saved
    measured = t_r = tflops = None
    if not a.no_roofline:  # after the steps, on a warm GPU (first thing in a cold process it read ~9% low once)
        dims = roofline.Dims.of(load_config(a.model))
        measured = roofline.measure_gemm(dims, a.device)
        fig = roofline.run_figures(measured, dims, [a.input_len], a.output_len, None)
        tflops, t_r = fig["gemm_tflops"], t_r_us(fig, a.input_len, a.output_len)
    r.update({"bench": "step_curve", "model": a.model, "device": str(dev), "input_len": a.input_len,
              "attention_asked": a.attention or saved, "pool_seq": a.pool_seq,
              "output_len": a.output_len, "context": a.context, "runs": a.runs, "graphed": not a.eager,
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "t_r_us": t_r,
              "gemm_tflops": tflops, "roofline": measured})
    figures(r, a, t_r)
    report(r)
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
