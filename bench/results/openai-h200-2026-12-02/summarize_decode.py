"""Greedy vs sampling step time from the decode runs under DIR (decode-greedy-N, decode-sampling-N): per cell, the
median of the rounds' p50s, and sampling / greedy. python3 summarize_decode.py DIR"""
import glob
import json
import statistics
import sys

base = sys.argv[1]
arms, floors = {}, {}
for arm in ("greedy", "sampling"):
    for f in sorted(glob.glob(f"{base}/decode-{arm}-*/result.json")):
        for c in json.load(open(f))["cells"]:
            if c.get("step_ms_p50"):
                arms.setdefault(arm, {}).setdefault((c["batch"], c["context"]), []).append(c["step_ms_p50"])
                floors[(c["batch"], c["context"])] = c["floor_ms"]
print("| batch x context | floor ms | greedy p50 ms (rounds) | sampling p50 ms (rounds) | sampling / greedy |")
print("| --- | --- | --- | --- | --- |")
for cell in sorted(arms["greedy"]):
    g, s = arms["greedy"][cell], arms["sampling"][cell]
    print(f"| {cell[0]} x {cell[1]} | {floors[cell]:.3f} | {' / '.join(f'{x:.3f}' for x in g)} | {' / '.join(f'{x:.3f}' for x in s)} | "
          f"{statistics.median(s) / statistics.median(g):.3f} |")
