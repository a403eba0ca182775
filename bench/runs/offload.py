"""Offload bench (the seed's part-3 table): is moving a cache back cheaper than rebuilding it?

Per (model, context length): recompute = one prefill; per host tier: offload and reload
times, reload speed-up over recompute, achieved GB/s; and the break-even link speed
(KV bytes per token / prefill seconds per token) above which shipping a cache beats
recomputing it. Raw link speeds measured in the same run sit beside it for context.

Timings run in the default (fast) mode, medians of `runs` after `warmup`, with a device
sync before every timer. Verification runs apart, in deterministic mode
(never mix the two in one figure): every reload byte-equal to the original cache (the
target is poisoned first, so a reload that copies nothing fails), and N tokens decoded
from the reloaded and the original cache with identical tokens and logits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
from dataclasses import asdict, dataclass

import torch
import transformers

from bench.common import Job, Step, check_devices, csv, default_device, ints
from bench.measure.copies import filesystem, gbps, measure_links, stats
from bench.measure.reference_decode import decode
from bench.measure.stats import clock
from bench.measure.tiers import TIER_KINDS, Tier, make_tiers
from kvtransfer.determinism import enable_deterministic
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from kvtransfer.model.streaming import assemble_cache, cache_layers, caches_equal


@dataclass(frozen=True)
class OffloadConfig:
    models: tuple[str, ...] = ("tiny",)
    lengths: tuple[int, ...] = (128, 512)
    dtype: str = "float32"
    device: str = "cpu"
    runs: int = 5
    warmup: int = 1
    decode_tokens: int = 8
    disk_dir: str | None = None  # None: a fresh temporary directory
    seed: int = 0
    tiers: tuple[str, ...] = TIER_KINDS
    peer_device: str | None = None  # where the `gpu` tier's buffer lives (default: the model device)
    link_bytes: int | None = None  # raw link copy size (default: largest cache, at least 64 MiB)

    def __post_init__(self):
        for m in self.models:
            ModelSpec(m, self.dtype, self.seed)  # raises a clear error for unknown names and dtypes
        if not self.models or not self.lengths or min(self.lengths) < 1:
            raise ValueError("need at least one model and lengths >= 1")
        if self.runs < 1 or self.warmup < 0 or self.decode_tokens < 1:
            raise ValueError("runs and decode_tokens must be >= 1, warmup >= 0")
        bad = set(self.tiers) - set(TIER_KINDS)
        if bad:
            raise ValueError(f"unknown tiers {sorted(bad)}; choose from {', '.join(TIER_KINDS)}")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is cuda but CUDA is not available")


@contextlib.contextmanager
def deterministic():
    """Deterministic kernels for the verification decodes only; the previous mode comes back after."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    enable_deterministic()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.allow_tf32) = saved[2:]


def bench_tier(tier: Tier, layers, model, first, ref, cfg: OffloadConfig) -> dict:
    """Time offload and reload of one tier; verify every reload byte for byte and one by decoding."""
    if not tier.available:
        return dict(available=False, skip_reason=tier.skip_reason)
    tier.prepare(layers)
    try:
        offs, rels, caches, byte_equal = [], [], [], True
        for i in range(cfg.warmup + cfg.runs):
            t_off, _ = clock(lambda: tier.offload(layers), tier.devices)
            tier.out.fill_(0xFF)  # poison: bytes a reload fails to copy cannot pass the check
            caches.append(tier.before_reload())
            t_rel, out = clock(tier.reload, tier.devices)
            byte_equal &= caches_equal(out, layers)
            if i >= cfg.warmup:
                offs.append(t_off)
                rels.append(t_rel)
        with deterministic():
            gen = decode(model, assemble_cache(model.config, out), first, cfg.decode_tokens)
        nbytes = tier.nbytes
    finally:
        tier.close()
    off, rel = stats(offs), stats(rels)
    res = dict(available=True, offload=off, reload=rel,
               offload_gbps=gbps(nbytes, off["median_ms"]), reload_gbps=gbps(nbytes, rel["median_ms"]),
               byte_equal=bool(byte_equal), tokens_equal=gen.tokens == ref.tokens,
               logits_equal=bool(torch.equal(gen.logits, ref.logits)))
    res["decode_equal"] = res["tokens_equal"] and res["logits_equal"]
    if caches and caches[0]:
        timed_caches = caches[cfg.warmup:]
        res["page_cache"] = dict(
            fadvise=all(c["fadvise"] for c in timed_caches),
            drop_caches_tried=any(c["drop_caches_tried"] for c in timed_caches),  # only when fadvise left pages
            drop_caches=any(c["drop_caches"] for c in timed_caches),
            cold=all(c["cold"] for c in timed_caches),
            cold_runs=sum(c["cold"] for c in timed_caches), runs=len(timed_caches),
            resident_fraction_max=max(c["resident_pages"] / max(c["total_pages"], 1) for c in timed_caches))
    return res


def bench_length(name: str, model, geom: CacheGeometry, length: int, cfg: OffloadConfig, directory: str, step: Step) -> dict:
    """One row of the table: recompute, then every tier, for one context length."""
    device = torch.device(cfg.device)
    ids = random_prompt(model.config.vocab_size, length, seed=cfg.seed, device=device)  # (1, length)
    times, cache = [], None
    for i in range(cfg.warmup + cfg.runs):
        cache = None  # free the previous cache before the next prefill allocates one
        t, (cache, first) = clock(lambda: prefill(model, ids), [device])
        if i >= cfg.warmup:
            times.append(t)
    layers = cache_layers(cache)  # per layer (K, V): (1, kv_heads, length, head_dim)
    with deterministic():
        ref = decode(model, cache, first, cfg.decode_tokens)  # appends new tensors; `layers` stay intact
    del cache
    pre = stats(times)
    step(f"{name} {length}: prefill")
    per_token_s = pre["median_ms"] * 1e-3 / length
    row = dict(model=name, length=length, dtype=cfg.dtype, bytes_per_token=geom.bytes_per_token,
               cache_bytes=sum(k.nbytes + v.nbytes for k, v in layers), prefill=pre,
               prefill_us_per_token=per_token_s * 1e6,
               break_even_gbps=geom.bytes_per_token / per_token_s / 1e9, tiers={}, tier_labels={})
    for tier in make_tiers(device, directory, cfg.peer_device, cfg.tiers):
        res = bench_tier(tier, layers, model, first, ref, cfg)
        if res["available"]:
            res["reload_speedup"] = pre["median_ms"] / res["reload"]["median_ms"]
        row["tiers"][tier.kind] = res
        row["tier_labels"][tier.kind] = tier.label  # what it is on this device (a CPU run's `gpu` tier is RAM)
        step(f"{row['model']} {length}: {tier.kind}")
    return row


def total_steps(cfg: OffloadConfig) -> int:
    return len(cfg.models) * len(cfg.lengths) * (1 + len(cfg.tiers)) + 1


def run_offload(cfg: OffloadConfig, step: Step = lambda _: None) -> dict:
    """The whole table as a JSON-serializable dict; `ok` is False when any verification failed."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first CUDA matmul
    torch.manual_seed(cfg.seed)
    with contextlib.ExitStack() as stack:
        directory = cfg.disk_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvoffload-"))
        os.makedirs(directory, exist_ok=True)
        rows, largest = [], 0
        for name in cfg.models:
            spec = ModelSpec(name, cfg.dtype, cfg.seed)
            model = load_model(spec, cfg.device)
            geom = CacheGeometry.from_config(model.config, spec.torch_dtype)
            for length in cfg.lengths:
                rows.append(bench_length(name, model, geom, length, cfg, directory, step))
                largest = max(largest, rows[-1]["cache_bytes"])
            del model
            if torch.device(cfg.device).type == "cuda":
                torch.cuda.empty_cache()
        links = measure_links(cfg.device, cfg.link_bytes or max(largest, 64 << 20), directory, cfg.runs,
                              cfg.warmup, cfg.peer_device)
        step("raw links")
        fs = filesystem(directory)
    checks = [t[k] for r in rows for t in r["tiers"].values() if t["available"]
              for k in ("byte_equal", "tokens_equal", "logits_equal")]
    dev = torch.device(cfg.device)
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               host_cpus=os.cpu_count(), device_name=(torch.cuda.get_device_name(dev) if dev.type == "cuda"
                                                      else platform.processor() or "cpu"),
               disk_dir=directory, disk_fs=fs)
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}  # as JSON reads back
    return dict(kind="offload", ok=all(checks), config=config, env=env, rows=rows, links=links)


HELP = "recompute vs offload/reload per host tier (the seed's part-3 table)"
DESCRIPTION = ("Per model and context length: prefill time, offload and reload time per tier, "
               "reload speed-up, GB/s, break-even link speed; every reload verified.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="preset or local dir; repeatable or comma list (default tiny)")
    p.add_argument("--lengths", type=ints, default=[128, 512], help="comma list of prompt lengths (default 128,512)")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", help="default cuda if available, else cpu")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    p.add_argument("--decode-tokens", type=int, default=8, help="tokens decoded to verify each reload")
    p.add_argument("--tiers", type=csv, default=list(TIER_KINDS), help=f"comma list of {','.join(TIER_KINDS)} (gpu: a buffer on --device, "
                   "or --peer-device; on a CPU run that is a second copy in RAM)")
    p.add_argument("--peer-device", help="device for the gpu tier's buffer, e.g. cuda:1 (default: model device)")
    p.add_argument("--link-mib", type=int, help="raw link copy size in MiB (default: largest cache, >= 64)")
    p.add_argument("--disk-dir", help="directory for the disk tier's file (default: a fresh temp dir)")
    p.add_argument("--out", help="write result.json and report.md in this directory")
    p.add_argument("--seed", type=int, default=0)


def job(args: argparse.Namespace) -> Job:
    device = args.device or default_device()
    check_devices({"--device": device, "--peer-device": args.peer_device})
    dtype = args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    models = [m for item in (args.model or ["tiny"]) for m in csv(item)]
    cfg = OffloadConfig(models=tuple(models), lengths=tuple(args.lengths), dtype=dtype, device=device,
                        runs=args.runs, warmup=args.warmup, decode_tokens=args.decode_tokens,
                        disk_dir=args.disk_dir, seed=args.seed, tiers=tuple(args.tiers),
                        peer_device=args.peer_device,
                        link_bytes=args.link_mib << 20 if args.link_mib else None)
    return Job(total_steps(cfg), lambda step: run_offload(cfg, step))
