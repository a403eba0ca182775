"""A chunked local prefill's pieces, timed on one GPU: where a long prompt's chunks spend host and device time.

Why: the interference bench's chunked arm (`--prefill-chunk 512`, a 32k prompt beside 32 decoding streams) showed the
streams' longest gap at the prompt's last chunk, and a scheduler trace (bench/probes/sched_trace) showed each chunk's
forward holding the serving thread as long as the device ran it (~40 ms for 512 tokens), the last one (256 tokens)
~117 ms. This runs the engine's chunk loop (engine.prefill_job's: `prefill` with the cache so far, every chunk after
the first padded to the chunk) alone, with no pool and no server, twice per variant (cold: its first pass, after the
variants before it; warm), and records per chunk the host's launch time (until the forward returns) and the device
time (events, synchronized after each chunk). Variants:
  fused  the tree's: every piece on the fused ops into one block for the prompt (fused_prefill.chunk_cache);
  hf     the HF forward with chunk_attention for the later chunks, its cache concatenated per chunk (the chunk
         path before the fused one).
Each pass also reports its first token's logits against the fused cold pass's (max |diff| / max |logit|).
With --profile, torch.profiler's top ops (self CPU and CUDA time) for each pass's third chunk (a short context),
one chunk at ~20k keys and the last chunk (padded): warm, the fused chunks' launch took about their device time
(bench/results/stall-h100-2026-12-07, call 11), and the profiles say where the host spends it. Run on the GPU machine:
`python3 -m bench.probes.chunked_prefill --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import kvtransfer.engine.chunk_attention as CA
from kvtransfer.engine.engine import pad_chunk
from kvtransfer.model import fused_prefill as FP
from kvtransfer.model.fused_prefill import chunk_cache
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model


def run(model, ids: torch.Tensor, chunk: int, fused: bool, profile_at: set[int], prof_dir: Path | None,
        tag: str) -> tuple[list[dict], torch.Tensor]:
    """One chunked prefill of ids (1, n) -> (per chunk: start, tokens, host launch ms, device ms, host total ms;
    the first token's logits (vocab,))."""
    n, start, rows = ids.shape[1], 0, []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cache = chunk_cache(model, n + chunk) if fused else None  # the engine allocates it before the first piece
    block_ms = (time.perf_counter() - t0) * 1e3
    while start < n:
        end = min(n, start + chunk)
        i = len(rows)
        piece, row = pad_chunk(ids[:, start:end], chunk) if start else (ids[:, start:end], -1)
        prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                   torch.profiler.ProfilerActivity.CUDA])
                if prof_dir is not None and i in profile_at else None)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with prof if prof is not None else nullcontext():
            t0 = time.perf_counter()
            e0.record()
            with CA.chunk_attention_on(model) if start and not fused else nullcontext():
                cache, logits = prefill(model, piece, cache=cache, row=row)
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
    rows[0]["block_ms"] = block_ms
    return rows, logits.float()


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
    profile_at = {2, chunks - 1, (20000 // a.chunk)}  # a short context, ~20k keys, the padded last chunk
    out = {"gpu": torch.cuda.get_device_name(), "tokens": a.tokens, "chunk": a.chunk, "torch": torch.__version__,
           "cudnn_min_tokens": FP.CUDNN_MIN_TOKENS, "variants": {}}
    ref = None
    for variant in ("fused", "hf"):
        for pass_ in ("cold", "warm"):
            rows, logits = run(model, ids, a.chunk, variant == "fused", profile_at,
                               a.out if a.profile else None, f"{variant}-{pass_}")
            ref = logits if ref is None else ref
            gap = ((logits - ref).abs().max() / ref.abs().max()).item()
            out["variants"][f"{variant}/{pass_}"] = {"chunks": rows, "logits_vs_fused_cold": gap}
            later = [r for r in rows[1:-1]]
            summary = {k: sorted(r[k] for r in later)[len(later) // 2] for k in ("launch_ms", "device_ms", "total_ms")}
            print(f"{variant:5} {pass_}: median of chunks 2..{len(rows) - 1}: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in summary.items()) +
                  f"; last ({rows[-1]['tokens']} tokens): launch {rows[-1]['launch_ms']:.1f} device "
                  f"{rows[-1]['device_ms']:.1f} total {rows[-1]['total_ms']:.1f}; "
                  f"first: total {rows[0]['total_ms']:.1f}; sum {sum(r['total_ms'] for r in rows):.0f} ms; "
                  f"logits vs fused cold {gap:.5f}")
            print("   per chunk total ms:", " ".join(f"{r['total_ms']:.0f}" for r in rows))
    (a.out / "chunked_prefill.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
