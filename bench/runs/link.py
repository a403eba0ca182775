"""Raw link speeds in one run: the ceilings every transfer figure is read against.

Why one command: every overhead this repo reports is read beside the raw links measured on
the same machine in the same run. This measures them all at one cache size: torch.distributed
p2p (NCCL between cuda:0 and cuda:1, gloo on CPU) as one whole-cache message and as one
message per layer; the peer copy cuda:0 -> cuda:1 (copy engine); pinned and pageable
H2D/D2H; on loopback a TCP socket, raw-bytes gRPC (bench.measure.loopback: the library's
ceiling) and kvtransfer's gRPC transport (its own probe); disk write/read. Medians of
>= 5 after warm-up with a device sync before each timer. A probe that cannot run here (no
second GPU, no CUDA) is skipped with its reason; a probe that fails fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench.common import Job, Step, csv
from bench.measure.copies import filesystem, measure_links
from bench.measure.p2p import cache_patterns, measure_p2p
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import DTYPES, ModelSpec, load_config

PROBES = ("p2p", "copies", "loopback", "backend")  # copies: device clone, peer, H2D/D2H, disk
ORDER = ("p2p_whole", "p2p_layer", "peer_copy", "device_clone", "h2d_pinned", "d2h_pinned", "h2d_pageable",
         "d2h_pageable", "socket", "grpc", "grpc_backend", "disk_write", "disk_write_fsync", "disk_read")
RENAME = {"device_to_peer": "peer_copy", "file_write": "disk_write", "file_write_fsync": "disk_write_fsync",
          "file_read": "disk_read"}  # bench.measure.copies.measure_links names -> these
UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def size(text: str) -> int:
    """'4194304', '64MiB', '1.75GiB', '500MB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?(?:i?b)?)\s*", text.lower())
    unit = m and m.group(2).replace("ib", "").replace("i", "")
    if not m or unit not in UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB, 1.75GiB, 500MB)")
    return int(float(m.group(1)) * UNITS[unit])


@dataclass(frozen=True)
class LinkConfig:
    bytes: int | None = None        # whole-cache size; None: the cache of `model` at `length` tokens
    model: str = "qwen2.5-7b"       # also gives the layer count of the per-layer pattern
    length: int = 4096
    dtype: str = "bfloat16"
    layers: int | None = None       # messages in the per-layer pattern (default: the model's layers)
    runs: int = 5
    warmup: int = 2
    channels: int = 1               # loopback connections (socket and gRPC alike)
    chunk_bytes: int = 4 << 20      # gRPC message size
    disk_dir: str | None = None
    probes: tuple[str, ...] = PROBES

    def __post_init__(self):
        ModelSpec(self.model, self.dtype)
        if self.runs < 5 or self.warmup < 1:
            raise ValueError("medians need runs >= 5 and warmup >= 1")
        if (self.bytes is not None and self.bytes < 1) or self.length < 1 or (self.layers or 1) < 1:
            raise ValueError("bytes, length and layers must be >= 1")
        if self.channels < 1 or self.chunk_bytes < 1:
            raise ValueError("channels and chunk bytes must be >= 1")
        if not self.probes or not set(self.probes) <= set(PROBES):
            raise ValueError(f"probes must be a non-empty subset of {','.join(PROBES)}")

    def sizes(self) -> tuple[int, int]:
        """(whole-cache bytes, layers)."""
        geom = CacheGeometry.from_config(load_config(self.model), DTYPES[self.dtype])
        return self.bytes or geom.cache_bytes(self.length), self.layers or geom.num_layers


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skipped(reason: str) -> dict:
    return {"available": False, "skip_reason": reason}


def run_link(cfg: LinkConfig, step: Step = lambda _: None) -> dict:
    whole, layers = cfg.sizes()
    gpus = gpu_count()
    links: dict[str, dict] = {}
    failures: list[str] = []

    def guard(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # a failed probe is reported and fails the run; the others still run
            links[name] = {"available": False, "error": f"{type(e).__name__}: {e}"}
            failures.append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
        step(name)

    def p2p() -> None:
        devs = ("cuda:0", "cuda:1") if gpus >= 2 else ("cpu", "cpu")
        res = measure_p2p(devs, cache_patterns(whole, layers), cfg.runs, cfg.warmup)
        for key, name in (("p2p whole cache", "p2p_whole"), ("p2p per layer", "p2p_layer")):
            links[name] = res[key] | {"available": True, "backend": "nccl" if gpus >= 2 else "gloo",
                                      "between": f"{devs[0]} -> {devs[1]}", "bytes": whole}

    def copies(directory: str) -> None:
        device = "cuda:0" if gpus else "cpu"
        res = measure_links(device, whole, directory, cfg.runs, cfg.warmup, "cuda:1" if gpus >= 2 else None)
        for src, v in res.items():
            if isinstance(v, dict):
                links[RENAME.get(src, src)] = v | {"available": True, "bytes": whole}
        if gpus < 2:
            links["peer_copy"] = skipped(f"needs 2 CUDA GPUs, found {gpus}")
        if not gpus:
            for name in ("h2d_pinned", "d2h_pinned"):
                links[name] = skipped("pinned host memory needs a CUDA device (CUDA not available)")
            for name in ("h2d_pageable", "d2h_pageable"):
                links[name]["note"] = "no CUDA device: a host memcpy, as the pageable tier is on CPU"
        links["disk_read"]["note"] = "cold" if res["file_read"]["cold"] else "warm: page cache not dropped"
        links["disk_write"]["note"] = links["disk_write_fsync"]["note"] = f"{directory} ({filesystem(directory)})"

    def loopback() -> None:
        from bench.measure.loopback import measure_loopback
        res = measure_loopback(whole, cfg.channels, cfg.chunk_bytes, cfg.runs, cfg.warmup)
        notes = {"socket": "raw TCP", "grpc": f"raw bytes, generic handler, {cfg.chunk_bytes / 2**20:g} MiB messages"}
        for key in ("socket", "grpc"):
            links[key] = res[key] | {"available": True, "note": notes[key]}
            if not res[key]["bytes_ok"]:
                failures.append(f"{key} loopback: the receiver counted a different number of bytes")

    def backend() -> None:  # kvtransfer's own gRPC transport, framing and all, beside its own socket run
        from bench.measure.grpc_probe import measure_loopback
        res = measure_loopback(whole, cfg.channels, cfg.chunk_bytes, layers=layers, repeats=cfg.runs)
        links["grpc_backend"] = res["grpc"] | {
            "available": True, "bytes": res["bytes"], "channels": res["channels"], "pattern": f"{layers} layers",
            "note": f"{res['grpc_vs_socket']:.0%} of a TCP socket in the same probe "
                    f"({res['socket']['gbps']:.3g} GB/s), 1 warm-up", "vs_socket": res["grpc_vs_socket"]}

    with contextlib.ExitStack() as stack:
        directory = cfg.disk_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlink-"))
        os.makedirs(directory, exist_ok=True)
        probes = {"p2p": p2p, "copies": lambda: copies(directory), "loopback": loopback, "backend": backend}
        for name in cfg.probes:
            guard(name, probes[name])
    env = dict(python=platform.python_version(), torch=torch.__version__, host_cpus=os.cpu_count(), gpus=gpus,
               device_name=torch.cuda.get_device_name(0) if gpus else platform.processor() or "cpu")
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    links = {k: links[k] for k in sorted(links, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))}
    return {"kind": "link", "ok": not failures, "failures": failures, "config": config, "env": env,
            "bytes": whole, "layers": layers, "layer_bytes": whole // layers, "links": links}


def total_steps(cfg: LinkConfig) -> int:
    return len(cfg.probes)


HELP = "raw link speeds in one run: p2p, peer copy, H2D/D2H, socket, gRPC, disk"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bytes", type=size,
                   help="whole-cache size, e.g. 1.75GiB (default: --model's cache at --length)")
    p.add_argument("--model", default="qwen2.5-7b", help="preset or local dir: cache size and layer count")
    p.add_argument("--length", type=int, default=4096, help="tokens of the cache (default 4096)")
    p.add_argument("--dtype", default="bfloat16", help="cache dtype for the size (default bfloat16)")
    p.add_argument("--layers", type=int, help="messages of the per-layer p2p pattern (default: the model's)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure, >= 5 (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--channels", type=int, default=1, help="loopback connections (socket, gRPC, gRPC transport)")
    p.add_argument("--chunk", type=size, default=4 << 20, help="gRPC message size (default 4MiB)")
    p.add_argument("--probes", type=csv, default=list(PROBES), help=f"subset of {','.join(PROBES)}")
    p.add_argument("--disk-dir", help="directory for the disk file (default: a fresh temp dir)")
    p.add_argument("--out", help="write result.json, report.md and links.png in this directory")


def job(args: argparse.Namespace) -> Job:
    cfg = LinkConfig(bytes=args.bytes, model=args.model, length=args.length, dtype=args.dtype, layers=args.layers,
                     runs=args.runs, warmup=args.warmup, channels=args.channels, chunk_bytes=args.chunk,
                     disk_dir=args.disk_dir, probes=tuple(args.probes))
    return Job(total_steps(cfg), lambda step: run_link(cfg, step))
