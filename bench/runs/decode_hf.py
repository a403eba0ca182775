"""The HF baselines of `kvtransfer-bench decode`: what one decode step costs without the engine.

Why two: `eager` is what the servers ran before the engine (one HF forward of B new tokens over a
DynamicCache, which concatenates every layer's K/V each step: that copy is part of HF's cost
and is measured); `static-compile` is the best plain HF can do (gpt-fast's recipe: a StaticCache
and torch.compile(mode="reduce-overhead"), i.e. Inductor kernels replayed as CUDA graphs). Each
compile is costly, so it runs only at --hf-compile-points.
Both caches hold B x C random K/V (the times do not depend on values); every timed call appends
one token at position C and the cache is put back to C tokens (untimed) before the next call,
so every run attends over exactly C + 1 tokens, as the engine's step does over C.
"""

from __future__ import annotations

import inspect
import sys

import torch

from bench.measure.decode_measure import Grid, budget, time_calls
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.streaming import assemble_cache, cache_kwarg


def hf_bytes(geom: CacheGeometry, batch: int, tokens: int) -> int:
    """Rough peak of an HF step over a B x `tokens` cache: the cache, one layer's concatenated copy and the GQA
    repeat of one layer's K/V (when SDPA does not take GQA itself)."""
    cache = batch * tokens * geom.bytes_per_token
    return cache + cache // geom.num_layers * 9  # 1 concatenated layer + up to 8x repeat of one layer


def _inputs(model, batch: int, ctx: int, device: torch.device, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed + batch * 7919 + ctx)
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1), device=device, generator=gen)  # (B, 1)
    positions = torch.full((batch, 1), ctx, dtype=torch.long, device=device)  # (B, 1): the new token is at C
    return dict(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=1)


@torch.inference_mode()
def hf_eager(model, geom: CacheGeometry, batch: int, ctx: int, cfg, device: torch.device) -> dict:
    shape = geom.layer_shape(ctx, batch)  # (B, kv_heads, C, head_dim)
    layers = [(torch.randn(shape, dtype=geom.dtype, device=device), torch.randn(shape, dtype=geom.dtype, device=device))
              for _ in range(geom.num_layers)]
    cache = assemble_cache(model.config, layers)  # holds these tensors: no concatenation to build it
    del layers  # the cache's first step replaces them; nothing else may keep B x C alive
    kw = _inputs(model, batch, ctx, device, cfg.seed) | {cache_kwarg(model): cache}
    return time_calls(lambda: model(**kw), device, cfg.runs, cfg.warmup, reset=lambda: cache.crop(-1))


@torch.no_grad()  # not inference_mode: the compiled graph and its static cache addresses want plain tensors
def hf_static_compile(model, geom: CacheGeometry, batch: int, ctx: int, cfg, device: torch.device) -> dict:
    from transformers import StaticCache

    torch._dynamo.reset()  # a fresh compile per point; frees the previous point's graphs
    cache = StaticCache(config=model.config, max_cache_len=ctx + 64)
    empty = torch.zeros(geom.layer_shape(0, batch), dtype=geom.dtype, device=device)  # (B, kv_heads, 0, head_dim)
    for layer in cache.layers:
        layer.lazy_initialization(empty, empty)  # what Cache.early_initialization does, on every 5.x
        layer.keys[:, :, :ctx].normal_()  # (B, kv_heads, C + 64, head_dim): C random tokens, zeros after
        layer.values[:, :, :ctx].normal_()
    lengths = [layer.cumulative_length for layer in cache.layers if hasattr(layer, "cumulative_length")]
    for n in lengths:  # 5.2x+: the layer counts its tokens (older ones take cache_position instead)
        n.fill_(ctx)
    kw = _inputs(model, batch, ctx, device, cfg.seed) | {cache_kwarg(model): cache}
    if "cache_position" in inspect.signature(model.forward).parameters:
        kw["cache_position"] = torch.tensor([ctx], device=device)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False, dynamic=False)

    def reset() -> None:
        for n in lengths:
            n.fill_(ctx)

    try:  # at least 3 untimed calls: compile, cudagraph warm-up, record
        return time_calls(lambda: forward(**kw), device, cfg.runs, max(cfg.warmup, 3), reset=reset)
    finally:
        del forward, cache
        torch._dynamo.reset()


def hf_context(model, geom: CacheGeometry, ctx: int, cfg, grid: Grid) -> None:
    """The HF cells of one context: eager at every batch, static-compile at the --hf-compile-points there."""
    runs = [("eager", b) for b in (cfg.batches if "eager" in cfg.hf else ())]
    runs += [("static-compile", b) for b, c in cfg.hf_compile_points if c == ctx and "static-compile" in cfg.hf]
    for kind, b in runs:
        need, room = hf_bytes(geom, b, ctx + (1 if kind == "eager" else 64)), budget(grid.device, cfg.mem_fraction)
        if need > room:
            grid.skip(b, ctx, f"hf {kind}", f"needs ~{need / 2**30:.1f} GiB > {room / 2**30:.1f} GiB free "
                      "under --mem-fraction")
        else:
            def one(kind=kind, b=b) -> None:
                s = (hf_eager if kind == "eager" else hf_static_compile)(model, geom, b, ctx, cfg, grid.device)
                grid.cell(b, ctx)["hf_eager_ms" if kind == "eager" else "hf_static_compile_ms"] = s["p50"]
                print(f"decode: hf {kind} {b}x{ctx}: {s['p50']:.3f} ms", file=sys.stderr, flush=True)

            grid.guard([(b, ctx)], f"hf {kind}", one)
        grid.progress(f"hf {kind} {b}x{ctx}")
