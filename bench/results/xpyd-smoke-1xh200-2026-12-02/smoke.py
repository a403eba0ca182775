"""2P2D smoke through the router (issue #28): 64 clients x 2 requests, then every process's metrics, summed.
python3 smoke.py ROUTER_ADDR METRICS_BASE_PORT OUT_JSON (prefill i at base+i, decode j at base+2+j, router base+4)."""
import asyncio
import json
import random
import sys
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

router, base, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def total(m, name, **labels):
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))


async def main():
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(router) as ch:
        stub = pbg.DecodeStub(ch)

        async def one(length):
            ids = [rng.randrange(10, 150000) for _ in range(length)]
            t0 = time.perf_counter()
            c = stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=64), timeout=120)
            n, code = 0, "OK"
            try:
                async for _ in c:
                    n += 1
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            return {"code": code, "tokens": n, "worker": dict(await c.trailing_metadata() or ()).get("kvt-worker"),
                    "s": time.perf_counter() - t0}

        async def client(c):
            return [await one(256 + 256 * ((c + k) % 4)) for k in range(2)]
        t0 = time.perf_counter()
        got = [x for xs in await asyncio.gather(*[client(c) for c in range(64)]) for x in xs]
        wall = time.perf_counter() - t0
    m = {"prefill": [scrape(base + i) for i in range(2)], "decode": [scrape(base + 2 + j) for j in range(2)],
         "router": scrape(base + 4)}
    workers = sorted({g["worker"] for g in got if g["worker"]})
    summary = {
        "requests": len(got), "ok": sum(g["code"] == "OK" for g in got),
        "tokens": sum(g["tokens"] for g in got), "wall_s": wall,
        "per_decode_by_response": {w: sum(g["worker"] == w for g in got) for w in workers},
        "router_routed": {w: total(m["router"], "kvt_router_routed_total", worker=w) for w in workers},
        "router_ok": total(m["router"], "kvt_router_requests_total", outcome="OK"),
        "router_retried": {w: total(m["router"], "kvt_router_retried_total", worker=w) for w in workers},
        "decode_refused": [sum(v for (n, ls), v in d.items() if n == "kvt_requests_total" and ls != (("outcome", "OK"),))
                           for d in m["decode"]],
        "decode_ok": [total(d, "kvt_requests_total", outcome="OK") for d in m["decode"]],
        "prefill_ok": [total(p, "kvt_requests_total", outcome="OK") for p in m["prefill"]],
        "decode_peer_up": [total(d, "kvt_peer_up") for d in m["decode"]],
        "prefill_peer_up": [total(p, "kvt_peer_up") for p in m["prefill"]],
        "decode_transfer_bytes": [total(d, "kvt_transfer_bytes_total") for d in m["decode"]],
        "prefill_transfer_bytes": [total(p, "kvt_transfer_bytes_total") for p in m["prefill"]],
    }
    summary["adds_up"] = (summary["ok"] == len(got) == summary["router_ok"] == sum(summary["decode_ok"])
                          == sum(summary["prefill_ok"])
                          and sum(summary["router_routed"].values()) == summary["router_ok"]
                          + sum(summary["router_retried"].values()) and sum(summary["decode_transfer_bytes"]) == sum(summary["prefill_transfer_bytes"]))
    json.dump(summary, open(out, "w"), indent=1)
    print(json.dumps(summary))


asyncio.run(main())
