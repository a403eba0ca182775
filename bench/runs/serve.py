"""Load against a running decode server, reported under the names `vllm bench serve` uses.

Why: `ttft` times one request at a time; a served model meets many at once. This sends
`num_prompts` prompts of random token ids (uniform in the server's vocabulary, lengths
uniform in input_len x [1 - r, 1 + r]) to the decode server's Generate, at most
`concurrency` in flight and/or arriving as a Poisson process of `request_rate` per second
(or, with `--api URL`, to the OpenAI front's /v1/completions: the same prompts through the HTTP door),
and reports ttft, tpot (time per output token after the first), itl (every gap between two
tokens) and e2el (request latency) as mean/median/std/p90/p99 in ms, with completed,
failed (counted by gRPC status code), duration and request/output/total token throughput:
the keys of vLLM's result JSON (mean_ttft_ms, p99_itl_ms, request_throughput,
output_throughput, ...), so a kvtransfer run reads beside a vLLM run. Beside them,
sustained_output_throughput: the steady state between the opening burst and the tail (`sustained`).
With `--multi-turn`: conversations whose turns resend their history, prefix cache off then on (serve_multiturn.py).
`--memory-pressure F` sizes the concurrency to F times the decode server's KV pool (a pool far smaller than the
load: preemption), `--shared-prefix N` opens every prompt with one N-token opening (blocks shared by reference);
either adds the pool's record to the result (bench/measure/pool_report.py: preemptions, shared blocks, reuse).
`--concurrency 64,128,256` runs the load once per value against the same server, one after the other (a sweep:
every run in result.json's `sweep`, a summary beside them, each run's files in OUT/c<N>/). `--roofline` (on by
default where this process sees a CUDA device and --model names a preset or directory) measures the bf16 GEMM rate
of the model's shapes right before the load and reports each run's output tok/s against the compute roofline
(bench/measure/roofline.py).
The load itself (prompts, schedule, result) is serve_load.py; the roofline beside it serve_roofline.py.
Bounded by design: loopback addresses only, at most MAX_PROMPTS prompts, one wall-clock
budget after which nothing new is sent and requests in flight end at their deadline.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.common import Job, Step, ints
from bench.report.kinds import tables_for
from bench.report.output import write_outputs
from bench.runs import serve_multiturn
from bench.runs.serve_config import MAX_PROMPTS, ServeConfig, is_loopback  # noqa: F401 (re-exported)
from bench.runs.serve_load import (METRICS, PERCENTILES, client_ends, config_record, make_prompts,  # noqa: F401
                                   run_serve, serve_result, sustained, total_steps)
from bench.runs.serve_roofline import RooflinePlan, measure_roofline, roofline_failure, roofline_plan, with_roofline


def length_range(text: str) -> tuple[int, int]:
    """LO,HI (tokens) for --long-len-range and --stop-after."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI in tokens, e.g. 16384,32768; got {text!r}") from None
    return lo, hi


def add_long_prompt_flags(p: argparse.ArgumentParser) -> None:
    """A share of long prompts in the load: shared by `serve` and `bench.runs.serve_sweep`."""
    p.add_argument("--long-share", type=float, default=0.0, help="this fraction of the prompts is long instead, "
                   "e.g. 0.05; TTFT and ITL are then reported for short and long prompts apart (default 0)")
    p.add_argument("--long-len-range", type=length_range, default=(16384, 32768),
                   help="a long prompt's length, uniform in LO,HI tokens (default 16384,32768)")



def run_one(cfg: ServeConfig, plan: RooflinePlan, step: Step, metadata) -> dict:
    """One concurrency: the roofline's GEMM rate (when on), then the load."""
    roof = measure_roofline(plan, step)
    return with_roofline(run_serve(cfg, step, metadata), cfg, plan, roof)


SUMMARY_KEYS = ("max_concurrency", "num_prompts", "completed", "failed", "not_sent", "output_throughput",
                "sustained_output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                "roofline_output_tok_s", "gemm_tflops", "of_roofline")


def sweep_result(cfgs: list[ServeConfig], runs: list[dict], failures: list[str], roof: dict,
                 complete: bool) -> dict:
    """A sweep's result: every run in `sweep` (each as a single run's result), one summary row per run; `ok` only
    when every run is and the sweep finished."""
    config = config_record(cfgs[0]) | {"concurrency": [c.concurrency for c in cfgs],
                                       "num_prompts": [c.num_prompts for c in cfgs]}
    return {"kind": "serve", "ok": complete and not failures, "complete": complete, "failures": failures,
            "config": config, "concurrencies": config["concurrency"], "roofline": roof,
            "summary": [{k: r.get(k) for k in SUMMARY_KEYS} for r in runs], "sweep": runs}


def run_sweep(cfgs: list[ServeConfig], plan: RooflinePlan, step: Step, metadata, out: str | None,
              command: str | None) -> dict:
    """Each config's load in turn against the same server, the roofline measured once before the first. A run that
    fails (or raises) is recorded and the next one runs. With `out`: each run's files in OUT/c<N>/ and OUT/result.json
    + report.md rewritten after every run (complete: false until the last), so a sweep cut short keeps what ran."""
    roof = measure_roofline(plan, step)
    runs, failures = [], roofline_failure(plan, roof)
    for cfg in cfgs:
        c = cfg.concurrency
        try:
            r = run_serve(cfg, lambda text, c=c: step(f"c={c} {text}"), metadata)
        except Exception as e:  # the next concurrency still runs
            r = serve_result(cfg, make_prompts(cfg), [], 0.0, [f"the run stopped: {type(e).__name__}: {e}"])
        r = with_roofline(r, cfg, RooflinePlan(plan.dims, plan.device, plan.why_not, False), roof)
        runs.append(r)
        failures += [f"c={c}: {f}" for f in r["failures"]]
        if out:
            r["outputs"] = write_outputs(os.path.join(out, f"c{c}"), r, tables_for(r), command)
            partial = sweep_result(cfgs, runs, failures, roof, complete=False)
            write_outputs(out, partial, tables_for(partial), command)
    return sweep_result(cfgs, runs, failures, roof, complete=True)


HELP = "load against a running decode server (vllm bench serve metrics)"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default="127.0.0.1:50051", help="the decode server (loopback only)")
    p.add_argument("--api", default="", help="send through the OpenAI front instead (kvtransfer-api): its base URL, "
                   "e.g. http://127.0.0.1:8000 (loopback only); the same prompts, as token ids to /v1/completions")
    p.add_argument("--server-metrics", default="", help="the decode server's /metrics URL (its --metrics-port): "
                   "report its batch size over the run")
    p.add_argument("--num-prompts", type=int, default=100, help="prompts per run")
    p.add_argument("--concurrency", type=concurrency_list, metavar="C[,C...]",
                   help="most requests in flight (default: no limit); a comma list, e.g. 64,128,256, runs the load "
                        "once per value against the same server, one after the other (a sweep: result.json's "
                        "`sweep` holds every run and `summary` a row each, OUT/c<N>/ each run's own files; a failed "
                        "run does not stop the next, but makes the exit status 1)")
    p.add_argument("--prompts-per-concurrency", type=int, metavar="K",
                   help="with --concurrency: each run sends max(--num-prompts, K x its concurrency) prompts, e.g. K 8 "
                        "at 64,128,256 sends 512, 1024, 2048 (add --num-prompts 1 for exactly K x C); without it "
                        "every run sends --num-prompts")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s (default inf)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--input-len-range", type=float, default=0.0, help="r: lengths uniform in len*[1-r, 1+r]")
    p.add_argument("--output-len", type=int, default=16)
    add_long_prompt_flags(p)
    p.add_argument("--vocab-size", type=int, help="token ids uniform in [0, vocab) (or give --model)")
    p.add_argument("--model", help="the server's --model (preset or local dir): its vocabulary and context")
    p.add_argument("--mode", default="auto", help="auto, layerwise, bulk or colocated")
    p.add_argument("--memory-pressure", type=float, default=0.0, metavar="F",
                   help="size the concurrency (unless --concurrency is given) so that the requests in flight need F "
                        "times the decode server's KV pool (asked from its Info), e.g. 4: a pool far smaller than "
                        "the load, so requests are preempted; the result's `pool` says how many (default 0: off)")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt opens with one opening of N random ids, then its own --input-len: N requests "
                        "over one long opening share its KV blocks; the result's `pool` says how many (default 0)")
    p.add_argument("--stop-after", type=length_range, metavar="LO,HI",
                   help="each request asks --output-len tokens and its client ends it (cancels the stream) after a "
                        "number uniform in LO..HI, e.g. --output-len 4096 --stop-after 1,4096: answers the server "
                        "cannot size in advance (a reader who stops reading); the result's `pool` says what the "
                        "pool did (gRPC door only)")
    p.add_argument("--warmup", type=int, default=1, help="requests before the clock starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: every request samples at this temperature, the server drawing its seed (default 0: "
                        "greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling's top_p")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, s")
    p.add_argument("--max-duration", type=float, default=600.0, help="whole run (each concurrency's, in a sweep), s; "
                   "later requests are not sent")
    p.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the bf16 GEMM rate of --model's layer shapes (and lm_head) at 2,048 rows in this "
                        "process right before the load, and report each run's output tok/s against the compute "
                        "roofline: that rate over the FLOPs per request (bench/measure/roofline.py says what is "
                        "counted) x --output-len. Default: on where this process sees a CUDA device and --model is "
                        "given, else off with the reason in the report; --roofline where it cannot run is an error")
    p.add_argument("--roofline-device", default="cuda", help="the GPU the rate is measured on: the server's "
                   "(cuda: this process's current one)")
    p.add_argument("--auth-token", help="bearer token, when the server requires one (the API key, with --api)")
    p.add_argument("--auth-token-file")
    p.add_argument("--out", help="write result.json and report.md in this directory")
    p.add_argument("--multi-turn", action="store_true", help="conversations instead: --num-prompts of them, each "
                   "turn's prompt the previous prompt + its answer + --user-len new ids; run prefix cache off "
                   "(skip_prefix_cache, the baseline) then on, compared (bench/runs/serve_multiturn.py)")
    p.add_argument("--turns", type=int, default=argparse.SUPPRESS,  # absent unless given
                   help="with --multi-turn: turns per conversation (default 6)")
    p.add_argument("--user-len", type=int, default=argparse.SUPPRESS,
                   help="with --multi-turn: new user tokens a later turn adds (default 256)")


def concurrency_list(text: str) -> list[int]:
    """--concurrency: one value, or a comma list of distinct values >= 1 (a sweep)."""
    values = ints(text)
    if not values or min(values) < 1 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1, e.g. 64 or 64,128,256; got {text!r}")
    return values


def prompt_counts(args: argparse.Namespace) -> list[int]:
    """Prompts per run: --num-prompts, or with --prompts-per-concurrency K max(--num-prompts, K x concurrency)."""
    k, concs = args.prompts_per_concurrency, args.concurrency
    if k is None:
        return [args.num_prompts] * len(concs or [None])
    if k < 1 or not concs:
        raise ValueError("--prompts-per-concurrency K needs K >= 1 and --concurrency (it sends K x concurrency)")
    counts = [max(args.num_prompts, k * c) for c in concs]
    if max(counts) > MAX_PROMPTS:
        raise ValueError(f"--prompts-per-concurrency {k} x --concurrency {max(concs)} is {max(counts)} prompts, over "
                         f"{MAX_PROMPTS}: lower K")
    return counts


def configs(args: argparse.Namespace) -> list[ServeConfig]:
    """One config per --concurrency value (one, with no limit, when it is not given)."""
    return [config(args, c, n) for c, n in zip(args.concurrency or [None], prompt_counts(args))]


def config(args: argparse.Namespace, concurrency: int | None = None, num_prompts: int | None = None) -> ServeConfig:
    """`serve`'s flags as its config (the first --concurrency's unless given); ValueError (a usage error, exit 2) says
    which flag to fix."""
    if concurrency is None and args.concurrency:
        concurrency = args.concurrency[0]
    return ServeConfig(addr=args.addr, num_prompts=num_prompts or args.num_prompts, concurrency=concurrency,
                       request_rate=args.request_rate, input_len=args.input_len, input_len_range=args.input_len_range,
                       output_len=args.output_len, vocab_size=args.vocab_size, model=args.model, mode=args.mode,
                       warmup=args.warmup, seed=args.seed, timeout_s=args.timeout, max_duration_s=args.max_duration,
                       server_metrics=args.server_metrics, long_share=args.long_share, long_len=args.long_len_range,
                       api=args.api, temperature=args.temperature, top_p=args.top_p,
                       shared_prefix=args.shared_prefix, memory_pressure=args.memory_pressure,
                       stop_after=args.stop_after)


def job(args: argparse.Namespace) -> Job:
    cfgs = configs(args)
    cfg = cfgs[0]
    try:
        token = args.auth_token or (Path(args.auth_token_file).read_text().strip() if args.auth_token_file else "")
    except OSError as e:  # a usage error too: the flag names a file that cannot be read
        raise ValueError(str(e)) from None
    meta = (("authorization", f"Bearer {token}"),) if token else None  # kept out of the result
    if args.multi_turn or "turns" in args or "user_len" in args:  # its own checks and run
        if len(cfgs) > 1 or args.roofline or args.prompts_per_concurrency or cfg.memory_pressure or cfg.shared_prefix:
            raise ValueError("--multi-turn runs one --concurrency, without --roofline, --prompts-per-concurrency, "
                             "--memory-pressure or --shared-prefix")
        return serve_multiturn.job(args, cfg, meta)
    plan = roofline_plan(args, cfg)
    steps = sum(total_steps(c) for c in cfgs) + (0 if plan.why_not else 1)
    if len(cfgs) == 1:
        return Job(steps, lambda step: run_one(cfg, plan, step, meta))
    return Job(steps, lambda step: run_sweep(cfgs, plan, step, meta, args.out, getattr(args, "command_line", None)))
