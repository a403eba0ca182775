"""Where a MIXED step's GPU time goes: decode rows and prompt-chunk rows in one forward (issue #39).

Why: served, a prompt token costs ~27-40 us inside a mixed step of 256-512 rows against ~19.5 us of pure GEMM
compute, and the decode-only profile (profile_step.py) cannot say where the rest goes. This builds the step the
scheduler builds with --mixed-prefill (kvtransfer/engine/mixed.py, graphs.py): --batch decode rows at --context,
padded to the engine's bucket, then --pieces prompt chunks (each its own slot, positions --prompt-start ..)
filling the --mixed rows; replays it from its CUDA graph through `Step.mixed`, as the engine does, then runs the
greedy argmax the scheduler runs (queued.py). It prints the step's median synchronized time, the plain decode
step's beside it, and GPU time by category: GEMMs by projection (qkv, o, gate_up, down, lm_head), attention of
the decode rows vs the chunk rows, norms/RoPE/SiLU, sampling, other (input copies, gathers, cats); plus the rows
each part ran on (the lm_head's among them). One JSON line at the end.

The replays' kernels get their labels from one eager run of the same step (kernel_labels.py says how). On CPU
(eager, for the tests) the categories are the ops' own CPU time.

    python -m bench.probes.profile_step --model qwen2.5-7b --mixed 512 --batch 64 --context 1024
    python -m bench.probes.profile_mixed --model tiny --device cpu --mixed 32 --batch 4 --context 64 \
        --prompt-start 16 --prompt-len 64
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from bench.probes.kernel_labels import (CATEGORIES, CATEGORY, EagerGraph, align, by_name, gemms_by_position,
                                        label_of, labeled)
from bench.probes.mixed_step import build, timed
from kvtransfer.engine.graphs import Step
from kvtransfer.engine import runner as runner_module
from kvtransfer.engine.runner import MIXED_ATTENTIONS
from kvtransfer.engine.sampler import first_token, next_tokens


def runner_side(st) -> bool:
    """Whether the step's prompt rows attend on a side stream beside its decode rows (when it runs two kernels)."""
    return st.runner.side.stream is not None


def covered_us(spans) -> float:
    """How long at least one of the (start, end) spans runs (us): the union's length, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def gpu_kernels(st: Step, body, rows: int, b: int, replays: int, seen: dict) -> tuple[list, int]:
    """[(label, kernel name, us, (start, end))] over `replays` profiled steps, and how many labels came from the
    alignment."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            body()
        torch.cuda.synchronize()
    kern = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    graph = st.mixed_graphs.get((rows, b))
    if graph is not None:
        st.mixed_graphs[rows, b] = (EagerGraph(st, rows, b), graph[1])
    try:  # the labeling pass: the same step once, eagerly, each op in its range
        with labeled(st.runner, seen), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as lp:
            body()
            torch.cuda.synchronize()
    finally:
        if graph is not None:
            st.mixed_graphs[rows, b] = graph
    labels, matched = align(kern, reference_labels(lp.events()), replays)
    labels = gemms_by_position(labels, len(st.runner.layers), replays)  # when no range named them (torch 2.11)
    return [(lab, e.name, e.time_range.end - e.time_range.start, (e.time_range.start, e.time_range.end))
            for e, lab in zip(kern, labels)], matched


def reference_labels(events) -> list[tuple[str, str]]:
    """(kernel name, label) of the labeling pass's kernels in launch order. torch >= 2.12 links each device event to
    its launch (linked_correlation_id); torch 2.11 does not, but lists each launch's kernels on its CPU event
    (`kernels`): one stream runs them in launch order. Either way a kernel no range claims is labeled by its name."""
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if device and hasattr(device[0], "linked_correlation_id"):
        cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU and not e.linked_correlation_id}
        return [(e.name, label_of(e, cpu) or by_name(e.name)) for e in device]
    launches = sorted((e for e in events if e.device_type == DeviceType.CPU and e.kernels and not e.is_legacy),
                      key=lambda e: e.time_range.start)
    ref = [(k.name, label_of(e, {}) or by_name(k.name)) for e in launches for k in e.kernels]
    if len(ref) != len(device):  # not one entry per kernel: names only
        return [(e.name, by_name(e.name)) for e in device]
    return ref


def cpu_ops(st: Step, body, replays: int, seen: dict) -> list:
    """[(label, op name, its own CPU us)] over `replays` labeled steps (CPU: no kernels to align)."""
    with labeled(st.runner, seen), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(replays):
            body()
    return [(lab, e.name, e.self_cpu_time_total) for e in prof.events() if (lab := label_of(e, {})) is not None]


def profile_mixed(a) -> dict:
    st, b, tok, pos, slots, chunks = build(a)
    dev, n = tok.device, a.batch
    prompt_tokens = sum(c.ids.shape[0] for c in chunks)
    graphed = bool(st.mixed_graphs)
    rows = st.rows_for(n, prompt_tokens) if graphed else n + prompt_tokens
    if graphed and (rows, b) not in st.mixed_graphs:
        raise SystemExit(f"no mixed graph holds {prompt_tokens} prompt rows beside {n} decode rows")

    def body():
        with record_function("kvt:inputs"):  # the engine's host-side layout and copies (the ops inside: their own)
            logits, lasts = st.mixed(tok, pos, slots, chunks)
        with record_function("kvt:sample"):  # greedy, as queue_step: the decode rows, then finished prompts
            return next_tokens(logits), [first_token(lasts[j]) for j, c in enumerate(chunks) if c.last]

    def plain():
        return next_tokens(st(tok, pos, slots))

    step_ms, host_ms = timed(body, dev, a.runs)
    decode_ms, _ = timed(plain, dev, a.runs)
    seen: dict = {}
    if dev.type == "cuda":
        items, matched = gpu_kernels(st, body, rows, b, a.replays, seen)
    else:
        items, matched = [(*op, None) for op in cpu_ops(st, body, a.replays, seen)], 0
    per, kernels = defaultdict(float), defaultdict(float)
    # kernels run (any stream) and the attention's wall, per step: what the side stream overlaps, and the gaps
    covered = covered_us([span for *_, span in items]) / a.replays if dev.type == "cuda" else None
    attention = covered_us([span for lab, *_, span in items if CATEGORY.get(lab) == "attention"]) / a.replays \
        if dev.type == "cuda" else None
    for lab, name, us, _ in items:
        per[lab] += us / a.replays
        kernels[lab, name[:80]] += us / a.replays
    busy, layers = sum(per.values()), len(st.runner.layers)
    cats = dict.fromkeys(CATEGORIES, 0.0)
    for lab, us in per.items():
        cats[CATEGORY.get(lab, "other")] += us
    share = (lambda us: us / busy if busy else 0.0)
    return {
        "bench": "profile_mixed", "model": a.model, "device": str(dev), "graphed": graphed,
        "side_stream": runner_side(st),
        "batch": n, "bucket": b, "context": a.context, "pieces": len(chunks), "prompt_start": a.prompt_start,
        "prompt_len": a.prompt_len, "prompt_tokens": prompt_tokens, "step_rows": rows,
        "padding_rows": rows - n - prompt_tokens,
        "attention": "fused" if "attn_mixed" in seen else "two",  # one launch, or the decode and chunk kernels
        # rows through the decode kernel and the chunk kernel (or the fused kernel's decode and prompt programs)
        "decode_rows": seen.get("attn_decode", {}).get("rows", 0) or seen.get("attn_mixed", {}).get("decode", 0),
        "prompt_rows": seen.get("attn_chunk", {}).get("rows", 0)
        or seen.get("attn_mixed", {}).get("rows", 0) - seen.get("attn_mixed", {}).get("decode", 0),
        "prompt_pieces": seen.get("attn_chunk", seen.get("attn_mixed", {})).get("pieces", 0),
        "lm_head_rows": seen.get("lm_head", {}).get("rows", 0),
        "gemm_shapes": {k: [v["rows"], v["n"], v["k"]] for k, v in seen.items() if "n" in v},  # M, N, K
        "gemm_tflops": {k: 2 * v["rows"] * v["n"] * v["k"] * (1 if k == "lm_head" else layers) / per[k] / 1e6
                        for k, v in seen.items() if "n" in v and per.get(k)},  # achieved, over all layers
        "step_ms": step_ms, "host_ms": host_ms, "decode_only_ms": decode_ms,
        "us_per_prompt_token": (step_ms - decode_ms) * 1e3 / prompt_tokens, "us_per_row": step_ms * 1e3 / rows,
        "busy_ms": busy / 1e3, "idle_ms": step_ms - busy / 1e3 if dev.type == "cuda" else None,
        # busy sums every kernel; covered counts a moment once however many streams run then: step - covered is
        # the time no kernel runs (launch gaps, the side stream's joins), busy - covered what the streams overlap
        "covered_ms": covered / 1e3 if covered is not None else None,
        "gaps_ms": step_ms - covered / 1e3 if covered is not None else None,
        "attention_wall_ms": attention / 1e3 if attention is not None else None,
        "categories": {c: {"ms": us / 1e3, "share": share(us)} for c, us in cats.items()},
        "labels": {lab: {"ms": us / 1e3, "share": share(us), "category": CATEGORY.get(lab, "other")}
                   for lab, us in sorted(per.items(), key=lambda kv: -kv[1])},
        "aligned": matched / len(items) if dev.type == "cuda" and items else None,
        "top": [{"label": lab, "name": name, "us": us} for (lab, name), us in
                sorted(kernels.items(), key=lambda kv: -kv[1])[:a.top]],
    }


def report(r: dict) -> None:
    print(f"mixed step {r['step_rows']} rows ({r['batch']} decode -> bucket {r['bucket']}, {r['prompt_tokens']} "
          f"prompt in {r['pieces']} piece(s) from position {r['prompt_start']}, {r['padding_rows']} padding), "
          f"{'graph replay' if r['graphed'] else 'eager'} on {r['device']}")
    print(f"step {r['step_ms']:.3f} ms (decode-only {r['decode_only_ms']:.3f} ms; host returns in "
          f"{r['host_ms']:.3f} ms); {r['us_per_prompt_token']:.1f} us per prompt token; busy {r['busy_ms']:.3f} ms")
    if r.get("covered_ms") is not None:
        print(f"kernels run {r['covered_ms']:.3f} ms of the step (no kernel: {r['gaps_ms']:.3f} ms; the streams "
              f"overlap {r['busy_ms'] - r['covered_ms']:.3f} ms; attention's wall {r['attention_wall_ms']:.3f} ms)")
    for c, v in r["categories"].items():
        print(f"  {c:24s} {v['ms']:8.3f} ms {100 * v['share']:5.1f}%")
    for lab, v in r["labels"].items():
        print(f"    {lab:22s} {v['ms']:8.3f} ms {100 * v['share']:5.1f}%")
    print(f"lm_head rows {r['lm_head_rows']} of {r['step_rows']}; GEMM (M, N, K) {r['gemm_shapes']}; TFLOP/s "
          + ", ".join(f"{k} {v:.0f}" for k, v in r["gemm_tflops"].items()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="", help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--mixed", type=int, default=512, help="the step's rows, decode rows included")
    p.add_argument("--batch", type=int, default=64, help="decode rows")
    p.add_argument("--context", type=int, default=1024, help="the decode rows' context")
    p.add_argument("--pieces", type=int, default=1, help="prompt chunks filling the rest, one slot each")
    p.add_argument("--prompt-start", type=int, default=512, help="the chunks' first position (a prefix before)")
    p.add_argument("--prompt-len", type=int, default=1024, help="the prompts' length (last chunk: first token)")
    p.add_argument("--max-batch", type=int, default=256, help="the engine's --max-batch: its buckets")
    p.add_argument("--page", type=int, default=64, help="the pool's --kv-block-tokens (0: slots)")
    p.add_argument("--eager", action="store_true", help="no CUDA graph (the engine's --no-cuda-graphs)")
    p.add_argument("--attention", choices=MIXED_ATTENTIONS, default=None,
                   help="the step's attention: one fused launch where it fuses, or the two kernels (default: the "
                        "engine's, runner.MIXED_ATTENTION)")
    p.add_argument("--no-side-stream", action="store_true",
                   help="the two kernels (--attention two), the prompt rows' attention after the decode rows' on one "
                        "stream (to price the side stream)")
    p.add_argument("--runs", type=int, default=10, help="timed steps (median)")
    p.add_argument("--replays", type=int, default=5, help="profiled steps")
    p.add_argument("--top", type=int, default=12)
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.no_side_stream:  # a price of the two kernels' side stream: the fused launch has none
        if a.attention == "fused":
            parser.error("--no-side-stream prices the two kernels' side stream: use it with --attention two")
        a.attention = "two"
    saved = runner_module.MIXED_ATTENTION
    runner_module.MIXED_ATTENTION = a.attention or saved  # read at each forward
    try:
        with torch.inference_mode():
            r = profile_mixed(a)
    finally:
        runner_module.MIXED_ATTENTION = saved
    report(r)
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
