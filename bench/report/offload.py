"""The `offload` result (bench/runs/offload.py): its tables and its chart."""

from __future__ import annotations

from bench.report.table import Table, num, spread, yes


def tables(result: dict) -> list[Table]:
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


def plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """The seed's chart: per model and length, recompute (= 1) and each tier's reload time, scaled to recompute."""
    from matplotlib.figure import Figure

    from bench.report.chart import save
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig = Figure(figsize=(4.5 + 2.2 * len(result["config"]["lengths"]), 3.8 * len(models)))
    axes = fig.subplots(len(models), 1, squeeze=False)[:, 0]
    for ax, model in zip(axes, models):
        rows = [r for r in result["rows"] if r["model"] == model]
        tiers = [k for k in rows[0]["tiers"]]
        series = ["recompute", *tiers]
        width = 0.8 / len(series)
        for j, name in enumerate(series):
            xs, ys = [], []
            for i, r in enumerate(rows):
                t = r["tiers"].get(name, {})
                if name == "recompute":
                    y = 1.0
                elif t.get("available"):
                    y = t["reload"]["median_ms"] / r["prefill"]["median_ms"]
                else:
                    continue
                xs.append(i + (j - (len(series) - 1) / 2) * width)
                ys.append(y)
            if not ys:
                continue  # a tier skipped here (reason in the table)
            bars = ax.bar(xs, ys, width, label=name, color="0.35" if name == "recompute" else f"C{j - 1}")
            labels = ([f"{r['prefill']['median_ms']:.3g} ms" for r in rows] if name == "recompute" else
                      [f"{1 / y:.0f}x" if y < 0.1 else f"{1 / y:.1f}x" for y in ys])
            ax.bar_label(bars, labels, fontsize=7)
        ax.set_xticks(range(len(rows)), [f"{r['length']:,} tok\n{r['cache_bytes'] / 2**20:.3g} MiB" for r in rows])
        ax.set_yscale("log")
        ax.set_ylim(top=3.0)
        ax.set_ylabel("reload time / recompute time")
        ax.set_title(f"{model}: reload vs recompute (labels: prefill ms, reload speed-up)", fontsize=10)
        ax.axhline(1.0, color="0.35", lw=0.8, ls="--")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return [("Reload time per tier, scaled to recompute (log scale)", save(fig, out_dir, "offload.png"))]

