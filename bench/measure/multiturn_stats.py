"""The figures of `serve --multi-turn` from one pass's turn records (bench/measure/conversations.py).

Why these: what a prefix cache changes is the turns that have a history to reuse, so TTFT is given per turn index
and over turns >= 2 (turn 1 has no earlier turn; it is the same with the cache on or off), and the reuse figures
(hits by tier, tokens reused, bytes reloaded) count turns >= 2 only. TTFT is the client's, request sent -> first
token received, under `serve`'s keys (bench/measure/serve_figures.py); where a prefix came from is the server's
word (the last message's Timing.reuse_tier). The split by tier and prompt length shows what the average hides: a
device hit, a reload from the host tier and a recompute cost differently, and the gap grows with the prefix.
Pure functions of the records: tested without a server.
"""

from __future__ import annotations

from collections import Counter

from bench.measure.serve_figures import summary
from bench.measure.stats import median

LENGTH_EDGES = (1024, 2048, 3072, 4096, 6144, 8192, 16384, 32768)  # prompt tokens: columns <1k, 1-2k, .. 32k+
TIERS = ("device", "host", "none")  # conversations.tier_name of CacheTier DEVICE, HOST, NONE


def length_bucket(n: int) -> str:
    """The prompt-length column of a prompt of n tokens."""
    lo = 0
    for hi in LENGTH_EDGES:
        if n < hi:
            return f"<{hi // 1024}k" if lo == 0 else f"{lo // 1024}-{hi // 1024}k"
        lo = hi
    return f"{lo // 1024}k+"


BUCKETS = (*(length_bucket(e - 1) for e in LENGTH_EDGES), length_bucket(LENGTH_EDGES[-1]))  # in order


def ttft(done: list[dict]) -> dict:
    """completed, and the TTFT of these completed turns under vLLM's keys (mean/median/std/p90/p99_ttft_ms)."""
    return {"completed": len(done), **summary([r["times"][0] for r in done], "ttft")}


def by_tier_and_length(done: list[dict]) -> dict:
    """{tier: {length bucket: {count, median_ttft_ms}}}: every tier of TIERS (and any other the server named),
    the buckets where it has turns, in BUCKETS order."""
    groups: dict[str, dict[str, list[float]]] = {}
    for r in done:
        groups.setdefault(r["reuse_tier"], {}).setdefault(length_bucket(r["input_len"]), []).append(r["times"][0])
    tiers = [*TIERS, *sorted(set(groups) - set(TIERS))]
    return {t: {b: {"count": len(xs), "median_ttft_ms": median(xs) * 1e3}
                for b in BUCKETS if (xs := groups.get(t, {}).get(b))} for t in tiers}


def request_row(r: dict, start: float) -> dict:
    """One turn as result.json keeps it (no token ids)."""
    return {"conversation": r["conversation"], "turn": r["turn"], "input_len": r["input_len"],
            "output_len": len(r["times"]), "start_s": r["start"] - start,
            "ttft_ms": r["times"][0] * 1e3 if r["times"] else None, "reused_tokens": r["reused_tokens"],
            "reuse_tier": r["reuse_tier"], "reload_bytes": r["reload_bytes"], "code": r["code"]}


def pass_figures(run: dict, turns: int) -> dict:
    """One pass (conversations.run_pass's dict) as its result keys."""
    records, duration = run["records"], run["duration"]
    done = [r for r in records if r["code"] is None]
    later = [r for r in done if r["turn"] >= 2]
    codes = Counter(r["code"] for r in records if r["code"])
    t_out = sum(len(r["times"]) for r in done)
    reused = sum(r["reused_tokens"] for r in later)
    later_in = sum(r["input_len"] for r in later)
    host_hits = sum(r["reuse_tier"] == "host" for r in later)
    reload = sum(r["reload_bytes"] for r in later)
    return {"completed": len(done), "failed": sum(codes.values()), "failed_by_code": dict(codes),
            "conversations_failed": len({r["conversation"] for r in records if r["code"]}),
            "not_sent": run["not_sent"], "abandoned": run["abandoned"], "duration": duration,
            "total_input_tokens": sum(r["input_len"] for r in done), "total_output_tokens": t_out,
            "request_throughput": len(done) / duration if duration else None,
            "output_throughput": t_out / duration if duration else None,
            "ttft_by_turn": [{"turn": k, **ttft([r for r in done if r["turn"] == k])} for k in range(1, turns + 1)],
            "ttft_turns_2plus": ttft(later),
            "hits_by_tier": dict.fromkeys(TIERS, 0) | Counter(r["reuse_tier"] for r in later),
            "reused_tokens": {"sum": reused, "mean_per_turn": reused / len(later) if later else None,
                              "share_of_prompt_tokens": reused / later_in if later_in else None},
            "turn1_reused_tokens": sum(r["reused_tokens"] for r in done if r["turn"] == 1),
            "reload_bytes": {"sum": reload, "mean_per_host_hit": reload / host_hits if host_hits else None},
            "ttft_by_tier_and_length": by_tier_and_length(later),
            "modes_ran": dict(Counter(r["mode"] for r in done)),
            "errors": sorted({f"{r['code']}: {r['error']}" for r in records if r["code"]})[:10],
            "requests": [request_row(r, run["start"]) for r in records]}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def headline(baseline: dict, reuse: dict) -> dict:
    """The two figures a prefix cache is for, each as a ratio that reads > 1 when reuse helps: TTFT p50 over
    turns >= 2, baseline / reuse; output throughput, reuse / baseline (the inverse of baseline / reuse)."""
    b, r = baseline["ttft_turns_2plus"]["median_ttft_ms"], reuse["ttft_turns_2plus"]["median_ttft_ms"]
    bt, rt = baseline["output_throughput"], reuse["output_throughput"]
    return {"ttft_p50_turns_2plus_ms": {"baseline": b, "reuse": r},
            "ttft_p50_turns_2plus_baseline_over_reuse": ratio(b, r),
            "output_throughput": {"baseline": bt, "reuse": rt},
            "output_throughput_reuse_over_baseline": ratio(rt, bt)}
