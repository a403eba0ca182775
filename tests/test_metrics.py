"""Observability: Prometheus metrics on both servers, health that follows the peer, request ids in logs."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from decode_server.client import generate
from decode_server.config import DecodeConfig
from kvtransfer.model.prefill import random_prompt
from kvtransfer.rpc.metrics import Metrics
from prefill_server.config import PrefillConfig
from support.faultkit import NOT_SERVING, SERVING, Pair, assert_no_leaks, value

BYTES_PER_TOKEN = 1024  # tiny, float32: 2 x 4 layers x 2 kv heads x 16 x 4 bytes


class HealthWatch(threading.Thread):
    """Every status the decode server's health Watch stream reports, in order."""

    def __init__(self, addr: str):
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(addr)
        self.seen: list[int] = []
        self.start()

    def run(self) -> None:
        try:
            for r in health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest()):
                self.seen.append(r.status)
        except grpc.RpcError:
            pass

    def close(self) -> list[int]:
        self.channel.close()
        return [s for i, s in enumerate(self.seen) if i == 0 or s != self.seen[i - 1]]


def unavailable_counted(pair: Pair, timeout: float = 10.0) -> dict:
    """The decode server's metrics once its refused request is counted: the handler counts its outcome as it
    unwinds, which on a loaded machine can come a moment after the client has its status."""
    deadline = time.monotonic() + timeout
    while True:
        d = pair.metrics("decode")
        if value(d, "kvt_requests_total", outcome="UNAVAILABLE") >= 1 or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def test_metrics_health_and_request_ids(tmp_path):
    lengths = [3, 40, 130]
    prompts = [random_prompt(512, n, seed=n).view(-1).tolist() for n in lengths]
    with Pair(tmp_path, "gloo", decode_args=["--on-failure", "fail"]) as pair:
        pair.start()
        watch = HealthWatch(pair.addr)
        for ids in prompts:
            assert len(asyncio.run(generate(pair.addr, ids, 4, "layerwise"))["tokens"]) == 4
        asyncio.run(generate(pair.addr, prompts[0], 2, "colocated"))
        d, p = pair.metrics("decode"), pair.metrics("prefill")
        moved = sum(lengths) * BYTES_PER_TOKEN
        assert value(d, "kvt_requests_total", outcome="OK") == 4
        assert value(d, "kvt_ttft_ms_count", mode="layerwise") == 3
        assert value(d, "kvt_ttft_ms_count", mode="colocated") == 1
        assert value(d, "kvt_transfer_ms_count", mode="layerwise") == 3
        assert value(d, "kvt_transfer_bytes_total") == moved == value(p, "kvt_transfer_bytes_total")
        assert value(d, "kvt_transfer_gbps") > 0 and value(p, "kvt_transfer_gbps") > 0
        assert value(p, "kvt_requests_total", outcome="OK") == 3
        assert value(p, "kvt_prefill_ms_count", mode="layerwise") == 3
        assert value(d, "kvt_info", role="decode") == 1 and value(p, "kvt_info", role="prefill") == 1
        assert value(d, "kvt_pairings_total") == 1 == value(p, "kvt_pairings_total")
        assert_no_leaks(pair)

        pair.prefill.kill(signal.SIGTERM)  # a prefill restart: health follows the peer
        pair.wait_health(NOT_SERVING, 10)
        assert pair.health("kvtransfer.v1.Decode") == NOT_SERVING  # --on-failure fail: the front door cannot serve
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(generate(pair.addr, prompts[1], 4))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "prefill worker" in e.value.details()
        d = unavailable_counted(pair)
        assert value(d, "kvt_peer_up") == 0 and value(d, "kvt_failures_total", cause="peer_down") == 1
        assert value(d, "kvt_requests_total", outcome="UNAVAILABLE") == 1
        pair.prefill.start()
        pair.wait_health(SERVING, 60)
        assert len(asyncio.run(generate(pair.addr, prompts[1], 4))["tokens"]) == 4
        assert value(pair.metrics("decode"), "kvt_pairings_total") == 2
        assert watch.close() == [SERVING, NOT_SERVING, SERVING]
        assert_no_leaks(pair)
        for half in (pair.decode, pair.prefill):
            assert "request 1:" in open(half.logs[0]).read(), half.module
        assert "request 5:" in pair.decode.log_text()  # the refused request is named too


def test_metrics_flags():
    assert DecodeConfig().metrics_port == 0 and PrefillConfig().metrics_addr == "127.0.0.1"  # off, loopback
    for cls in (DecodeConfig, PrefillConfig):
        with pytest.raises(ValueError, match="--metrics-port"):
            cls(metrics_port=70000)
    with pytest.raises(ValueError, match="--on-failure"):
        DecodeConfig(on_failure="retry")
    with pytest.raises(ValueError, match="--fail-after-layers"):
        PrefillConfig(fail_after_layers=-2)


def test_metrics_families_render():
    m = Metrics("decode")
    m.moved(1 << 20, 0.001, "bulk")
    m.finished("OK")
    text = generate_latest(m.registry).decode()
    for name in ("kvt_ttft_ms", "kvt_transfer_ms_count", "kvt_transfer_bytes_total 1.048576e+06", "kvt_failures",
                 "kvt_inflight_requests", "kvt_buffer_bytes", "kvt_peer_up", 'kvt_requests_total{outcome="OK"} 1.0'):
        assert name in text, name
