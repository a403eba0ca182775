"""The `serve` result (bench/runs/serve.py): its tables (no chart)."""

from __future__ import annotations

from bench.report.table import Table, num


def tables(result: dict) -> list[Table]:
    cfg = result["config"]
    rate = result["request_rate"]
    head = Table(f"Serving benchmark -- {cfg['addr']}, {cfg['num_prompts']} prompts, input {cfg['input_len']} "
                 f"(range {cfg['input_len_range']}), output {cfg['output_len']}, mode {cfg['mode']}"
                 + (f", sampling at temperature {cfg['temperature']:g}, top_p {cfg['top_p']:g}"
                    if cfg.get("temperature") else ", greedy"),
                 ["metric", "value"])
    head.rows = [["max concurrency", str(result["max_concurrency"] or "unlimited")],
                 ["request rate (req/s)", f"{rate} (Poisson)" if rate != "inf" else "inf (all at once)"],
                 ["completed", str(result["completed"])],
                 ["failed", f"{result['failed']} {result['failed_by_code'] or ''}".strip()],
                 ["not sent (time budget)", str(result["not_sent"])], ["duration (s)", num(result["duration"])],
                 ["total input tokens", str(result["total_input_tokens"])],
                 ["total generated tokens", str(result["total_output_tokens"])],
                 ["request throughput (req/s)", num(result["request_throughput"])],
                 ["output token throughput (tok/s)", num(result["output_throughput"])],
                 ["... sustained, first re-send to last send (tok/s)", num(result.get("sustained_output_throughput"))],
                 ["total token throughput (tok/s)", num(result["total_token_throughput"])]]
    if sb := result.get("server_batch"):
        head.rows += [["server: decode steps", str(sb["steps"])],
                      ["server: mean batch per step", num(sb["mean_batch_per_step"])],
                      ["server: prompt tokens in decode steps", str(sb.get("prompt_rows_in_steps", 0))],
                      ["server: steps with prompt rows, by rows",
                       ", ".join(f"{k}: {v}" for k, v in (sb.get("mixed_steps_by_rows") or {}).items()) or "-"],
                      ["server: device busy (step time / wall)",
                       f"{sb['device_busy']:.0%}" if sb.get("device_busy") is not None else "-"],
                      ["server: running requests p50 / max", f"{num(sb['running_p50'])} / {num(sb['running_max'])}"]]
    lat = Table("Latency (ms)", ["metric", "mean", "median", "std", "p90", "p99"])
    for m, label in (("ttft", "TTFT"), ("tpot", "TPOT (excl. 1st token)"), ("itl", "ITL"), ("e2el", "E2EL")):
        lat.rows.append([label] + [num(result[f"{k}_{m}_ms"]) for k in ("mean", "median", "std", "p90", "p99")])
    lat.notes.append("Names and definitions as `vllm bench serve`: tpot = (e2el - ttft) / (tokens - 1) per request; "
                     "itl = every gap between two tokens; times from the client, request sent -> token received.")
    tables = [head, lat]
    if split := result.get("by_length"):
        lo, hi = cfg["long_len"]
        by = Table(f"Short and long prompts apart ({cfg['long_share']:.0%} long: {lo}-{hi} tokens) (ms)",
                   ["prompts", "completed", "TTFT median", "TTFT p99", "ITL median", "ITL p99"])
        for name, s in split.items():
            by.rows.append([name, str(s["completed"])] + [num(s[f"{k}_{m}_ms"]) for m in ("ttft", "itl")
                                                            for k in ("median", "p99")])
        by.notes.append("A long prefill that shares the decode GPU shows in the short prompts' ITL p99.")
        tables.append(by)
    return tables

