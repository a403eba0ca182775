"""TTFT p50 by turn (each turn's prompt length is exact here) and by where its prefix came from, from the
per-request rows of `kvtransfer-bench serve --multi-turn` result.json files: `python3 by_turn.py RESULT.json ...`."""

import json
import statistics
import sys

for path in sys.argv[1:]:
    r = json.load(open(path))
    print(f"\n{path}\n\n| turn | prompt tokens | recompute (reuse off) | device hit | host reload | recompute (reuse on) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = {}
    for name, p in r["passes"].items():
        for q in p["requests"]:
            if q["ttft_ms"] is not None:
                rows.setdefault((q["turn"], q["input_len"]), {}).setdefault((name, q["reuse_tier"]), []).append(q["ttft_ms"])
    for (turn, n), cells in sorted(rows.items()):
        def cell(key):
            xs = cells.get(key)
            return f"{statistics.median(xs):,.0f} ms ({len(xs)})" if xs else "-"
        print(f"| {turn} | {n:,} | {cell(('baseline', 'none'))} | {cell(('reuse', 'device'))} | "
              f"{cell(('reuse', 'host'))} | {cell(('reuse', 'none'))} |")
