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

import contextlib
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import transformers

from kvtransfer.determinism import enable_deterministic
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec, load_model
from kvtransfer.model.prefill import decode, prefill, random_prompt
from kvtransfer.model.streaming import assemble_cache, cache_layers, caches_equal
from bench.measure.pagecache import drop_page_cache, read_file, write_file
from bench.measure.tiers import TIER_KINDS, Tier, make_tiers

from bench.stats import clock, spread_ms, timed

Step = Callable[[str], None]  # called once per finished step with a short description


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


def stats(seconds: list[float]) -> dict:
    return spread_ms(seconds) | dict(runs=len(seconds))


def gbps(nbytes: int, ms: float) -> float | None:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None  # None, not inf: stays valid JSON


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


def measure_links(device: str, nbytes: int, directory: str, runs: int, warmup: int,
                  peer_device: str | None = None) -> dict:
    """Raw copies of `nbytes` in the same run: device clone, pinned/pageable D2H and H2D (on CPU the
    pageable pair is a host memcpy, as the pageable tier is there), peer copy, file write/read."""
    device = torch.device(device)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.copy_(src)  # the file ops write these bytes
    ops: dict[str, Callable[[], object]] = {"device_clone": lambda: dst.copy_(src)}
    if device.type == "cuda":
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        ops |= {"d2h_pinned": lambda: pinned.copy_(src, non_blocking=True),
                "h2d_pinned": lambda: dst.copy_(pinned, non_blocking=True)}
    ops |= {"d2h_pageable": lambda: host.copy_(src), "h2d_pageable": lambda: dst.copy_(host)}
    if peer_device is not None:
        peer = torch.empty(nbytes, dtype=torch.uint8, device=peer_device)
        ops["device_to_peer"] = lambda: peer.copy_(src, non_blocking=True)
    devices = [device] + ([torch.device(peer_device)] if peer_device else [])
    path = os.path.join(directory, f"kvlink-{os.getpid()}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    mv, caches = memoryview(host.numpy()), []
    ops |= {"file_write": lambda: write_file(fd, mv, fsync=False),
            "file_write_fsync": lambda: write_file(fd, mv, fsync=True),
            "file_read": lambda: read_file(fd, mv)}
    out = dict(bytes=nbytes)
    try:
        for name, fn in ops.items():
            before = (lambda: caches.append(drop_page_cache(fd, nbytes))) if name == "file_read" else None
            out[name] = stats(timed(fn, devices, runs, warmup, before=before))
            out[name]["gbps"] = gbps(nbytes, out[name]["median_ms"])
        out["file_read"]["cold"] = all(c["cold"] for c in caches[warmup:])
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def filesystem(path: str) -> str:
    """Filesystem type holding `path` (longest mount point that prefixes it), e.g. ext4 or tmpfs."""
    best, fstype, real = "", "unknown", os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, typ
    return fstype


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
