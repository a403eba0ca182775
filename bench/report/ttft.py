"""The `ttft` result (bench/runs/ttft.py): its tables and its chart."""

from __future__ import annotations

from bench.report.table import Table, num, spread


def tables(result: dict) -> list[Table]:
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


def plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """Overhead (ms, and % of TTFT_colo) vs prompt length, one line per mode and transport."""
    from matplotlib.figure import Figure

    from bench.report.chart import save
    fig = Figure(figsize=(11, 4))
    ax_ms, ax_pct = fig.subplots(1, 2)
    cfg = result["config"]
    lines: dict[str, list[dict]] = {}
    for r in result["rows"]:
        transport = r.get("transport") or cfg.get("transport")
        lines.setdefault(r["mode"] + (f" / {transport}" if transport else ""), []).append(r)
    for label, rows in lines.items():
        rows = sorted(rows, key=lambda r: r["length"])
        xs = [r["length"] for r in rows]
        ax_ms.plot(xs, [r["overhead_ms"] for r in rows], marker="o", label=label)
        ax_pct.plot(xs, [r["overhead_pct"] for r in rows], marker="o", label=label)
    lengths = sorted({r["length"] for r in result["rows"]})
    for ax, unit in ((ax_ms, "ms"), (ax_pct, "% of TTFT colocated")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"TTFT overhead ({unit})")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Disaggregation overhead: {cfg['model']} {cfg['dtype']}, "
                 f"{cfg['prefill_device']} -> {cfg['decode_device']}", fontsize=10)
    return [("TTFT overhead vs prompt length", save(fig, out_dir, "ttft_overhead.png"))]

