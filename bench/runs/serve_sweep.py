"""Serve sweep: the batching decode server against `--max-batch 1`, colocated and as a pair, in one run.

Why a driver: the acceptance figure is a ratio of two servers' throughput on the same machine in
the same run, at several concurrencies; starting each server (model load, CUDA-graph capture) and
pointing `kvtransfer-bench serve` at it by hand invites mixing runs. For each arm (colocated, or a
pair over --transport) and each --max-batch (the batching server, then the baseline), this starts
fresh servers with a metrics port, runs `serve` at each concurrency with num_prompts =
max(min_prompts, prompts_per_slot x concurrency) (at most max_prompts), and writes every result plus a
summary. The summary gives both the whole-run throughput (vLLM's output_throughput) and the steady state
between the opening burst and the tail (serve.sustained), each against the baseline's.

    python -m bench.runs.serve_sweep --model qwen2.5-7b --transport cuda_ipc --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from bench.measure.launch import colocated_server, free_port, server_pair
from bench.runs.serve import ServeConfig, add_long_prompt_flags, run_serve
from kvtransfer.rpc.stacks import exit_on_sigterm, exit_status, terminated


def non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def extra_args(args, max_batch: int) -> str:
    """--decode-args, or for the --max-batch 1 baseline --baseline-decode-args when given."""
    if max_batch == 1 and args.baseline_decode_args is not None:
        return args.baseline_decode_args
    return args.decode_args


def arm_servers(arm: str, args, max_batch: int, log_dir: str, metrics_port: int):
    decode = ["--max-batch", str(max_batch), "--max-seq-len", str(args.max_seq_len), "--metrics-port",
              str(metrics_port), "--admission-wait-s", "600", "--request-timeout-s", "1200",
              "--max-inflight", "1024", *shlex.split(extra_args(args, max_batch)), "--log-level", "WARNING"]
    if arm == "colocated":
        return colocated_server(log_dir, args.model, args.dtype, args.device, args=decode)
    common = ["--transport", args.transport, "--log-level", "WARNING"]
    return server_pair(log_dir, args.model, args.dtype, args.prefill_device or args.device, args.device,
                       common_args=common,
                       decode_args=decode[:-2])


def prompt_count(args, concurrency: int) -> int:
    """max(--min-prompts, --prompts-per-slot x concurrency), capped by --max-prompts when given."""
    n = max(args.min_prompts, args.prompts_per_slot * concurrency)
    return min(n, args.max_prompts) if args.max_prompts else n


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing (a run that failed before any token) or b is 0."""
    return a / b if a is not None and b else None


def sustained_speedup(r: dict, base: dict | None) -> dict:
    """The steady-state figures (serve.sustained): this run's, and its ratio to the baseline's (its whole-run figure
    when it has none: one request at a time is steady from the start)."""
    mine = r.get("sustained_output_throughput")
    theirs = None
    if base is not None:
        theirs = base.get("sustained_output_throughput")
        theirs = base.get("output_throughput") if theirs is None else theirs
    return {"sustained_tok_s": mine, "sustained_speedup_vs_max_batch_1": ratio(mine, theirs)}


def split_figures(r: dict) -> dict:
    """With --long-share: the short prompts' ITL (what a long prefill costs the others) and the long ones' TTFT."""
    split = r.get("by_length")
    if not split:
        return {}
    return {"short_p50_itl_ms": split["short"]["median_itl_ms"], "short_p99_itl_ms": split["short"]["p99_itl_ms"],
            "long_p50_ttft_ms": split["long"]["median_ttft_ms"], "long_p99_ttft_ms": split["long"]["p99_ttft_ms"],
            "long_completed": split["long"]["completed"]}


def summarize(args, runs: list[dict]) -> list[dict]:
    """One row per batching-server run: its figures beside the baseline's (same arm and concurrency, else the
    arm's largest baseline concurrency)."""
    summary = []
    for arm in args.arms.split(","):
        base = {r["max_concurrency"]: r for r in runs if r["arm"] == arm and r["server_max_batch"] == 1}
        for r in (r for r in runs if r["arm"] == arm and r["server_max_batch"] == args.max_batch):
            b = base.get(r["max_concurrency"]) or (base[max(base)] if base else None)
            batch = r.get("server_batch") or {}
            summary.append({"arm": arm, "concurrency": r["max_concurrency"], "output_tok_s": r["output_throughput"],
                            "baseline_max_batch_1_tok_s": b["output_throughput"] if b else None,
                            "speedup_vs_max_batch_1": ratio(r["output_throughput"], b and b["output_throughput"]),
                            **sustained_speedup(r, b),
                            "mean_batch": batch.get("mean_batch_per_step"),
                            "local_prefill_ms_mean": batch.get("local_prefill_ms_mean"),
                            "device_busy": batch.get("device_busy"),
                            **{k: r[k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")},
                            **split_figures(r)})
    return summary


def write_result(args, runs: list[dict], failures: list[str], complete: bool) -> dict:
    """OUT/result.json, rewritten after every run (complete: False until the last), so a sweep cut short by a
    time limit keeps the runs it finished; written aside, then moved in, so a kill mid-write leaves the last one."""
    result = {"kind": "serve_sweep", "ok": complete and not failures, "complete": complete, "failures": failures,
              "config": vars(args), "summary": summarize(args, runs), "runs": runs}
    path = os.path.join(args.out, "result.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return result


def progress_line(r: dict) -> str:
    """One JSON line per run for the log: the headline figures and the server's batch."""
    batch = r.get("server_batch") or {}
    keys = ("arm", "server_max_batch", "max_concurrency", "completed", "output_throughput",
            "sustained_output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    return json.dumps({k: r.get(k) for k in keys} | {k: batch.get(v) for k, v in (
        ("mean_batch", "mean_batch_per_step"), ("prefill_ms", "local_prefill_ms_mean"), ("device_busy", "device_busy"),
        ("mixed_steps", "mixed_steps_by_rows"))})


def run_servers(args, arm: str, max_batch: int, conc: str, runs: list[dict], failures: list[str]) -> None:
    """Fresh servers for (arm, max_batch); `serve` at each of `conc`; every run appended to `runs` and written."""
    port = free_port()
    t0 = time.perf_counter()
    logs = os.path.join(args.log_dir or os.path.join(args.out, "logs"), f"{arm}-{max_batch}")
    with arm_servers(arm, args, max_batch, logs, port) as run:
        started = time.perf_counter() - t0
        for c in map(int, conc.split(",")):
            n = args.baseline_prompts if max_batch == 1 and args.baseline_prompts else prompt_count(args, c)
            cfg = ServeConfig(addr=run.addr, num_prompts=n, concurrency=c, input_len=args.input_len,
                              input_len_range=args.input_len_range, output_len=args.output_len, model=args.model,
                              mode="auto", timeout_s=1200, max_duration_s=1200, long_share=args.long_share,
                              long_len=args.long_len_range,
                              server_metrics=f"http://127.0.0.1:{port}/metrics")
            r = run_serve(cfg)
            r.update(arm=arm, server_max_batch=max_batch, server_start_s=started)
            runs.append(r)
            failures += [f"{arm} max-batch {max_batch} c={c}: {f}" for f in r["failures"]]
            print(progress_line(r), file=sys.stderr, flush=True)
            write_result(args, runs, failures, complete=False)  # what a cut-short sweep still keeps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda:0", help="the colocated server and the pair's decode server")
    p.add_argument("--prefill-device", default="", help="the pair's prefill server (default: --device, one GPU "
                   "shared); cuda:1 for the two-GPU pair")
    p.add_argument("--transport", default="cuda_ipc", help="the pair's data plane")
    p.add_argument("--arms", default="colocated,pair")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--baseline-concurrency", default="1,32", help="concurrencies run against --max-batch 1 "
                   "('' runs no baseline)")
    p.add_argument("--baseline-prompts", type=int, default=0, help="prompts per baseline run (0: as the others); "
                   "one request at a time is stationary, so fewer do")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--input-len-range", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=128)
    add_long_prompt_flags(p)
    p.add_argument("--prompts-per-slot", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--max-prompts", type=non_negative, default=0, help="at most this many prompts per run "
                   "(0: no cap), e.g. 1024 with a large --prompts-per-slot: vLLM's bench sends 1,000")
    p.add_argument("--decode-args", default="", help="more decode-server flags for every arm, e.g. "
                   "'--prefill-chunk 256 --mixed-prefill'")
    p.add_argument("--baseline-decode-args", default=None, help="decode-server flags for the --max-batch 1 "
                   "baseline instead of --decode-args (e.g. '' to hold the baseline to a whole-prompt prefill)")
    p.add_argument("--out", required=True)
    p.add_argument("--log-dir", default="", help="server logs (default: OUT/logs)")
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program: `timeout` gets the stacks of it and its servers; result.json keeps what ran
        exit_on_sigterm()
        return exit_status(lambda: run(None))
    return run(argv)


def run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs, failures = [], []
    for arm in args.arms.split(","):
        for max_batch, conc in ((args.max_batch, args.concurrency), (1, args.baseline_concurrency)):
            if not conc.strip():
                continue
            try:
                run_servers(args, arm, max_batch, conc, runs, failures)
            except Exception as e:  # a server that did not start: recorded, the other arms still run
                if terminated() is not None:  # stopped by `timeout`: no more arms
                    raise
                failures.append(f"{arm} max-batch {max_batch}: {e}")
    result = write_result(args, runs, failures, complete=True)
    print(json.dumps({"ok": result["ok"], "failures": failures, "summary": result["summary"]}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
