"""The `interference` result (bench/runs/interference.py): its tables and its chart.

The figures themselves (ITL, stall, goodput) are defined in bench/measure/interference_stats.py;
this lays them out.
"""

from __future__ import annotations

from bench.report.table import Table, num


def _arrival_name(a: dict) -> str:
    return f"{a['tokens']:,}" + (" (Poisson)" if a["kind"] == "poisson" else "")


def tables(result: dict) -> list[Table]:
    cfg = result["config"]
    head = (f"{cfg['model']} {cfg['dtype']} on {cfg['device']} ({result['env']['device_name']}), "
            f"{cfg['streams']} streams x {cfg['context']:,} tokens")
    arms = Table(f"Interference: running streams' ITL -- {head}",
                 ["arm", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "ITL max outside ms", "goodput", "status"])
    per = Table("Per long prompt: TTFT and the stall it caused",
                ["arm", "prompt tokens", "TTFT ms", "stall ms", "stall / ITL p50", "ITL p99 in window ms",
                 "ITL max outside ms", "gaps in window"])
    for a in result["arms"]:
        if not a["ok"]:
            arms.rows.append([a["label"], "-", "-", "-", "-", "-", "FAILED: " + a["error"].splitlines()[0][:160]])
            continue
        i, g = a["itl_ms"], a["goodput_detail"]
        arms.rows.append([a["label"], num(i["p50"]), num(i["p99"]), num(i["max"]), num(a["itl_outside_ms"]["max"]),
                          f"{num(100 * g['share'])}% ({g['met']}/{g['requests']})", "ok"])
        for r in a["arrivals"]:
            ratio = r["stall_ms"] / i["p50"] if r["stall_ms"] is not None and i["p50"] else None
            per.rows.append([a["label"], _arrival_name(r), num(r["ttft_ms"]), num(r["stall_ms"]), num(ratio, "x"),
                             num(r["itl_p99_in_window_ms"]), num(r["itl_max_outside_ms"]), str(r["gaps_in_window"])])
    arms.notes = [f"ITL: client-side gaps between consecutive tokens of a stream, from the moment all streams run "
                  f"until they are cancelled. Outside: gaps overlapping no prefill window. Goodput: requests "
                  f"(streams + long prompts) meeting TTFT <= {num(cfg['ttft_slo_ms'])} ms (long prompts only) and "
                  f"max ITL <= {num(cfg['itl_slo_ms'])} ms."]
    if cfg.get("shared_device") and any(a["arm"] == "disagg" for a in result["arms"]):
        arms.notes.append(f"The disaggregated arm runs both servers on {cfg['device']}: they share one device.")
    per.notes = ["Prefill window: long prompt sent -> its first token on the client (= TTFT). Stall: the longest "
                 "stream ITL overlapping the window."]
    return [arms, per]


def plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """Per arm: the streams' largest ITL per time bin around each arrival, prefill windows shaded.

    Steps: a point (gap end, ITL) is drawn over the time before it, where that gap was waited out."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    from bench.report.chart import save
    arms = [a for a in result["arms"] if a["ok"]]
    if not arms:
        return []
    fig = Figure(figsize=(10, 2.6 * len(arms) + 0.6))
    axes = fig.subplots(len(arms), 1, squeeze=False, sharex=True)[:, 0]
    for ax, a in zip(axes, arms):
        for j, tl in enumerate(a["timeline"]["arrivals"]):
            color = f"C{j % 10}"
            name = _arrival_name(tl)
            ax.axvspan(*tl["window_s"], color=color, alpha=0.12)
            ax.plot(tl["t_s"], tl["itl_ms"], color=color, lw=0.9, marker=".", ms=2.5, drawstyle="steps-pre",
                    label=f"{name} tok (TTFT {tl['window_s'][1] * 1e3:,.0f} ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:g}"[0] in "25" else ""))
        ax.set_ylabel("ITL ms (max of streams)")
        ax.set_title(a["label"], fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("seconds since the long prompt was sent (shaded: its prefill window)")
    cfg = result["config"]
    fig.suptitle(f"Decode stalls around long-prompt arrivals: {cfg['model']}, {cfg['streams']} streams x "
                 f"{cfg['context']:,} tokens", fontsize=10)
    return [("Streams' ITL around each arrival", save(fig, out_dir, "interference.png"))]
