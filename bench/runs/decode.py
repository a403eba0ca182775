"""Step time of the batched decode engine over a (batch, context) grid, beside its floor and HF.

Why: the engine's claim is that one step costs about what its
bytes cost: every weight once plus each row's live K/V, read at the device's memory bandwidth.
So the same run measures that bandwidth (one large device-to-device copy), prices every cell
(floor), times the engine's step (CUDA graph per bucket; eager on CPU or --no-cuda-graphs) and,
per cell, the HF forward it replaces: eager over a DynamicCache and, at a few points,
StaticCache + torch.compile(mode="reduce-overhead") (bench.runs.decode_hf). Each context gets a
fresh pool filled with random K/V (times do not depend on values); a cell that does not fit
--mem-fraction is skipped with its size, one that runs out of memory is skipped with the
error, and the run goes on. One sanity check per context: the timed step's logits for row 0
equal the eager `runner.forward` of that row alone (relative L2 <= 5e-2 in bf16, 1e-4 in fp32).
The timed step ends with the token chosen as the decode server chooses it: argmax (greedy, the default), or with
--temperature > 0 every row's draw (seeded, --top-p, --top-k; the step's sampling graph per bucket,
kvtransfer/engine/sampler.py). A sampling run times the greedy step too, in the same process over the same graphs,
the two alternating PAIRED_ROUNDS times per cell, and reports sampling / greedy per cell: the price of sampling
with no process-to-process drift in it.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from bench.common import Job, csv, ints
from bench.measure.decode_measure import Grid, Progress, bandwidth_gbps, budget, time_calls
from bench.report.decode import finish_cell, targets
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import pick_device
from kvtransfer.model.spec import DTYPES, ModelSpec, load_model

HF_KINDS = ("eager", "static-compile")


@dataclass(frozen=True)
class DecodeBenchConfig:
    model: str
    dtype: str
    device: str
    batches: tuple[int, ...] = (1, 8, 32, 64)
    contexts: tuple[int, ...] = (1024, 8192, 32768)
    runs: int = 20
    warmup: int = 3
    cuda_graphs: bool = True
    hf: tuple[str, ...] = ("eager",)
    hf_compile_points: tuple[tuple[int, int], ...] = ()  # (batch, context)
    mem_fraction: float = 0.85
    seed: int = 0
    temperature: float = 0.0  # > 0: every row samples (seed + row), the draw timed with the step
    top_p: float = 1.0
    top_k: int = 0
    kv_block_tokens: int = 0  # > 0: the pool in blocks of this many tokens, each row's blocks scattered
    batch_invariant: bool = False  # the servers' --batch-invariant step (docs/batch-invariance.md)

    def __post_init__(self):
        ModelSpec(self.model, self.dtype)
        if self.kv_block_tokens < 0:
            raise ValueError("--kv-block-tokens must be >= 0 (0: the slot layout)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("--temperature must be finite and >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("--top-p must be in (0, 1] and --top-k >= 0")
        if not self.batches or min(self.batches) < 1 or not self.contexts or min(self.contexts) < 2:
            raise ValueError("batches must be >= 1 and contexts >= 2 (non-empty lists)")
        if self.runs < 2 or self.warmup < 0:
            raise ValueError("runs must be >= 2 (p10/p90) and warmup >= 0")
        if not set(self.hf) <= set(HF_KINDS):
            raise ValueError(f"--hf takes a subset of {','.join(HF_KINDS)} or none")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError("--mem-fraction must be in (0, 1]")
        if "static-compile" in self.hf and not {c for _, c in self.hf_compile_points} <= set(self.contexts):
            raise ValueError("every --hf-compile-points context must be one of --contexts")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is cuda but CUDA is not available")


BACK_TO_BACK = 10  # steps per sample of the back-to-back figure
PAIRED_ROUNDS = 3  # --temperature: greedy and sampling timed alternately, this many times each per cell


def points(text: str) -> list[tuple[int, int]]:
    """'1x1024,8x1024' -> [(1, 1024), (8, 1024)]."""
    try:
        return [(int(b), int(c)) for b, c in (p.strip().lower().split("x") for p in text.split(",") if p.strip())]
    except ValueError:
        raise ValueError(f"expected BATCHxCONTEXT points like 1x1024,8x1024, got {text!r}") from None


def weights_read(model) -> int:
    """Bytes of weights one step reads: every parameter once, less the embedding table (a step reads B of its
    rows) unless it is tied to lm_head (then it is read whole, once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied parameters appear once
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = emb.data_ptr() == head.data_ptr()
    return total if tied else total - emb.numel() * emb.element_size()


def tolerance(dtype: torch.dtype) -> float:
    """Relative L2 error allowed between a batched row and the same row alone (kernels differ by shape)."""
    return 1e-4 if dtype == torch.float32 else 5e-2


def inputs(b: int, ctx: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """tokens, positions, slots, each (B,): B random tokens at position ctx - 1 of slots 0..B-1 (ctx live tokens)."""
    dev = gen.device
    return (torch.randint(0, vocab, (b,), device=dev, generator=gen),
            torch.full((b,), ctx - 1, dtype=torch.long, device=dev), torch.arange(b, device=dev))


def sanity_check(step, runner, b: int, ctx: int, gen: torch.Generator, grid: Grid, sanity: list[dict]) -> None:
    """Row 0 of the timed step at batch b vs the eager `runner.forward` of that row alone."""
    dtype = runner.pool.geometry.dtype
    tokens, positions, slots = inputs(b, ctx, runner.embed.shape[0], gen)
    got = step(tokens, positions, slots)[0].float()  # (vocab,): copied out of the graph's output buffer
    ref = runner.forward(tokens[:1], positions[:1], slots[:1])[0].float()
    diff, rel = (got - ref).abs().max().item(), ((got - ref).norm() / ref.norm()).item()
    ok = bool(torch.isfinite(got).all()) and rel <= tolerance(dtype)
    sanity.append(dict(context=ctx, batch=b, graphed=bool(step.graphs), max_abs_diff=diff, rel_l2=rel,
                       ref_max_abs=ref.abs().max().item(), ok=ok))
    if not ok:
        grid.failures.append(f"sanity {b}x{ctx}: step row 0 vs eager forward alone: relative L2 error {rel:.3g} > "
                             f"{tolerance(dtype):g}")


def engine_context(model, geom: CacheGeometry, ctx: int, batches: list[int], cfg: DecodeBenchConfig, grid: Grid,
                   sanity: list[dict]) -> None:
    """One pool of max(batches) slots x (ctx + 8) tokens; every batch timed at position ctx - 1 (ctx tokens live),
    then the sanity check at the largest batch that ran."""
    from kvtransfer.engine.graphs import Step  # the engine (and its kernels) only when this bench runs
    from kvtransfer.engine.pool import KVPool
    from kvtransfer.engine.runner import StepRunner
    from kvtransfer.engine.sampler import Draws, SamplingParams, next_tokens
    rows, page = max(batches), cfg.kv_block_tokens
    pool = KVPool(geom, grid.device, slots=rows, max_seq=ctx + 8, page=page,
                  blocks=rows * -(-(ctx + 8) // page) if page else 0)
    if page:  # every row leased with its context's blocks, handed out in a shuffled order (as a busy pool's are)
        perm = torch.randperm(len(pool._free_blocks), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        pool._free_blocks = [pool._free_blocks[i] for i in perm]
        leases = [pool.try_lease(ctx + 8) for _ in range(rows)]
        assert [le.slot for le in leases] == list(range(rows))  # rows 0..B-1, as inputs() names them
    pool.kv.normal_()  # (layers, 2, blocks + 1, kv_heads, page, head_dim): values do not change the times
    runner = StepRunner(model, pool, invariant=cfg.batch_invariant)  # fuses the weights once (idempotent)
    sampling = cfg.temperature > 0
    step = Step(runner, max(batches), cfg.cuda_graphs, sampling=sampling)
    gen = torch.Generator(device=grid.device).manual_seed(cfg.seed + ctx)
    for b in batches:
        tokens, positions, slots = inputs(b, ctx, model.config.vocab_size, gen)
        draws = Draws([SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed + j) for j in range(b)],
                      [ctx] * b)  # each row draws the token after its ctx live ones

        def greedy() -> torch.Tensor:  # one step as the scheduler queues it, then argmax: (b,) tokens
            return next_tokens(step(tokens, positions, slots))

        def drawn() -> torch.Tensor:  # the step, then every row's draw: (b,) tokens
            return step.sampler(step(tokens, positions, slots), draws)

        timed_step = drawn if sampling else greedy

        def one() -> None:
            s = time_calls(timed_step, grid.device, cfg.runs, cfg.warmup)
            extra = {}
            if sampling:  # greedy beside it, alternating: the rounds' medians
                rounds = [(time_calls(greedy, grid.device, cfg.runs, 1), s if r == 0 else
                           time_calls(drawn, grid.device, cfg.runs, 1)) for r in range(PAIRED_ROUNDS)]
                s = {k: statistics.median(x[k] for _, x in rounds) for k in ("p50", "p10", "p90")}
                g = statistics.median(x["p50"] for x, _ in rounds)
                extra = dict(step_ms_greedy_p50=g, sampling_over_greedy=s["p50"] / g,
                             paired_rounds=[dict(greedy_p50=x["p50"], sampling_p50=y["p50"]) for x, y in rounds])
            # BACK_TO_BACK steps queued with no host wait between them, as the overlapping scheduler runs them
            chain = time_calls(lambda: [timed_step() for _ in range(BACK_TO_BACK)], grid.device, cfg.runs, 1)
            grid.cell(b, ctx).update(step_ms_p50=s["p50"], step_ms_p10=s["p10"], step_ms_p90=s["p90"],
                                     step_ms_back_to_back_p50=chain["p50"] / BACK_TO_BACK, graphed=bool(step.graphs),
                                     **extra)
            print(f"decode: engine {b}x{ctx}: {s['p50']:.3f} ms" + (
                f" (greedy {extra['step_ms_greedy_p50']:.3f} ms, x{extra['sampling_over_greedy']:.3f})"
                if extra else ""), file=sys.stderr, flush=True)

        grid.guard([(b, ctx)], "engine", one)
        grid.progress(f"engine {b}x{ctx}")
    ran = [b for b in batches if "step_ms_p50" in grid.cells.get((b, ctx), {})]
    if ran:
        grid.guard([(max(ran), ctx)], "sanity", lambda: sanity_check(step, runner, max(ran), ctx, gen, grid, sanity))


def run_decode(cfg: DecodeBenchConfig, progress: Progress = lambda _: None) -> dict:
    from bench.runs.decode_hf import hf_context
    device = pick_device(cfg.device)
    bw, bw_bytes = bandwidth_gbps(device)
    print(f"decode: device bandwidth {bw:.1f} GB/s ({bw_bytes >> 20} MiB copy)", file=sys.stderr, flush=True)
    model = load_model(ModelSpec(cfg.model, cfg.dtype, cfg.seed), device)
    geom = CacheGeometry.from_config(model.config, DTYPES[cfg.dtype])
    wbytes = weights_read(model)
    grid, sanity = Grid(device, progress), []
    for ctx in cfg.contexts:
        per_slot, room = (ctx + 8) * geom.bytes_per_token, budget(device, cfg.mem_fraction)
        fit = [b for b in cfg.batches if (b + 1) * per_slot <= room]
        for b in sorted(set(cfg.batches) - set(fit)):
            grid.skip(b, ctx, "engine", f"pool of {b}+1 slots x {ctx + 8} tokens = {(b + 1) * per_slot / 2**30:.1f} "
                      f"GiB > {room / 2**30:.1f} GiB free under --mem-fraction")
            progress(f"engine {b}x{ctx} skipped")
        if fit:
            grid.guard([(b, ctx) for b in fit], "engine", lambda: engine_context(model, geom, ctx, fit, cfg, grid,
                                                                                 sanity))
        hf_context(model, geom, ctx, cfg, grid)  # after the pool is gone: never both in memory
    cells = [finish_cell(c, wbytes, geom.bytes_per_token, bw) for _, c in sorted(grid.cells.items(),
                                                                                 key=lambda kv: kv[0][::-1])]
    failures = grid.failures + [f"no engine cell ran for {cfg.model}"] * (not any(c["step_ms_p50"] for c in cells))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    config = {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
              for k, v in asdict(cfg).items()}
    return {"kind": "decode", "bench": "decode", "ok": not failures, "failures": failures, "config": config,
            "device": str(device), "gpu_name": name, "model": cfg.model, "dtype": cfg.dtype,
            "bandwidth_gbps": bw, "bandwidth_copy_bytes": bw_bytes, "weights_bytes": wbytes,
            "bytes_per_token": geom.bytes_per_token, "cells": cells, "skipped": grid.skipped, "sanity": sanity,
            "targets": targets(cells), "env": dict(python=platform.python_version(), torch=torch.__version__,
                                                    host_cpus=os.cpu_count())}


def total_steps(cfg: DecodeBenchConfig) -> int:
    hf = len(cfg.batches) if "eager" in cfg.hf else 0
    compiled = len(cfg.hf_compile_points) if "static-compile" in cfg.hf else 0
    return len(cfg.contexts) * (len(cfg.batches) + hf) + compiled


HELP = "batched decode engine: step time over (batch, context) vs floor and HF"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset or local dir (default qwen2.5-7b on cuda, tiny on cpu)")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", help="default cuda if available, else cpu")
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64], help="comma list (default 1,8,32,64)")
    p.add_argument("--contexts", type=ints, default=[1024, 8192, 32768], help="tokens each row attends over")
    p.add_argument("--runs", type=int, default=20, help="timed steps per cell (p50, p10, p90 reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-cuda-graphs", action="store_true", help="time the engine's step eagerly")
    p.add_argument("--hf", type=csv, default=["eager"], help="HF baselines: eager,static-compile or none")
    p.add_argument("--hf-compile-points", default="1x1024,8x1024",
                   help="BATCHxCONTEXT cells where static-compile runs (about 1 min of compile each)")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="skip cells that would not fit this share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy steps (default); > 0: every row samples, seeded, the draw timed with the step")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampling rows, (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="top-k of the sampling rows (0: all)")
    p.add_argument("--kv-block-tokens", type=int, default=0,
                   help="the pool in blocks of this many tokens, each row's scattered (0: the slot layout)")
    p.add_argument("--batch-invariant", action="store_true", help="time the step of the servers' --batch-invariant "
                   "mode (fixed-tile GEMMs, attention cut at a fixed split; docs/batch-invariance.md)")
    p.add_argument("--out", help="write result.json, report.md and decode.png in this directory")


def job(args: argparse.Namespace) -> Job:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    hf = tuple(x for x in args.hf if x != "none")
    cfg = DecodeBenchConfig(model=args.model or ("qwen2.5-7b" if cuda else "tiny"),
                       dtype=args.dtype or ("bfloat16" if cuda else "float32"), device=device,
                       batches=tuple(args.batches), contexts=tuple(args.contexts), runs=args.runs,
                       warmup=args.warmup, cuda_graphs=not args.no_cuda_graphs, hf=hf,
                       hf_compile_points=tuple(points(args.hf_compile_points)), mem_fraction=args.mem_fraction,
                       seed=args.seed, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       kv_block_tokens=args.kv_block_tokens, batch_invariant=args.batch_invariant)
    return Job(total_steps(cfg), lambda step: run_decode(cfg, step))
