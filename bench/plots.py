"""Charts for bench results: PNGs written next to result.json and embedded in report.md.

Why matplotlib's object API on an Agg canvas (no pyplot): no global backend state, no
display needed, safe on a headless GPU box and in tests. A result kind registers a
plotter in `PLOTTERS`; each returns [(title, file name)] for the Markdown report.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _save(fig: Figure, out_dir: str, name: str) -> str:
    FigureCanvasAgg(fig)
    fig.savefig(os.path.join(out_dir, name), dpi=110, bbox_inches="tight")
    return name


def offload_plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """The seed's chart: per model and length, recompute (= 1) and each tier's reload time, scaled to recompute."""
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
    return [("Reload time per tier, scaled to recompute (log scale)", _save(fig, out_dir, "offload.png"))]


def ttft_plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """Overhead (ms, and % of TTFT_colo) vs prompt length, one line per mode and transport."""
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
    return [("TTFT overhead vs prompt length", _save(fig, out_dir, "ttft_overhead.png"))]


def link_plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """GB/s per measured link, one horizontal bar each (log scale)."""
    items = [(name, v["gbps"]) for name, v in result["links"].items() if v.get("available") and v.get("gbps")]
    fig = Figure(figsize=(7, 0.35 * len(items) + 1.2))
    ax = fig.subplots()
    bars = ax.barh([n for n, _ in items][::-1], [g for _, g in items][::-1])
    ax.bar_label(bars, [f"{g:,.0f}" if g >= 100 else f"{g:.3g}" for _, g in items][::-1], fontsize=7, padding=2)
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (median)")
    ax.set_title(f"Raw links, {result['bytes'] / 2**20:,.1f} MiB per transfer", fontsize=10)
    return [("Raw link speeds", _save(fig, out_dir, "links.png"))]


def decode_plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    from bench.decode_report import decode_plot  # beside its bench (imports this module)
    return decode_plot(result, out_dir)


def interference_plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    from bench.interference_report import plot  # the chart lives beside the bench
    return plot(result, out_dir, _save)


PLOTTERS: dict[str, Callable[[dict, str], list[tuple[str, str]]]] = {
    "offload": offload_plot, "ttft": ttft_plot, "link": link_plot, "decode": decode_plot,
    "interference": interference_plot}


def plots_for(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """Write the result kind's charts into `out_dir`; [] for kinds without one."""
    plotter = PLOTTERS.get(result["kind"])
    return plotter(result, out_dir) if plotter else []
