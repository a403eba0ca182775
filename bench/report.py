"""Report writing: one result dict -> rich tables, a Markdown report, JSON.

Why one module: every bench subcommand produces a plain dict; turning it into tables is
done once here, as neutral `Table`s rendered either by rich (terminal) or as Markdown
(bench/results/), so the two never disagree. A new result kind registers a builder in
`BUILDERS` keyed by the result's "kind".
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def num(x: float | None, unit: str = "") -> str:
    """Three significant-ish digits without scientific notation: 0.0123, 1.23, 123, 12345."""
    if x is None:
        return "-"
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 1 else 3 if abs(x) >= 0.01 else 5
    return f"{x:,.{digits}f}{unit}"


def spread(s: dict) -> str:
    """A stats dict as `median [min-max]` in ms."""
    return f"{num(s['median_ms'])} [{num(s['min_ms'])}-{num(s['max_ms'])}]"


def yes(b: bool) -> str:
    return "yes" if b else "NO"


def offload_tables(result: dict) -> list[Table]:
    cfg = result["config"]
    head = f"{cfg['device']} ({result['env']['device_name']}), {cfg['dtype']}, median [min-max] of {cfg['runs']}"
    recompute = Table(f"Recompute (prefill) -- {head}",
                      ["model", "tokens", "cache MiB", "bytes/token", "prefill ms", "us/token", "break-even GB/s"])
    tiers = Table("Offload / reload per tier (ms; speed-up = prefill / reload)",
                  ["model", "tokens", "tier", "offload ms", "reload ms", "offload GB/s", "reload GB/s",
                   "speed-up", "bytes equal", "decode equal", "read"])
    labels: dict[str, str] = {}
    for r in result["rows"]:
        recompute.rows.append([r["model"], str(r["length"]), num(r["cache_bytes"] / 2**20), f"{r['bytes_per_token']:,}",
                               spread(r["prefill"]), num(r["prefill_us_per_token"]), num(r["break_even_gbps"])])
        labels.update(r.get("tier_labels", {}))
        for kind, t in r["tiers"].items():
            if not t["available"]:
                tiers.rows.append([r["model"], str(r["length"]), kind, "skipped", "", "", "", "", "", "",
                                   t["skip_reason"]])
                continue
            pc = t.get("page_cache")
            read = "" if pc is None else ("cold" if pc["cold"] else
                                          f"warm ({pc['runs'] - pc['cold_runs']}/{pc['runs']} runs)")
            tiers.rows.append([r["model"], str(r["length"]), kind, spread(t["offload"]), spread(t["reload"]),
                               num(t["offload_gbps"]), num(t["reload_gbps"]), num(t["reload_speedup"], "x"),
                               yes(t["byte_equal"]), yes(t["decode_equal"]), read])
    recompute.notes.append("break-even = KV bytes per token / prefill seconds per token: a link faster "
                           "than this moves a cache sooner than a prefill rebuilds it.")
    tiers.notes.append(f"decode equal: {cfg['decode_tokens']} tokens and their logits identical "
                       "(deterministic mode); read: page-cache state before a disk reload, measured by mincore.")
    if labels:  # what each tier is on this device: a CPU run's `gpu` tier is a second buffer in RAM
        tiers.notes.append("tiers: " + "; ".join(f"{k} = {v}" for k, v in labels.items()))
    links = result["links"]
    raw = Table(f"Raw links in the same run ({num(links['bytes'] / 2**20)} MiB per copy)",
                ["link", "ms", "GB/s"])
    for name, s in links.items():
        if isinstance(s, dict):
            cold = "" if "cold" not in s else (" (cold)" if s["cold"] else " (warm: page cache not dropped)")
            raw.rows.append([name + cold, spread(s), num(s["gbps"])])
    raw.notes.append(f"disk: {result['env']['disk_dir']} ({result['env']['disk_fs']})")
    return [recompute, tiers, raw]


def ttft_tables(result: dict) -> list[Table]:
    cfg = result["config"]
    t = Table(f"TTFT: colocated vs disaggregated -- {cfg['model']} {cfg['dtype']}, prefill on {cfg['prefill_device']}, "
              f"decode on {cfg['decode_device']}, median [min-max] of {cfg['runs']} after {cfg['warmup']} warm-up",
              ["tokens", "mode", "cache MiB", "TTFT colo ms", "TTFT disagg ms", "overhead ms", "overhead %",
               "prefill colo ms", "prefill disagg ms", "prefill slowdown %", "2nd token disagg ms", "verified"])
    for r in result["rows"]:
        verified = ("cache+tokens+logits equal" if r.get("cache_equal") and r.get("tokens_equal")
                    and r.get("logits_equal") else "NOT EQUAL" if "cache_equal" in r else "not checked")
        t.rows.append([str(r["length"]), r["mode"], num(r["cache_bytes"] / 2**20), spread(r["ttft_colo"]),
                       spread(r["ttft_disagg"]), num(r["overhead_ms"]), num(r["overhead_pct"]),
                       spread(r["prefill_colo"]), spread(r["prefill_disagg"]), num(r["prefill_slowdown_pct"]),
                       spread(r["second_token_disagg"]), verified])
    t.notes = ["TTFT colo: request in -> first token on one device. TTFT disagg: request in -> the decode worker "
               "holds the whole cache and the first token. verified: a separate deterministic run, cache digest, "
               "tokens and every step's logits digest equal to colocated."]
    tables = [t]
    if result.get("links"):
        lt = Table("Raw link in the same run", ["link", "pattern", "ms", "GB/s"])
        for name, v in result["links"].items():
            lt.rows.append([name, v.get("pattern", ""), spread(v), num(v.get("gbps"))])
        tables.append(lt)
    return tables


def link_tables(result: dict) -> list[Table]:
    cfg, env = result["config"], result["env"]
    t = Table(f"Raw links -- {num(result['bytes'] / 2**20)} MiB per transfer ({result['layers']} layers of "
              f"{num(result['layer_bytes'] / 2**20)} MiB), {env['device_name']}, median [min-max] of {cfg['runs']} "
              f"after {cfg['warmup']} warm-up", ["link", "ms", "GB/s", "detail"])
    for name, v in result["links"].items():
        if not v["available"]:
            t.rows.append([name, "FAILED" if "error" in v else "skipped", "", v.get("error") or v["skip_reason"]])
            continue
        detail = [v.get("backend"), v.get("between"), v.get("pattern"), v.get("note"), v.get("source"),
                  f"{v['channels']} connection(s)" if "channels" in v else None]
        t.rows.append([name, spread(v), num(v["gbps"]), ", ".join(str(d) for d in detail if d)])
    t.notes.append("GB/s = bytes / median time, 1e9 bytes per GB; every timer read after a device sync.")
    return [t]


def serve_tables(result: dict) -> list[Table]:
    cfg = result["config"]
    rate = result["request_rate"]
    head = Table(f"Serving benchmark -- {cfg['addr']}, {cfg['num_prompts']} prompts, input {cfg['input_len']} "
                 f"(range {cfg['input_len_range']}), output {cfg['output_len']}, mode {cfg['mode']}",
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


def decode_tables(result: dict) -> list[Table]:
    from bench.decode_report import decode_tables  # beside its bench (imports this module)
    return decode_tables(result)


def interference_tables(result: dict) -> list[Table]:
    from bench.interference_report import tables  # the builder lives beside the bench
    return tables(result)


BUILDERS: dict[str, Callable[[dict], list[Table]]] = {"offload": offload_tables, "ttft": ttft_tables,
                                                      "link": link_tables, "serve": serve_tables,
                                                      "decode": decode_tables, "interference": interference_tables}


def tables_for(result: dict) -> list[Table]:
    return BUILDERS[result["kind"]](result)


def print_tables(tables: list[Table], console: Console) -> None:
    for t in tables:
        rt = RichTable(title=escape(t.title), title_justify="left", caption_justify="left",
                       caption=escape("\n".join(t.notes)) or None)
        numeric = [bool(t.rows) and t.rows[0][i][:1].isdigit() for i in range(len(t.headers))]
        for h, right in zip(t.headers, numeric):
            rt.add_column(escape(h), justify="right" if right else "left")
        for row in t.rows:
            rt.add_row(*map(escape, row))
        console.print(rt)


def markdown(tables: list[Table], title: str, command: str | None = None,
             images: list[tuple[str, str]] = ()) -> str:
    """Tables as Markdown; `images` (title, relative path) are embedded after them."""
    lines = [f"# {title}", ""]
    if command:
        lines += ["Produced by:", "", "```", command, "```", ""]
    for t in tables:
        lines += [f"## {t.title}", "", "| " + " | ".join(t.headers) + " |",
                  "| " + " | ".join("---" for _ in t.headers) + " |"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in t.rows]
        lines += [""] + [f"{n}  " for n in t.notes] + [""]
    for alt, path in images:
        lines += [f"## {alt}", "", f"![{alt}]({path})", ""]
    return "\n".join(lines)


def json_line(result: dict) -> str:
    """The whole result as one line (allow_nan=False: a NaN or inf is a bug, not a number)."""
    return json.dumps(result, separators=(",", ":"), allow_nan=False)


def write_outputs(out_dir: str, result: dict, tables: list[Table], command: str | None) -> dict:
    """result.json, the kind's PNG charts (bench.plots) and report.md embedding them, under `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    paths = dict(json=os.path.join(out_dir, "result.json"), markdown=os.path.join(out_dir, "report.md"))
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
        f.write("\n")
    from bench.plots import plots_for  # matplotlib only when files are written
    try:
        images = plots_for(result, out_dir)
    except Exception as e:  # the measurement is kept; the report says the chart is missing and why
        images, paths["plot_error"] = [], f"{type(e).__name__}: {e}"
        print(f"warning: no charts: {paths['plot_error']}", file=sys.stderr)
    paths["plots"] = [os.path.join(out_dir, p) for _, p in images]
    with open(paths["markdown"], "w") as f:
        f.write(markdown(tables, f"kvtransfer bench: {result['kind']}", command, images))
    return paths
