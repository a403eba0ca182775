"""Print the scheduler's passes around a long prompt's end from a KVT_TRACE file (sitecustomize.py).

    python -m bench.probes.sched_trace.report TRACE[.gz] [--before-ms 400] [--after-ms 200]

One line per wrapped call, in host order: its start and length on the host (ms, from the long prompt's last
forward), its device length where it queued device work (the CUDA events around it: `gpu ms`), and, for each
`deliver`, the gap since the previous one (what every running stream waits between two tokens). Then the longest
delivery gap and loop lags in the window; the long prompt's pieces (its last `pieces` forwards: the first, the
median and the last, host and device ms); and the longest delivery gaps of the whole trace, in case the stall
lies outside the window (call 11's first run: the prompt's first piece).
"""

import argparse
import gzip
import json
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--before-ms", type=float, default=400)
    p.add_argument("--after-ms", type=float, default=200)
    p.add_argument("--pieces", type=int, default=63, help="the long prompt's forwards: ceil(tokens / chunk)")
    a = p.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs.sort(key=lambda r: r["t0"])
    adds = [r for r in recs if r["k"] == "add"]
    long_add = max(adds, key=lambda r: r["n"])
    forwards = [r for r in recs if r["k"] == "forward" and r["t0"] < long_add["t0"]]
    t_ref = forwards[-1]["t0"]
    lo, hi = t_ref - a.before_ms / 1e3, long_add["t0"] + a.after_ms / 1e3
    print(f"long prompt: {long_add['n']} tokens; times in ms from its last forward's launch; "
          f"{len(forwards)} forwards before it joined")
    last_deliver, gaps = None, []
    for r in recs:
        if not lo <= r["t0"] <= hi:
            continue
        gpu = f"gpu {r['g1'] - r['g0']:7.2f}" if "g1" in r and "g0" in r else " " * 11
        at = f" @gpu {r['g0']:.1f}" if "g0" in r else ""
        extra = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("k", "t0", "t1", "g0", "g1"))
        gap = ""
        if r["k"] == "deliver":
            if last_deliver is not None:
                gaps.append((r["t1"] - last_deliver, r["t1"]))
                gap = f"gap {(r['t1'] - last_deliver) * 1e3:7.1f}"
            last_deliver = r["t1"]
        print(f"{(r['t0'] - t_ref) * 1e3:9.1f} {r['k']:<10} host {((r.get('t1', r['t0']) - r['t0']) * 1e3):7.2f} "
              f"{gpu} {gap:<12} {extra}{at}")
    if gaps:
        g, t = max(gaps)
        print(f"longest delivery gap {g * 1e3:.1f} ms, ending at {(t - t_ref) * 1e3:.1f} ms")
    lags = [r for r in recs if r["k"] == "loop_lag" and lo <= r["t0"] <= hi]
    if lags:
        worst = max(lags, key=lambda r: r["t1"] - r["t0"])
        print(f"event loop late {len(lags)} times; worst {(worst['t1'] - worst['t0']) * 1e3:.1f} ms at "
              f"{(worst['t0'] - t_ref) * 1e3:.1f} ms")
    pieces = forwards[-a.pieces:]
    host = [(r["t1"] - r["t0"]) * 1e3 for r in pieces]
    dev = [r["g1"] - r["g0"] if "g1" in r and "g0" in r else float("nan") for r in pieces]
    print(f"the long prompt's {len(pieces)} pieces, host / gpu ms: first {host[0]:.1f} / {dev[0]:.1f}, median "
          f"{statistics.median(host):.1f} / {statistics.median(dev):.1f}, last {host[-1]:.1f} / {dev[-1]:.1f}")
    last_deliver, every = None, []
    for r in recs:
        if r["k"] == "deliver":
            if last_deliver is not None:
                every.append((r["t1"] - last_deliver, r["t1"]))
            last_deliver = r["t1"]
    top = ", ".join(f"{g * 1e3:.1f} ms ending at {(t - t_ref) * 1e3:.1f}" for g, t in sorted(every, reverse=True)[:3])
    print(f"longest delivery gaps of the whole trace: {top}; the first piece launched at "
          f"{(pieces[0]['t0'] - t_ref) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
