"""The `serve` result (bench/runs/serve.py): its tables (no chart); a sweep's (`sweep` in the result) are a summary
row per concurrency and the roofline's rates, each run's own tables being in its OUT/c<N>/report.md."""

from __future__ import annotations

from bench.report.table import Table, num


def tables(result: dict) -> list[Table]:
    if "sweep" in result:
        return sweep_tables(result)
    return run_tables(result) + roofline_tables(result)


def workload(cfg: dict) -> str:
    return (f"input {cfg['input_len']} (range {cfg['input_len_range']}), output {cfg['output_len']}, mode {cfg['mode']}"
            + (f", sampling at temperature {cfg['temperature']:g}, top_p {cfg['top_p']:g}"
               if cfg.get("temperature") else ", greedy"))


def sweep_tables(result: dict) -> list[Table]:
    cfg, roof = result["config"], result.get("roofline") or {}
    rate = cfg["request_rate"]
    t = Table(f"Serving sweep -- {cfg['addr']}, {workload(cfg)}, request rate "
              + (f"{rate}/s (Poisson)" if rate != "inf" else "inf"),
              ["concurrency", "prompts", "completed", "failed", "output tok/s", "sustained tok/s", "TTFT p50 ms",
               "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
              + (["roofline tok/s", "of roofline"] if roof.get("on") else []))
    for row in result["summary"]:
        t.rows.append([str(row["max_concurrency"]), str(row["num_prompts"]), str(row["completed"]),
                       str(row["failed"]) + (f" (+{row['not_sent']} not sent)" if row.get("not_sent") else "")]
                      + [num(row[k]) for k in ("output_throughput", "sustained_output_throughput", "median_ttft_ms",
                                               "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")]
                      + ([num(row["roofline_output_tok_s"]), share(row["of_roofline"])] if roof.get("on") else []))
    t.notes.append("One run per concurrency against the same server, one after the other; each run's own tables and "
                   "result are in c<N>/ under --out.")
    if not result.get("complete", True):
        t.notes.append(f"INCOMPLETE: {len(result['summary'])} of {len(cfg['concurrency'])} runs finished.")
    for f in result["failures"]:
        t.notes.append(f"failed: {f}")
    return [t] + roofline_tables(result)


def share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def roofline_tables(result: dict) -> list[Table]:
    """The measured GEMM rates (or, when there is no roofline, a table saying why)."""
    roof = result.get("roofline")
    if roof is None:
        return []
    if not roof["on"]:
        t = Table("Compute roofline", ["roofline", "why absent"])
        t.rows.append(["absent", roof["why"]])
        return [t]
    t = Table(f"Compute roofline -- bf16 GEMM rate at {roof['rows']:,} rows on {roof['device']} (median of "
              f"{roof['reps']} x {roof['calls_per_rep']} calls)", ["GEMM", "out x in", "us", "TFLOP/s"])
    for name, s in roof["shapes"].items():
        t.rows.append([name, f"{s['n']} x {s['k']}", num(s["us"]), num(s["tflops"])])
    t.rows += [["layer GEMMs (one token's mix)", "-", "-", num(roof["layer_tflops"])],
               ["lm_head", "-", "-", num(roof["lm_head_tflops"])]]
    t.notes += ["Roofline output tok/s = the rate the request's FLOPs get (gemm_tflops) / FLOPs per request x "
                "output tokens: a compute bound (memory, launches and the host free), so small batches, bound by "
                "memory, sit far below it.", f"Counted: {roof['counted']}."]
    return [t]


def run_tables(result: dict) -> list[Table]:
    cfg = result["config"]
    rate = result["request_rate"]
    head = Table(f"Serving benchmark -- {cfg['addr']}, {cfg['num_prompts']} prompts, {workload(cfg)}",
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
    if (result.get("roofline") or {}).get("on"):
        head.rows += [["roofline output tok/s (compute bound)", num(result["roofline_output_tok_s"])],
                      ["... of it, measured", share(result["of_roofline"])],
                      ["... GEMM rate for this workload (TFLOP/s)", num(result["gemm_tflops"])]]
    if sb := result.get("server_batch"):
        head.rows += [["server: decode steps", str(sb["steps"])],
                      ["server: mean batch per step", num(sb["mean_batch_per_step"])],
                      ["server: prompt tokens in decode steps", str(sb.get("prompt_rows_in_steps", 0))],
                      ["server: steps with prompt rows, by rows",
                       ", ".join(f"{k}: {v}" for k, v in (sb.get("mixed_steps_by_rows") or {}).items()) or "-"],
                      ["server: steps without prompt rows", str(sb.get("decode_only_steps", "-"))],
                      ["server: mean step device ms, by rows (decode: no prompt rows)",
                       ", ".join(f"{k}: {v:.2f}" for k, v in (sb.get("step_ms_by_rows") or {}).items()) or "-"],
                      ["server: device busy (step time / wall)",
                       f"{sb['device_busy']:.0%}" if sb.get("device_busy") is not None else "-"],
                      ["server: ... of it before the graphs' replays (input copies, waits on the host)",
                       f"{sb['staging_share']:.1%}" if sb.get("staging_share") is not None else "-"],
                      ["server: running requests p50 / max", f"{num(sb['running_p50'])} / {num(sb['running_max'])}"]]
        if sb.get("prompts_queued_p50") is not None:
            head.rows += [["server: prompts queued for steps p50 / share of samples with none",
                           f"{num(sb['prompts_queued_p50'])} / {sb['prompts_queued_none_share']:.0%}"]]
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

