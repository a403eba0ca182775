"""The `serve_multiturn` result (bench/runs/serve_multiturn.py): reuse off against reuse on, as tables (no chart).

Why these tables: the question is what the prefix cache buys a turn that resends its history. So the two passes
stand side by side, the headline is the two ratios that read > 1 when reuse helps, TTFT is split by turn index
(turn 1 never reuses; later turns carry more history), and the last tables split the TTFT of turns >= 2 by where
the server found the prefix (a device hit, a reload from the host tier, or none: recomputed) per prompt length,
since what a reuse saves grows with the prefix.
"""

from __future__ import annotations

from bench.report.table import Table, num

LABELS = {"baseline": "reuse off (baseline)", "reuse": "reuse on"}
TIER_LABELS = {"device": "device hit", "host": "host reload", "none": "recompute"}
STATS = ("mean", "median", "p90", "p99")


def _head(result: dict) -> Table:
    cfg, passes = result["config"], result["passes"]
    t = Table(f"Multi-turn serving -- {cfg['addr']}, {cfg['num_prompts']} conversations x {cfg['turns']} turns, "
              f"first prompt {cfg['input_len']} (range {cfg['input_len_range']}), +{cfg['user_len']} user tokens "
              f"a turn, output {cfg['output_len']}, concurrency {result['max_concurrency'] or 'unlimited'}, "
              f"mode {cfg['mode']}", ["metric", *(LABELS.get(n, n) for n in passes)])

    def row(label: str, cell) -> None:
        t.rows.append([label, *(cell(p) for p in passes.values())])

    row("completed requests", lambda p: str(p["completed"]))
    row("failed requests", lambda p: f"{p['failed']} {p['failed_by_code'] or ''}".strip())
    row("conversations ended by a failure", lambda p: str(p["conversations_failed"]))
    row("turns not sent (time budget)", lambda p: str(p["not_sent"]))
    row("duration (s)", lambda p: num(p["duration"]))
    row("total input tokens", lambda p: str(p["total_input_tokens"]))
    row("total generated tokens", lambda p: str(p["total_output_tokens"]))
    row("output token throughput (tok/s)", lambda p: num(p["output_throughput"]))
    row("modes ran", lambda p: ", ".join(f"{m}: {n}" for m, n in p["modes_ran"].items()) or "-")
    row("TTFT p50, turns >= 2 (ms)", lambda p: num(p["ttft_turns_2plus"]["median_ttft_ms"]))
    for tier in ("device", "host", "none"):
        row(f"turns >= 2: {TIER_LABELS[tier]}", lambda p, tier=tier: str(p["hits_by_tier"].get(tier, 0)))
    row("tokens reused, turns >= 2 (sum)", lambda p: str(p["reused_tokens"]["sum"]))
    row("tokens reused, mean per turn >= 2", lambda p: num(p["reused_tokens"]["mean_per_turn"]))
    row("share of the prompt tokens reused, turns >= 2",
        lambda p: "-" if (s := p["reused_tokens"]["share_of_prompt_tokens"]) is None else f"{s:.1%}")
    row("reloaded from the host tier (MiB)", lambda p: num(p["reload_bytes"]["sum"] / 2**20))
    srv = result.get("server") or {}
    t.notes.append(f"server: {srv['error']}" if "error" in srv else
                   f"server: {srv.get('model')}, prefix block {srv.get('prefix_block_tokens')} tokens, "
                   f"max_seq_len {srv.get('max_seq_len')}")
    t.notes += [f"FAILED: {f}" for f in result["failures"]] + [f"warning: {w}" for w in result.get("warnings", [])]
    return t


def _headline(result: dict) -> Table | None:
    h = result.get("headline")
    if not h:
        return None
    t = Table("Headline: reuse on against reuse off", ["figure", "reuse off", "reuse on", "ratio"])
    ttft, tput = h["ttft_p50_turns_2plus_ms"], h["output_throughput"]
    t.rows = [["TTFT p50, turns >= 2 (ms)", num(ttft["baseline"]), num(ttft["reuse"]),
               f"{num(h['ttft_p50_turns_2plus_baseline_over_reuse'])}x (off / on)"],
              ["output throughput (tok/s)", num(tput["baseline"]), num(tput["reuse"]),
               f"{num(h['output_throughput_reuse_over_baseline'])}x (on / off)"]]
    t.notes.append("Both ratios read > 1 when reuse helps. TTFT: the client's, request sent -> first token.")
    return t


def tables(result: dict) -> list[Table]:
    out = [_head(result)]
    if (h := _headline(result)) is not None:
        out.append(h)
    passes, buckets = result["passes"], result["length_buckets"]
    for name, p in passes.items():
        t = Table(f"TTFT by turn (ms) -- {LABELS.get(name, name)}", ["turn", "completed", "mean", "p50", "p90", "p99"])
        for turn in p["ttft_by_turn"]:
            t.rows.append([str(turn["turn"]), str(turn["completed"]), *(num(turn[f"{k}_ttft_ms"]) for k in STATS)])
        later = p["ttft_turns_2plus"]
        t.rows.append([">= 2", str(later["completed"]), *(num(later[f"{k}_ttft_ms"]) for k in STATS)])
        out.append(t)
    used = [b for b in buckets if any(b in cells for p in passes.values()
                                      for cells in p["ttft_by_tier_and_length"].values())]
    for name, p in passes.items():
        t = Table(f"TTFT by where the prefix came from, per prompt length -- {LABELS.get(name, name)}",
                  ["prefix", *used])
        for tier, cells in p["ttft_by_tier_and_length"].items():
            t.rows.append([TIER_LABELS.get(tier, tier), *(f"{num(c['median_ttft_ms'])} ms ({c['count']})"
                                                          if (c := cells.get(b)) else "-" for b in used)])
        t.notes.append("Turns >= 2; a cell: TTFT p50 (turns). Prompt length in tokens; the tier is the server's "
                       "Timing.reuse_tier (recompute: nothing reused, the whole prompt prefilled).")
        out.append(t)
    return out
