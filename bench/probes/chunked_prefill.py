"""A chunked local prefill's pieces, timed on one GPU: where a long prompt's chunks spend host and device time.

Why: the interference bench's chunked arm (`--prefill-chunk 512`, a 32k prompt beside 32 decoding streams) showed the
streams' longest gap at the prompt's last chunk, and a scheduler trace (bench/probes/sched_trace) showed each chunk's
forward holding the serving thread as long as the device ran it (~40 ms for 512 tokens), the last one (256 tokens)
~117 ms. This runs the engine's chunk loop (engine.prefill_job's: `prefill` with the cache so far, later chunks
through chunk_attention) alone, with no pool and no server, twice per variant (cold: every shape new; warm), and
records per chunk the host's launch time (until the forward returns) and the device time (events, synchronized
after each chunk). Variants:
  default  the tree's chunk_attention (SDPA's own choice from CUDNN_MIN_TOKENS keys on);
  no-cudnn chunk_attention under SDPA_BACKENDS at every length (flash, efficient, math).
With --profile, torch.profiler's top ops (self CPU and CUDA time) for the cold pass's last chunk and one chunk at
~20k keys. Run on the GPU machine: `python3 -m bench.probes.chunked_prefill --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

import kvtransfer.engine.chunk_attention as CA
from kvtransfer.model import fused_prefill as FP
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model


def run(model, ids: torch.Tensor, chunk: int, profile_at: set[int], prof_dir: Path | None, tag: str) -> list[dict]:
    """One chunked prefill of ids (1, n); per chunk: start, tokens, host launch ms, device ms, host total ms."""
    n, start, cache, rows = ids.shape[1], 0, None, []
    while start < n:
        end = min(n, start + chunk)
        i = len(rows)
        prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                   torch.profiler.ProfilerActivity.CUDA])
                if prof_dir is not None and i in profile_at else None)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with prof if prof is not None else nullcontext():
            t0 = time.perf_counter()
            e0.record()
            with CA.chunk_attention_on(model) if start else nullcontext():
                cache, logits = prefill(model, ids[:, start:end], cache=cache)
            e1.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        rows.append(dict(i=i, start=start, tokens=end - start, launch_ms=(t1 - t0) * 1e3,
                         device_ms=e0.elapsed_time(e1), total_ms=(t2 - t0) * 1e3))
        if prof is not None:
            for key in ("self_cpu_time_total", "self_cuda_time_total"):
                (prof_dir / f"{tag}-chunk{i}-{key}.txt").write_text(
                    prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
        start = end
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--tokens", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    model = load_model(ModelSpec(a.model, "bfloat16", 0), "cuda")
    ids = random_prompt(model.config.vocab_size, a.tokens, device="cuda")
    chunks = -(-a.tokens // a.chunk)
    profile_at = {chunks - 1, (20000 // a.chunk)}
    default = CA.prompt_attention
    out = {"gpu": torch.cuda.get_device_name(), "tokens": a.tokens, "chunk": a.chunk, "torch": torch.__version__,
           "cudnn_min_tokens": FP.CUDNN_MIN_TOKENS, "variants": {}}
    for variant in ("default", "no-cudnn"):
        CA.prompt_attention = default if variant == "default" else (lambda kv_len: sdpa_kernel(FP.SDPA_BACKENDS))
        for pass_ in ("cold", "warm"):
            rows = run(model, ids, a.chunk, profile_at, a.out if a.profile and pass_ == "cold" else None,
                       f"{variant}-{pass_}")
            out["variants"][f"{variant}/{pass_}"] = rows
            later = [r for r in rows[1:-1]]
            summary = {k: sorted(r[k] for r in later)[len(later) // 2] for k in ("launch_ms", "device_ms", "total_ms")}
            print(f"{variant:9} {pass_}: median of chunks 2..{len(rows) - 1}: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in summary.items()) +
                  f"; last ({rows[-1]['tokens']} tokens): launch {rows[-1]['launch_ms']:.1f} device "
                  f"{rows[-1]['device_ms']:.1f} total {rows[-1]['total_ms']:.1f}; "
                  f"first: total {rows[0]['total_ms']:.1f}")
            print("   per chunk total ms:", " ".join(f"{r['total_ms']:.0f}" for r in rows))
    CA.prompt_attention = default
    (a.out / "chunked_prefill.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
