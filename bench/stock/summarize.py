"""Read guidellm's own result file (benchmarks.json, written by `guidellm run --output kind=json`) and write a
short summary JSON: output tok/s, TTFT, ITL, TPOT, request counts, and the token counts actually sent/received.

Stdlib only, so any python3 runs it (it never imports guidellm or anything from this repo):

    python3 bench/stock/summarize.py OUT/benchmarks.json [--out OUT/summary.json] [--expect-output-tokens 128]

What guidellm's numbers mean (guidellm 0.8.1, guidellm/schemas/base/request_stats.py):
- ttft: request sent -> first streamed token, per request.
- itl: guidellm's "inter-token latency" is one value PER REQUEST, (last token - first token) / (output tokens - 1),
  and its distribution weights each request by its output tokens - 1. That is what vLLM's bench and this repo's
  `bench serve` call TPOT; their "ITL" is every gap between two streamed tokens, whose p99 is larger. guidellm
  keeps no per-token timestamps, so the per-gap ITL cannot be recovered from its file.
- tpot: guidellm's "time per output token" INCLUDES the first token: (last token - request start) / output tokens.
- output tok/s: output tokens of the successful requests / the benchmark's duration (guidellm's
  output_tokens_per_second.successful.mean; recomputed from the totals as a check).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _dist(d: dict | None, scale: float = 1.0) -> dict:
    """p50/p90/p99/mean/min/max of one guidellm distribution summary (None where guidellm had no values)."""
    if not d or not d.get("count"):
        return {"count": 0}
    pct = d.get("percentiles") or {}

    def s(x):
        return None if x is None else round(x * scale, 3)

    return {"count": d["count"], "p50": s(pct.get("p50", d.get("median"))), "p90": s(pct.get("p90")),
            "p99": s(pct.get("p99")), "mean": s(d.get("mean")), "min": s(d.get("min")), "max": s(d.get("max"))}


def summarize_benchmark(bench: dict) -> dict:
    m = bench["metrics"]
    totals = m["request_totals"]
    duration = bench.get("duration") or (bench["end_time"] - bench["start_time"])
    out_tok = m["output_token_count"]["successful"]
    strategy = (bench.get("config") or {}).get("strategy") or {}
    return {
        "strategy": {k: v for k, v in strategy.items() if k in ("type_", "streams", "rate", "max_concurrency")},
        "requests": {"completed": totals["successful"], "failed": totals["errored"],
                     "incomplete": totals["incomplete"], "total": totals["total"]},
        "duration_s": round(duration, 3),
        "output_tokens_per_s": round(m["output_tokens_per_second"]["successful"]["mean"], 2),
        "output_tokens_per_s_from_totals": round((out_tok.get("total_sum") or 0.0) / duration, 2) if duration else None,
        "total_tokens_per_s": round(m["tokens_per_second"]["successful"]["mean"], 2),
        "requests_per_s": round(m["requests_per_second"]["successful"]["mean"], 3),
        "concurrency_mean": round(m["request_concurrency"]["successful"]["mean"], 2),
        "ttft_ms": _dist(m["time_to_first_token_ms"]["successful"]),
        "itl_ms": _dist(m["inter_token_latency_ms"]["successful"]),
        "tpot_ms": _dist(m["time_per_output_token_ms"]["successful"]),
        "e2el_ms": _dist(m["request_latency"]["successful"], 1000.0),
        "prompt_tokens": _dist(m["prompt_token_count"]["successful"]),
        "output_tokens": _dist(out_tok),
        # guidellm's own health checks of the load it generated (e.g. root_late: prompts dispatched late, so the
        # client, not the server, may have bounded the run; compare concurrency_mean with the streams asked for)
        "tool_warnings": [w.get("message") or w.get("code") for w in bench.get("warnings") or []],
    }


def summarize(report: dict, source: str) -> dict:
    benches = report.get("benchmarks") or []
    if not benches:
        raise ValueError(f"{source}: no benchmarks in guidellm's report")
    spec = (report.get("config") or {}).get("spec") or {}
    backend = spec.get("backend") or {}
    first = benches[0]["config"].get("backend") or backend
    out = {
        "tool": "guidellm",
        "tool_version": (report.get("metadata") or {}).get("guidellm_version"),
        "source": source,
        "target": first.get("target") or backend.get("target"),
        "model": first.get("model") or backend.get("model"),
        "endpoint": first.get("request_format") or backend.get("request_format"),
        "tokenizer": (spec.get("tokenizer") or {}).get("model"),
        "data": [{k: v for k, v in d.items() if v not in (None, [], {}) and k != "load_kwargs"}
                 for d in spec.get("data") or []],
        "metric_notes": {
            "itl_ms": "guidellm ITL: per-request (last-first token)/(n-1), token-weighted; = vLLM/bench-serve TPOT, "
                      "not per-gap ITL",
            "tpot_ms": "guidellm TPOT: per-request (last token - request start)/n, includes TTFT",
        },
    }
    rows = [summarize_benchmark(b) for b in benches]
    out.update(rows[0] if len(rows) == 1 else {"benchmarks": rows})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="guidellm's benchmarks.json")
    ap.add_argument("--out", help="where to write the summary (default: print only)")
    ap.add_argument("--expect-output-tokens", type=int, default=0,
                    help="exit 3 if any completed request's output token count differs from this")
    ap.add_argument("--expect-requests", type=int, default=0,
                    help="exit 3 if fewer requests completed than this, or any failed")
    ap.add_argument("--expect-prompt-min", type=int, default=0,
                    help="exit 3 if a completed request's prompt had fewer than 90%% of this many tokens (e.g. "
                         "prompts sent empty: guidellm's synthetic text with a tokenizer that has no English)")
    args = ap.parse_args(argv)
    summary = summarize(json.loads(Path(args.report).read_text()), args.report)
    problems = []
    rows = summary.get("benchmarks") or [summary]
    for row in rows:
        if args.expect_output_tokens:
            o = row["output_tokens"]
            if o.get("count") and (o["min"] != args.expect_output_tokens or o["max"] != args.expect_output_tokens):
                problems.append(f"output tokens per request {o['min']}..{o['max']}, expected exactly "
                                f"{args.expect_output_tokens} (is ignore_eos honoured?)")
        if args.expect_prompt_min:
            p = row["prompt_tokens"]
            if not p.get("count") or p["min"] < 0.9 * args.expect_prompt_min:
                problems.append(f"prompt tokens per request {p.get('min')}..{p.get('max')}, expected at least "
                                f"{args.expect_prompt_min} (empty prompts? try --prompts vocab)")
        if args.expect_requests:
            r = row["requests"]
            if r["completed"] < args.expect_requests or r["failed"] or r["incomplete"]:
                problems.append(f"requests {r}, expected {args.expect_requests} completed and none failed")
    summary["checks"] = problems or "ok"
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    for p in problems:
        print(f"summarize: {p}", file=sys.stderr)
    return 3 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
