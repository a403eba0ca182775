"""Raw point-to-point speed of the data plane the pair uses (NCCL on GPUs, gloo on CPU).

Why: every transfer figure is reported beside the limit measured in the same run. The
patterns mirror a cache: one message of the whole cache, and one message per layer.
Timed on the receiver from a barrier to the last receive, device-synchronized.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from bench.measure.launch import free_port
from bench.measure.stats import median, spread_ms, timed
from bench.measure.twoproc import run_pair


def init_pair(rank: int, init_method: str, device: torch.device, timeout_s: float = 60.0) -> None:
    """Join the two-rank group (rank 0 prefill, rank 1 decode): NCCL on CUDA, gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)


def _side(rank: int, address: str, devices: tuple[str, str], patterns: dict, runs: int, warmup: int) -> dict:
    from kvtransfer.determinism import sync
    dev = torch.device(devices[rank])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    init_pair(rank, address, dev, timeout_s=120)
    op = dist.isend if rank == 0 else dist.irecv
    out = {}
    for name, (count, nbytes) in patterns.items():
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(count)]

        def transfer():
            for w in [op(b, 1 - rank) for b in bufs]:
                w.wait()
        secs = timed(transfer, [dev], runs, warmup, before=lambda: (sync(dev), dist.barrier()))
        med = median(secs)
        out[name] = {"pattern": f"{count} x {nbytes / 2**20:.1f} MiB", **spread_ms(secs), "n": len(secs),
                     "gbps": count * nbytes / med / 1e9}
        del bufs
    return out


def measure_p2p(devices: tuple[str, str], patterns: dict[str, tuple[int, int]], runs: int = 5, warmup: int = 2,
                timeout: float = 600) -> dict:
    """patterns: name -> (messages, bytes each). Returns name -> stats with GB/s, from the receiver."""
    address = f"tcp://127.0.0.1:{free_port()}"
    results = run_pair(_side, (address, tuple(devices), patterns, runs, warmup), timeout, what="p2p")
    return {f"p2p {k}": v for k, v in results[1].items()}


def cache_patterns(cache_bytes: int, num_layers: int) -> dict[str, tuple[int, int]]:
    """The two shapes of one cache on the wire: whole, and per layer (K and V adjacent)."""
    return {"whole cache": (1, cache_bytes), "per layer": (num_layers, cache_bytes // num_layers)}
