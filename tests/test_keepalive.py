"""A peer whose process hangs (its kernel still acknowledging TCP) fails the calls on a keepalive'd channel within
the keepalive, not after gRPC's one-minute default.

Why: the decode server's channel to its prefill peer (--peer-keepalive-s), the OpenAI front's to its decode server
(--backend-keepalive-s) and the router's to its workers promise that a peer that stops answering pings fails their
calls UNAVAILABLE after about one period. A new-user pass found a SIGSTOPped peer noticed only after ~60 s: recent
gRPC core waits for a ping's answer `grpc.http2.ping_timeout_ms` (60 s by default), not `grpc.keepalive_timeout_ms`
(kvtransfer/rpc/server.keepalive_options sets both). A killed peer closes its sockets and is seen at once; a frozen
one is seen only by the pings, so the server here is stopped, not killed: an unanswered ping is awaited
max(keepalive, 10 s) (PING_ANSWER_MIN_MS), so ~11-12 s here. Each watch has a 30 s deadline: without the fix it
ends DEADLINE_EXCEEDED there, not UNAVAILABLE.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.rpc.server import peer_channel_options
from router.workers import worker_channel_options

_SERVER = """
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from kvtransfer.rpc.server import SERVER_KEEPALIVE
s = grpc.server(futures.ThreadPoolExecutor(2), options=SERVER_KEEPALIVE)
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), s)
print(s.add_insecure_port("127.0.0.1:0"), flush=True)
s.start()
time.sleep(300)
"""


@pytest.fixture
def frozen_peer():
    """A gRPC health server in its own process: yields (address, freeze), freeze() SIGSTOPs it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root})
    guard = threading.Timer(60, proc.kill)  # a server that never prints its port must not hang the test
    guard.start()
    try:
        line = proc.stdout.readline()
        guard.cancel()
        assert line.strip().isdigit(), f"the health server did not start (printed {line!r})"
        port = int(line)
        yield f"127.0.0.1:{port}", lambda: os.kill(proc.pid, signal.SIGSTOP)
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait(timeout=30)


@pytest.mark.parametrize("options", [peer_channel_options(4 << 20, 1.0), worker_channel_options(4 << 20)],
                         ids=["peer_channel_options 1 s", "worker_channel_options (router, 2 s)"])
def test_a_frozen_peer_fails_the_channels_calls_within_the_keepalive(frozen_peer, options):
    address, freeze = frozen_peer
    period_s = dict(options)["grpc.keepalive_time_ms"] / 1000
    with grpc.insecure_channel(address, options=options) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        freeze()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in watch:
                pass
        waited = time.monotonic() - t0
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, \
        f"{failed.value.code()} ({failed.value.details()}) after {waited:.1f} s, keepalive {period_s} s"
