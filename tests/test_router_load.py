"""The router's Load sums every count of its healthy workers' reports, in-process (no workers needed).

Why: Load is what a caller (kvtransfer-bench serve's --server-metrics, a dashboard, a router above this one) reads
as the fleet's state. The summed fields were once a hand-written list that missed the six added later (the
blocks, the admission queue, the preemptions), so through a router the pool read as empty: free_blocks 0 while
each worker had about a thousand free (a new-user pass).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from proto import kvtransfer_pb2 as pb
from router.metrics import RouterMetrics
from router.server import RouterService


def _report(base: int) -> pb.LoadResponse:
    r = pb.LoadResponse(serving=True)
    for i, f in enumerate(r.DESCRIPTOR.fields):
        if f.name != "serving":
            setattr(r, f.name, base + i)
    return r


def test_load_sums_every_count_of_the_healthy_workers_reports():
    a, b = _report(10), _report(1000)
    workers = SimpleNamespace(healthy=lambda: [SimpleNamespace(load=a), SimpleNamespace(load=b),
                                               SimpleNamespace(load=None)])
    service = RouterService(workers, placement=None, metrics=RouterMetrics(), security=None, request_timeout_s=1.0)
    got = asyncio.run(service.Load(pb.LoadRequest(), context=None))
    assert got.serving
    for f in got.DESCRIPTOR.fields:
        if f.name != "serving":
            assert getattr(got, f.name) == getattr(a, f.name) + getattr(b, f.name), f.name
