"""The router's skew run on CPU: round robin vs least_loaded over the same two decode workers, side by side.

Two colocated `tiny` decode workers (float32, prefix cache off), one kvtransfer-router of each policy in front of
them; the skewed burst of bench/measure/router_skew.py (4 requests generating 300 tokens on alternating arrival
positions among 28 generating 4, 200-token prompts) goes through each router in turn, --repeats times, while both
workers' Load (running and remaining tokens) is sampled every 20 ms. Writes result.json beside this file (or
--out) and prints it.

    .venv/bin/python bench/results/router-skew-cpu-2026-12-02/run.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # the repository

from bench.measure.launch import free_port, spawn, stop, wait_serving  # noqa: E402
from bench.measure.router_skew import (  # noqa: E402
    LONG_NEW,
    LONGS,
    PROMPT,
    SHORT_NEW,
    SHORTS,
    TOLERANCE,
    run_skew,
    until_idle,
)

POLICIES = ("round_robin", "least_loaded")
FIGURES = ("running_tokens", "footprint_tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per policy (alternating)")
    ap.add_argument("--out", default=os.path.join(HERE, "result.json"))
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="kvt-router-skew-")
    procs, workers = [], []
    try:
        for i in range(2):
            addr = f"127.0.0.1:{free_port()}"
            procs.append(spawn("decode_server", ["--colocated", "--model", "tiny", "--dtype", "float32",
                                                 "--no-prefix-cache", "--listen", addr], f"{logs}/worker{i}.log"))
            workers.append(addr)
        routers = {}
        for policy in POLICIES:
            addr = f"127.0.0.1:{free_port()}"
            procs.append(spawn("router", ["--listen", addr, "--policy", policy,
                                          *[a for w in workers for a in ("--worker", w)]], f"{logs}/{policy}.log"))
            routers[policy] = addr
        for addr in [*workers, *routers.values()]:
            wait_serving(addr, procs, 300)
        runs = {p: [] for p in POLICIES}
        for _ in range(args.repeats):
            for policy, addr in routers.items():
                asyncio.run(until_idle(addr))
                r = asyncio.run(run_skew(addr, workers))
                runs[policy].append({"figures": r["figures"], "placed": r["placed"], "seconds": r["seconds"],
                                     "codes": r["codes"]})
                print(policy, json.dumps(runs[policy][-1]), flush=True)
    finally:
        stop(procs)
    summary = {p: {fig: {k: round(statistics.median(r["figures"][fig][k] for r in rs), 3)
                         for k in ("median", "mean", "within_tolerance")} for fig in FIGURES}
               for p, rs in runs.items()}
    result = {
        "what": "two colocated tiny decode workers behind kvtransfer-router; per 20 ms sample while either runs, "
                "|a - b| / mean(a, b) of the workers' Load.running_tokens (running_tokens) and of running_tokens + "
                "remaining_tokens (footprint_tokens); per run its median, mean, 90th percentile and the share of "
                f"samples within {TOLERANCE}; summary: the median over the runs of each",
        "workload": {"longs": LONGS, "long_new_tokens": LONG_NEW, "shorts": SHORTS, "short_new_tokens": SHORT_NEW,
                     "prompt_tokens": PROMPT, "long_positions": "0, 2, 4, 6 of the arrival order, 5 ms apart"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "tolerance": TOLERANCE,
        "summary": summary,
        "runs": runs,
        "ok": all(summary["least_loaded"][f]["median"] <= TOLERANCE < summary["round_robin"][f]["median"]
                  for f in FIGURES),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["summary"]))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
