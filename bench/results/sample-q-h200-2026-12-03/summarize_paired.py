"""Sampling against greedy from paired decode runs (DIR/decode-paired-N/result.json, `kvtransfer-bench decode
--temperature ...`, each cell timing greedy and sampling alternately in one process): per cell, each process's
greedy and sampling p50 (medians of its rounds) and sampling / greedy. python3 summarize_paired.py DIR"""
import glob
import json
import sys

runs = [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/decode-paired-*/result.json"))]
cells = {}
for r in runs:
    for c in r["cells"]:
        if c.get("sampling_over_greedy"):
            cells.setdefault((c["context"], c["batch"]), []).append(c)
print("| batch x context | floor ms | greedy p50 ms (each process) | sampling p50 ms (each process) | "
      "sampling / greedy (each process) |")
print("| --- | --- | --- | --- | --- |")
worst = 0.0
for (ctx, b), cs in sorted(cells.items()):
    worst = max([worst] + [c["sampling_over_greedy"] for c in cs])
    col = [" / ".join(f"{c[k]:.3f}" for c in cs) for k in ("step_ms_greedy_p50", "step_ms_p50", "sampling_over_greedy")]
    print(f"| {b} x {ctx} | {cs[0]['floor_ms']:.3f} | {col[0]} | {col[1]} | {col[2]} |")
print(f"\nWorst cell: {worst:.3f} ({len(runs)} processes; each figure the median of "
      f"{len(cs[0]['paired_rounds'])} alternating rounds of {runs[0]['config']['runs']} steps)")
