"""Raw point-to-point speed of the data plane the pair uses (NCCL on GPUs, gloo on CPU).

Why: every transfer figure is reported beside the limit measured in the same run. The
patterns mirror a cache: one message of the whole cache, and one message per layer.
Timed on the receiver from a barrier to the last receive, device-synchronized.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from .launch import free_port


def _child(rank: int, address: str, device: str, patterns: dict, runs: int, warmup: int, q, done) -> None:
    try:
        from kvtransfer.determinism import sync
        from kvtransfer.transport.dist import init_pair
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        init_pair(rank, address, dev, timeout_s=120)
        out = {}
        for name, (count, nbytes) in patterns.items():
            bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(count)]
            times = []
            for it in range(warmup + runs):
                sync(dev)
                dist.barrier()
                t0 = time.perf_counter()
                op = dist.isend if rank == 0 else dist.irecv
                works = [op(b, 1 - rank) for b in bufs]
                for w in works:
                    w.wait()
                sync(dev)
                if it >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            med = statistics.median(times)
            out[name] = {"pattern": f"{count} x {nbytes / 2**20:.1f} MiB", "median_ms": med, "min_ms": min(times),
                         "max_ms": max(times), "n": len(times), "gbps": count * nbytes / med / 1e6}
            del bufs
        q.put((rank, out, None))
    except BaseException:
        q.put((rank, None, traceback.format_exc()))
    finally:
        done.wait(timeout=60)
        os._exit(0)


def measure_p2p(devices: tuple[str, str], patterns: dict[str, tuple[int, int]], runs: int = 5, warmup: int = 2,
                timeout: float = 600) -> dict:
    """patterns: name -> (messages, bytes each). Returns name -> stats with GB/s, from the receiver."""
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, args=(r, address, devices[r], patterns, runs, warmup, q, done))
             for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, out, err = q.get(timeout=timeout)
            if err:
                raise RuntimeError(f"p2p rank {rank} failed:\n{err}")
            results[rank] = out
    except queue.Empty:
        raise RuntimeError(f"p2p measurement did not finish in {timeout} s") from None
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {f"p2p {k}": v for k, v in results[1].items()}


def cache_patterns(cache_bytes: int, num_layers: int) -> dict[str, tuple[int, int]]:
    """The two shapes of one cache on the wire: whole, and per layer (K and V adjacent)."""
    return {"whole cache": (1, cache_bytes), "per layer": (num_layers, cache_bytes // num_layers)}
