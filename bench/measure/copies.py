"""Raw copies of one buffer: device clone, pinned and pageable H2D/D2H, peer copy, file write and read.

Why shared: `offload` reports them beside its tiers and `link` runs them as its `copies` probe; both
read the same figures measured the same way (a device sync before every timer, the page cache dropped
before each file read).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from bench.measure.pagecache import drop_page_cache, read_file, write_file
from bench.measure.stats import spread_ms, timed


def stats(seconds: list[float]) -> dict:
    """The `median [min-max]` figures of `seconds` in ms, with the run count."""
    return spread_ms(seconds) | dict(runs=len(seconds))


def gbps(nbytes: int, ms: float) -> float | None:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None  # None, not inf: stays valid JSON


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

