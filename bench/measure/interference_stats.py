"""Interference figures from client-side token times: pure functions, no servers, no clocks.

Why apart from the driver: what counts as a stall or as goodput is the claim the bench makes,
so it is defined once here, on plain lists of seconds, and unit-tested on synthetic times.

Definitions (docs/architecture.md, "Interference: ITL, stall, goodput"; every time is the client's
perf_counter, seconds):
- a gap is (a, b): two consecutive tokens of one request; its ITL is b - a. The streams' gaps are
  measured from `start` (every stream had its first token: the ramp-up is not measured) to
  `stop` (streams cancelled): a gap counts when start <= a and b <= stop.
- a prefill window is [sent, first token] of one long prompt, as the client saw it.
- a gap overlaps a window when a < window end and b > window start (open intervals: a gap that
  merely touches a window's edge is outside it). Outside = overlapping no window at all.
- stall of an arrival: the longest ITL of any stream gap overlapping its window.
- goodput: the share of requests (streams + long prompts) meeting both SLOs. A request meets the
  ITL SLO when its MAX ITL (not p99: one stall per arrival is what this bench is about) is
  <= itl_slo; a request with no gap meets it. A long prompt meets the TTFT SLO when sent ->
  first token <= ttft_slo. Streams are judged on ITL only: their first tokens come during the
  ramp-up, before any long prompt is sent, so their TTFT measures the setup, not interference.
"""

from __future__ import annotations

import math

from bench.measure.stats import percentile, summarize

Gap = tuple[float, float]
Window = tuple[float, float]


def gaps(times: list[float], start: float = -math.inf, stop: float = math.inf) -> list[Gap]:
    """Consecutive-token gaps (a, b) of one request with start <= a and b <= stop."""
    return [(a, b) for a, b in zip(times, times[1:]) if a >= start and b <= stop]


def overlaps(gap: Gap, window: Window) -> bool:
    return gap[0] < window[1] and gap[1] > window[0]


def summary_ms(itls_s: list[float]) -> dict:
    """{p50, p99, max, n} of ITLs given in seconds, reported in ms (None when empty)."""
    s = summarize(itls_s, scale=1e3, percentiles=(50, 99))
    return {k: s[k] for k in ("p50", "p99", "max", "n")}


def outside(all_gaps: list[Gap], windows: list[Window]) -> list[Gap]:
    return [g for g in all_gaps if not any(overlaps(g, w) for w in windows)]


def arrival_figures(all_gaps: list[Gap], window: Window, outside_gaps: list[Gap]) -> dict:
    """One long prompt: TTFT, stall (max ITL overlapping its window), ITL p99 inside, max outside all windows."""
    inside = [b - a for a, b in all_gaps if overlaps((a, b), window)]
    out = [b - a for a, b in outside_gaps]
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731
    return {"ttft_ms": (window[1] - window[0]) * 1e3, "stall_ms": ms(max(inside, default=None)),
            "gaps_in_window": len(inside), "itl_p99_in_window_ms": ms(percentile(inside, 99)),
            "itl_max_outside_ms": ms(max(out, default=None))}


def meets(ttft_s: float | None, max_itl_s: float | None, ttft_slo_s: float, itl_slo_s: float) -> bool:
    """Both SLOs; None means not judged on that one (a stream's TTFT, a request without gaps)."""
    return (ttft_s is None or ttft_s <= ttft_slo_s) and (max_itl_s is None or max_itl_s <= itl_slo_s)


def goodput(streams: list[list[Gap]], longs: list[dict], ttft_slo_ms: float, itl_slo_ms: float) -> dict:
    """`streams`: each stream's measured gaps; `longs`: {"ttft_s", "gaps"} per long prompt (see the module doc)."""
    t, i = ttft_slo_ms / 1e3, itl_slo_ms / 1e3
    max_itl = lambda gs: max((b - a for a, b in gs), default=None)  # noqa: E731
    s_ok = sum(meets(None, max_itl(g), t, i) for g in streams)
    l_ttft = sum(meets(r["ttft_s"], None, t, i) for r in longs)
    l_itl = sum(meets(None, max_itl(r["gaps"]), t, i) for r in longs)
    l_ok = sum(meets(r["ttft_s"], max_itl(r["gaps"]), t, i) for r in longs)
    n = len(streams) + len(longs)
    return {"share": (s_ok + l_ok) / n if n else None, "met": s_ok + l_ok, "requests": n,
            "streams_met_itl": s_ok, "streams": len(streams), "long_met_ttft": l_ttft, "long_met_itl": l_itl,
            "long_met_both": l_ok, "long": len(longs), "ttft_slo_ms": ttft_slo_ms, "itl_slo_ms": itl_slo_ms,
            "itl_rule": "max ITL of the request <= itl_slo_ms", "stream_ttft": "not judged (ramp-up)"}


def timeline(all_gaps: list[Gap], window: Window, margin_s: float, bins: int = 200) -> dict:
    """Streams' ITL around one arrival for the plot: per time bin, the largest ITL of the gaps ending in it.

    x: gap end relative to the arrival (s), over [-margin, ttft + margin]; y: ITL in ms."""
    lo, hi = -margin_s, (window[1] - window[0]) + margin_s
    width = (hi - lo) / bins
    top: dict[int, float] = {}
    for a, b in all_gaps:
        rel = b - window[0]
        if lo <= rel <= hi:
            k = min(int((rel - lo) / width), bins - 1)
            top[k] = max(top.get(k, 0.0), b - a)
    ks = sorted(top)
    return {"t_s": [round(lo + (k + 0.5) * width, 5) for k in ks], "itl_ms": [round(top[k] * 1e3, 3) for k in ks],
            "window_s": [0.0, round(window[1] - window[0], 5)], "bin_s": width}


def arm_figures(stream_times: list[list[float]], longs: list[dict], start: float, stop: float,
                ttft_slo_ms: float, itl_slo_ms: float, margin_s: float) -> dict:
    """Everything one arm reports. `longs`: {"kind", "tokens", "sent", "times"} per long prompt, in send order."""
    per_stream = [gaps(ts, start, stop) for ts in stream_times]
    all_gaps = [g for gs in per_stream for g in gs]
    windows = [(r["sent"], r["times"][0]) for r in longs]
    out_gaps = outside(all_gaps, windows)
    arrivals = [{"kind": r["kind"], "tokens": r["tokens"], "sent_s": r["sent"] - start}
                | arrival_figures(all_gaps, w, out_gaps) for r, w in zip(longs, windows)]
    good = goodput(per_stream, [{"ttft_s": w[1] - w[0], "gaps": gaps(r["times"], stop=stop)}
                                for r, w in zip(longs, windows)], ttft_slo_ms, itl_slo_ms)
    return {"itl_ms": summary_ms([b - a for a, b in all_gaps]),
            "itl_outside_ms": summary_ms([b - a for a, b in out_gaps]),
            "arrivals": arrivals, "goodput": good["share"], "goodput_detail": good,
            "timeline": {"arrivals": [{"kind": r["kind"], "tokens": r["tokens"]} | timeline(all_gaps, w, margin_s)
                                      for r, w in zip(longs, windows)]},
            "measured_s": stop - start}
