"""Probe: the decode worker's per-layer landing of a gRPC-received cache, in isolation (issue #37's gRPC TTFT).

Why: over gRPC the paged pool lands each layer into a staging block and scatters it into the request's blocks
(staging.Landing._deliver -> Placement.place -> KVPool.write_layer, under Landing._lock, on the receiving stream
handler's thread); the fixed-slot tree copied the staging block into a strided slot view. This times both on the
same code: `slot` is the slot layout (one block per row: the fixed-slot tree's landing), `paged` 64-token blocks.
Per layer: the host time of `Landing.land(i)` (what a gRPC handler thread holds the GIL and the lock for); per
request: every layer landed and the device done (a sync). No network, no model: the bytes are already in host memory.

    python -m bench.probes.grpc_landing                 # CPU, qwen2.5-7b's cache shape at 4,096 tokens
    python -m bench.probes.grpc_landing --device cuda   # the same on a GPU (pinned host buffer, H2D side stream)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decode_server.landing import pool_destination
from kvtransfer.engine.pool import KVPool
from kvtransfer.geometry import CacheGeometry
from kvtransfer.transport.grpc.staging import Landing
from kvtransfer.transport.header import TransferHeader


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def land_request(pool: KVPool, slot: int, h: TransferHeader, device: torch.device) -> tuple[list[float], float]:
    """(host seconds of each layer's land(i), seconds from the first land to the device done)."""
    landing = Landing(h, device)
    err = landing.bind(lambda hdr: pool_destination(pool, slot, hdr.seq_len))
    if err is not None:
        raise RuntimeError(f"the landing refused the pool's destination: {err}")
    sync(device)
    per = []
    t0 = time.perf_counter()
    for i in range(h.num_layers):
        t = time.perf_counter()
        landing.land(i)
        per.append(time.perf_counter() - t)
    for i in range(h.num_layers):
        landing.layer(i)  # what finish() does: the current stream ordered after each layer's copy
    sync(device)
    return per, time.perf_counter() - t0


def probe(layout: str, args, device: torch.device) -> dict:
    g = CacheGeometry(args.layers, args.kv_heads, args.head_dim, torch.bfloat16)
    max_seq = args.tokens + 4  # the ttft bench's --max-seq-len: prompt + --decode-tokens
    pool = KVPool(g, device, slots=2, max_seq=max_seq, page=max_seq if layout == "slot" else args.page)
    lease = pool.try_lease(args.tokens)
    h = TransferHeader(request_id=1, seq_len=args.tokens, num_layers=g.num_layers, kv_heads=g.kv_heads,
                       head_dim=g.head_dim, dtype=g.dtype)
    per, total = [], []
    for run in range(args.warmup + args.runs):
        p, t = land_request(pool, lease.slot, h, device)
        if run >= args.warmup:
            per += p
            total.append(t)
    lease.release()
    return {"layout": layout, "page": pool.page, "land_us_median": 1e6 * statistics.median(per),
            "land_us_max": 1e6 * max(per), "request_ms_median": 1e3 * statistics.median(total),
            "request_ms_min": 1e3 * min(total)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=64, help="the paged pool's block tokens (--kv-block-tokens)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layouts", default="slot,paged")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the pool's tensors name their index: compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    rows = [probe(layout, args, device) for layout in args.layouts.split(",")]
    print(json.dumps({"device": str(device), "torch": torch.__version__, "tokens": args.tokens,
                      "layer_mib": 2 * args.kv_heads * args.tokens * args.head_dim * 2 / 2**20, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
