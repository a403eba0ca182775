"""The `decode` result (bench/runs/decode.py): derived figures (floor, ratios, targets), its tables and its chart.

Why the derived figures here too: the run fills every cell with them (`finish_cell`, `targets`) and the
tables explain them, so what a decode cell means is written once, here. The floor of a cell is (weights
one step reads + B x C live K/V bytes) / the bandwidth measured in the same run: what the step would
cost if it only streamed its bytes.
"""

from __future__ import annotations

from bench.report.table import Table, num, yes


def finish_cell(c: dict, wbytes: int, bytes_per_token: int, bw_gbps: float) -> dict:
    """Add floor, ratio and throughputs to one cell (None where the engine did not run)."""
    b = c["batch"]
    for k in ("step_ms_p50", "step_ms_p10", "step_ms_p90", "step_ms_back_to_back_p50", "hf_eager_ms",
              "hf_static_compile_ms", "step_ms_greedy_p50", "sampling_over_greedy"):
        c.setdefault(k, None)
    c["floor_ms"] = (wbytes + b * c["context"] * bytes_per_token) / (bw_gbps * 1e9) * 1e3
    c["floor_tok_s"] = b / (c["floor_ms"] * 1e-3)
    step = c["step_ms_p50"]
    c["ratio"] = step / c["floor_ms"] if step else None
    chain = c["step_ms_back_to_back_p50"]
    c["ratio_back_to_back"] = chain / c["floor_ms"] if chain else None
    c["tok_s"] = b / (step * 1e-3) if step else None
    c["share_of_floor_throughput"] = c["tok_s"] / c["floor_tok_s"] if step else None
    for k, name in (("hf_eager_ms", "engine_vs_hf_eager"), ("hf_static_compile_ms", "engine_vs_hf_static_compile")):
        c[name] = c[k] / step if step and c[k] else None
    return c


TARGETS = (("batch1_1k_ratio_le_1.3", (1, 1024), "ratio", lambda x: x <= 1.3),
           ("batch1_1k_back_to_back_ratio_le_1.3", (1, 1024), "ratio_back_to_back", lambda x: x <= 1.3),
           ("batch1_32k_ratio_le_1.4", (1, 32768), "ratio", lambda x: x <= 1.4),
           ("batch64_1k_share_of_floor_ge_0.6", (64, 1024), "share_of_floor_throughput", lambda x: x >= 0.6))


SAMPLING_TARGET = 1.03  # a sampling run: sampling / greedy step time in every cell (issue #26)


def targets(cells: list[dict]) -> dict[str, bool]:
    """The decode-step targets for the cells that ran: reported, not asserted."""
    at = {(c["batch"], c["context"]): c for c in cells if c["step_ms_p50"]}
    out = {name: met(at[key][field]) for name, key, field, met in TARGETS if key in at and at[key].get(field)}
    paired = [c["sampling_over_greedy"] for c in at.values() if c.get("sampling_over_greedy")]
    if paired:
        out[f"sampling_over_greedy_le_{SAMPLING_TARGET}_every_cell"] = max(paired) <= SAMPLING_TARGET
    return out


def ratio3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def tables(result: dict) -> list[Table]:
    cfg = result["config"]
    graphs = "CUDA graphs" if cfg["cuda_graphs"] and result["device"].startswith("cuda") else "eager"
    if cfg.get("temperature"):  # --temperature: the draw is part of the timed step
        graphs += (f", every row sampling (temperature {cfg['temperature']:g}, top_p {cfg['top_p']:g}, "
                   f"top_k {cfg['top_k']})")
    t = Table(f"Decode step -- {result['model']} {result['dtype']} on {result['device']} ({result['gpu_name']}), "
              f"engine {graphs}, p50 [p10-p90] of {cfg['runs']} after {cfg['warmup']} warm-up",
              ["batch", "context", "step ms", "floor ms", "ratio", "back-to-back ms", "ratio b2b", "tok/s", "floor tok/s", "share of floor",
               "HF eager ms", "vs HF eager", "HF compiled ms", "vs HF compiled"])
    paired = any(c.get("sampling_over_greedy") for c in result["cells"])
    if paired:
        t.headers[3:3] = ["greedy ms", "sampling / greedy"]
    for c in result["cells"]:
        step = (f"{num(c['step_ms_p50'])} [{num(c['step_ms_p10'])}-{num(c['step_ms_p90'])}]"
                if c["step_ms_p50"] else "skipped")
        t.rows.append([str(c["batch"]), f"{c['context']:,}", step, num(c["floor_ms"]), num(c["ratio"], "x"),
                       num(c.get("step_ms_back_to_back_p50")), num(c.get("ratio_back_to_back"), "x"),
                       num(c["tok_s"]), num(c["floor_tok_s"]), num(c["share_of_floor_throughput"]),
                       num(c["hf_eager_ms"]), num(c["engine_vs_hf_eager"], "x"), num(c["hf_static_compile_ms"]),
                       num(c["engine_vs_hf_static_compile"], "x")])
        if paired:
            t.rows[-1][3:3] = [num(c.get("step_ms_greedy_p50")), ratio3(c.get("sampling_over_greedy"))]
    t.notes = [f"floor = (weights {num(result['weights_bytes'] / 2**30)} GiB + batch x context x "
               f"{result['bytes_per_token']:,} B/token of live K/V) / {num(result['bandwidth_gbps'])} GB/s (device "
               f"copy of {result['bandwidth_copy_bytes'] >> 20} MiB, read + written, same run). Weights: every "
               "parameter once, the embedding table excluded unless tied to lm_head (a step reads B rows of it).",
               "step: one step and its token choice (argmax, or the draw), the device synchronized before and after "
               "(includes the graph launches); greedy ms (a sampling run): the same step with argmax, timed "
               "alternately with it in the same process (medians of the rounds); "
               "back-to-back: 10 steps queued with no host wait between them, per step, as the decode server's "
               "overlapping scheduler runs them. "
               "ratio = step / floor; share of floor = tok/s / floor tok/s. vs HF = HF ms / engine ms. HF eager: one "
               "forward of (B, 1) over a DynamicCache of B x C, cropped back to C after each call; HF compiled: "
               "StaticCache + torch.compile(mode='reduce-overhead'), at --hf-compile-points only."]
    tables = [t]
    if result["sanity"]:
        s = Table("Sanity: the timed step's row 0 vs eager runner.forward of that row alone",
                  ["context", "batch", "graphed", "relative L2", "max abs diff", "max abs ref", "ok"])
        s.rows = [[f"{x['context']:,}", str(x["batch"]), yes(x["graphed"]), f"{x['rel_l2']:.3g}",
                   f"{x['max_abs_diff']:.3g}", f"{x['ref_max_abs']:.3g}", yes(x["ok"])] for x in result["sanity"]]
        tables.append(s)
    if result["skipped"]:
        k = Table("Skipped cells", ["batch", "context", "what", "why"])
        k.rows = [[str(x["batch"]), f"{x['context']:,}", x["what"], x["why"]] for x in result["skipped"]]
        tables.append(k)
    if result["targets"]:
        g = Table("decode-step targets (reported, not asserted)", ["target", "met"])
        g.rows = [[name, yes(met)] for name, met in result["targets"].items()]
        tables.append(g)
    return tables


def plot(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """Left: step ms vs context per batch, floor dashed, HF eager dotted. Right: ratio to the floor per cell."""
    from matplotlib.figure import Figure

    from bench.report.chart import save
    cells = [c for c in result["cells"] if c["step_ms_p50"] or c["hf_eager_ms"]]
    batches = sorted({c["batch"] for c in cells})
    fig = Figure(figsize=(12, 4.2))
    ax, bar = fig.subplots(1, 2)
    for i, b in enumerate(batches):
        rows = sorted((c for c in cells if c["batch"] == b), key=lambda c: c["context"])
        for key, style, label in (("step_ms_p50", "-o", f"batch {b}"), ("floor_ms", "--", None),
                                  ("hf_eager_ms", ":x", f"HF eager, batch {b}")):
            pts = [(c["context"], c[key]) for c in rows if c[key] and (key != "floor_ms" or c["step_ms_p50"])]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{i}", label=label, lw=1.2, ms=4)
    ran = [c for c in cells if c["ratio"]]
    bars = bar.bar(range(len(ran)), [c["ratio"] for c in ran], color=[f"C{batches.index(c['batch'])}" for c in ran])
    bar.bar_label(bars, [f"{c['ratio']:.2f}" for c in ran], fontsize=7)
    short = [f"{c['context'] // 1024}k" if c["context"] % 1024 == 0 else str(c["context"]) for c in ran]
    bar.set_xticks(range(len(ran)), [f"{c['batch']}x{n}" for c, n in zip(ran, short)], fontsize=7)
    bar.axhline(1.0, color="0.4", lw=0.8, ls="--")
    bar.set_ylabel("step / floor")
    bar.set_title("ratio to the floor (batch x context)", fontsize=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    contexts = sorted({c["context"] for c in cells})
    ax.set_xticks(contexts, [f"{n:,}" for n in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens each row attends over)")
    ax.set_ylabel("ms per step (p50); dashed: floor")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"Decode step: {result['model']} {result['dtype']} on {result['gpu_name']}, "
                 f"{result['bandwidth_gbps']:.0f} GB/s measured", fontsize=10)
    fig.subplots_adjust(wspace=0.55)
    return [("Decode step time vs context, and ratio to the floor", save(fig, out_dir, "decode.png"))]
