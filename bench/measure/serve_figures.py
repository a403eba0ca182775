"""The figures of a `serve` run computed from its request records: vLLM's latency keys, the short/long split and
the steady state.

Why apart from the run (bench/runs/serve.py): the figures are pure functions of the records (each request's
input_len, start, token arrival times and failure code), so they are tested without a server, and
`serve --multi-turn` (bench/measure/multiturn_stats.py) reports its TTFT under the same keys from the same code.
"""

from __future__ import annotations

from bench.measure.stats import summarize

PERCENTILES = (90, 99)


def ttft_and_itl(done: list[dict]) -> tuple[list[float], list[float]]:
    """Each request's first-token time, and every gap between two tokens, in s."""
    return [r["times"][0] for r in done], [b - a for r in done for a, b in zip(r["times"], r["times"][1:])]


def by_length(done: list[dict], long_from: int) -> dict:
    """TTFT and ITL of the short and the long prompts apart: what a long prefill costs the others shows in the
    short ones' ITL, hidden in a mixed p99."""
    out = {}
    for name, rows in (("short", [r for r in done if r["input_len"] < long_from]),
                       ("long", [r for r in done if r["input_len"] >= long_from])):
        ttft, itl = ttft_and_itl(rows)
        out[name] = {"completed": len(rows), **summary(ttft, "ttft"), **summary(itl, "itl")}
    return out


def summary(xs: list[float], name: str) -> dict:
    """vLLM's keys: mean/median/std/pNN of one metric, in ms (None when nothing completed)."""
    s = summarize(xs, scale=1e3, percentiles=PERCENTILES)
    return {f"{k}_{name}_ms": s[k] for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))}


def sustained(sent: list[dict], concurrency: int) -> dict:
    """Output tok/s over the run's middle, while every one of `concurrency` clients had a request in flight: from the
    first re-send (the (c+1)-th send: the first completion, so the opening burst of c prompts at once is behind) to
    the last send (after it, clients go idle one by one as the prompts run out). A finite run's whole-run figure
    pays for that opening burst and that tail; this is the steady state between them. None when the window is
    empty (num_prompts <= concurrency + 1), holds no token (the re-sends all came in one burst: requests that
    finished in the same step), or there is no concurrency bound."""
    starts = sorted(r["start"] for r in sent)
    if not concurrency or len(starts) <= concurrency + 1:
        return {"sustained_output_throughput": None, "sustained_window_s": None}
    lo, hi = starts[concurrency], starts[-1]
    tokens = sum(lo <= r["start"] + t < hi for r in sent if r["code"] is None for t in r["times"])
    rate = tokens / (hi - lo) if hi > lo and tokens else None
    return {"sustained_output_throughput": rate, "sustained_window_s": hi - lo}
