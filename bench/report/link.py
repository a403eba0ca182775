"""The `link` result (bench/runs/link.py): its table and its chart."""

from __future__ import annotations

from bench.report.table import Table, num, spread


def tables(result: dict) -> list[Table]:
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


def plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """GB/s per measured link, one horizontal bar each (log scale)."""
    from matplotlib.figure import Figure

    from bench.report.chart import save
    items = [(name, v["gbps"]) for name, v in result["links"].items() if v.get("available") and v.get("gbps")]
    fig = Figure(figsize=(7, 0.35 * len(items) + 1.2))
    ax = fig.subplots()
    bars = ax.barh([n for n, _ in items][::-1], [g for _, g in items][::-1])
    ax.bar_label(bars, [f"{g:,.0f}" if g >= 100 else f"{g:.3g}" for _, g in items][::-1], fontsize=7, padding=2)
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (median)")
    ax.set_title(f"Raw links, {result['bytes'] / 2**20:,.1f} MiB per transfer", fontsize=10)
    return [("Raw link speeds", save(fig, out_dir, "links.png"))]

