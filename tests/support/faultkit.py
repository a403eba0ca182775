"""Helpers for the fault, metrics and soak tests: a pair whose halves are killed and restarted one at a time.

Why not bench/measure/launch.py's server_pair: these tests restart one server while the other lives,
on the same ports, so each half is started on its own (a fresh log per start), and the
test reads each half's Prometheus endpoint and health. A "remote host" is one network
namespace for the prefill worker, joined to the root namespace (where the decode worker,
the clients and the test run) by a veth pair: the link can be downed or shaped (tc) while
the test still reaches the decode worker, its metrics and its health directly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.measure.launch import free_port, stop
from decode_server.client import generate
from support import netns
from support.forked import spawn

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class RemoteHost:
    """The prefill worker's namespace (`host`) and the root namespace's end of the veth pair."""
    host: netns.Host
    local_if: str
    local_addr: str


@contextmanager
def remote_host(tag: str):
    n = (os.getpid() + sum(map(ord, tag))) % 200
    ns, remote_if, local_if = f"kvt-r{n}{tag}", f"kvp{n}{tag}"[:15], f"kvd{n}{tag}"[:15]
    host, local_addr = netns.Host(ns, remote_if, f"10.232.{n}.1"), f"10.232.{n}.2"
    run = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True, text=True)  # noqa: E731
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", local_if], capture_output=True)
    try:
        run("netns", "add", ns)
        run("link", "add", local_if, "type", "veth", "peer", "name", remote_if, "netns", ns)
        run("addr", "add", f"{local_addr}/24", "dev", local_if)
        run("link", "set", local_if, "up")
        run("-n", ns, "addr", "add", f"{host.addr}/24", "dev", remote_if)
        run("-n", ns, "link", "set", remote_if, "up")
        run("-n", ns, "link", "set", "lo", "up")
        yield RemoteHost(host, local_if, local_addr)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", local_if], capture_output=True)


def shape(r: RemoteHost, qdisc: str | None) -> None:
    """A tc qdisc on the prefill side's egress (the cache's direction), e.g. "tbf rate 8mbit burst 32kbit
    latency 50ms"; None removes it. (netem needs a kernel module that not every test machine has; tbf is in.)"""
    r.host.run("tc", "qdisc", "del", "dev", r.host.ifname, "root")
    if qdisc:
        p = r.host.run("tc", "qdisc", "add", "dev", r.host.ifname, "root", *qdisc.split())
        assert p.returncode == 0, p.stderr


@dataclass
class Half:
    """One server: its module, arguments and every log it wrote (one per start)."""
    module: str
    args: list
    log_dir: str
    prefix: tuple = ()
    env: dict | None = None
    proc: subprocess.Popen | None = None
    logs: list = field(default_factory=list)

    def start(self) -> None:
        self.logs.append(os.path.join(self.log_dir, f"{self.module}.{len(self.logs) + 1}.log"))
        self.proc = spawn(self.module, self.args, self.logs[-1], env=self.env, prefix=self.prefix)

    def kill(self, sig=signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=15)

    def log_text(self) -> str:
        with open(self.logs[-1]) as f:
            return f.read()


class Pair:
    """A prefill worker (optionally in a remote namespace) and a decode worker, each with /metrics."""

    def __init__(self, tmp_path, transport="gloo", prefill_args=(), decode_args=(), remote: RemoteHost | None = None,
                 prefix_cache: bool = False):
        """prefix_cache False: the decode worker runs --no-prefix-cache, so every request crosses the link (what
        the fault tests break); True: its default, the cache on."""
        decode_args = [*decode_args, *([] if prefix_cache else ["--no-prefix-cache"])]
        p_host = remote.host.addr if remote else "127.0.0.1"
        d_host = remote.local_addr if remote else "127.0.0.1"
        self.addr, self.prefill_addr = f"127.0.0.1:{free_port()}", f"{p_host}:{free_port()}"
        self.metrics_ports = {"prefill": free_port(), "decode": free_port()}
        common = ["--model", "tiny", "--dtype", "float32", "--transport", transport,
                  "--dist-init", f"tcp://{p_host}:{free_port()}", "--log-level", "INFO"]
        p_env = d_env = None
        if remote:
            p_env = dict(os.environ, GLOO_SOCKET_IFNAME=remote.host.ifname)
            d_env = dict(os.environ, GLOO_SOCKET_IFNAME=remote.local_if)
        p_metrics = ["--metrics-port", str(self.metrics_ports["prefill"])]
        if remote:  # the test reaches the namespace's metrics through the veth
            p_metrics += ["--metrics-addr", p_host]
        self.remote, self.p_host = remote, p_host
        self.prefill = Half("prefill_server", [*common, "--listen", self.prefill_addr, *p_metrics, *prefill_args],
                            str(tmp_path), remote.host.prefix if remote else (), p_env)
        self.decode = Half("decode_server", [*common, "--listen", self.addr,
                                             "--prefill-addr", self.prefill_addr,
                                             "--data-listen", f"{d_host}:0",
                                             "--metrics-port", str(self.metrics_ports["decode"]), *decode_args],
                           str(tmp_path), (), d_env)

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()
        self.wait_health(SERVING, 120)

    def close(self) -> None:
        stop([h.proc for h in (self.prefill, self.decode) if h.proc is not None])

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # before a namespace the prefill worker runs in is deleted

    def log_text(self, tail: int = 6000) -> str:
        return "\n".join(f"--- {os.path.basename(p)}\n{open(p).read()[-tail:]}"
                         for h in (self.prefill, self.decode) for p in h.logs)

    # --- probes ---

    def health(self, service: str = "") -> int | None:
        try:
            with grpc.insecure_channel(self.addr) as ch:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=2).status
        except grpc.RpcError:
            return None

    def wait_health(self, status: int, timeout: float, service: str = "") -> float:
        """Seconds until the decode worker's health reads `status`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.health(service) == status:
                return time.monotonic() - t0
            for h in (self.prefill, self.decode):
                if h.proc is not None and h.proc.poll() is not None and h.proc.returncode not in (-9, -15):
                    raise RuntimeError(f"{h.module} exited ({h.proc.returncode})\n{self.log_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"decode health not {status} after {timeout} s\n{self.log_text()}")

    def metrics(self, side: str) -> dict:
        """{(name, ((label, value), ...)): value} of one server's /metrics."""
        host = self.p_host if side == "prefill" else "127.0.0.1"
        return scrape(f"http://{host}:{self.metrics_ports[side]}/metrics")

    def wait_line(self, half: Half, text: str, timeout: float = 60) -> None:
        netns.wait_for_line(half.logs[-1], text, [half.proc], timeout)


def scrape(url: str) -> dict:
    """{(name, ((label, value), ...)): value} of a /metrics page."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def assert_no_leaks(pair: Pair, timeout: float = 15.0) -> dict:
    """Nothing held once every request is over: requests, expected frames, receivers, buffers, old threads."""
    want = {("decode", "kvt_inflight_requests"): 0, ("decode", "kvt_expected_frames"): 0,
            ("decode", "kvt_receivers_inflight"): 0, ("decode", "kvt_buffer_bytes"): 0,
            ("decode", "kvt_receive_loops"): 1, ("prefill", "kvt_inflight_requests"): 0,
            ("prefill", "kvt_buffer_bytes"): 0, ("decode", "kvt_peer_up"): 1, ("prefill", "kvt_peer_up"): 1,
            ("decode", "kvt_kv_pool_slots_used"): 0, ("decode", "kvt_decode_running"): 0}
    deadline = time.monotonic() + timeout
    while True:
        got = {}
        for side in ("decode", "prefill"):
            m = pair.metrics(side)
            got.update({(s, n): value(m, n) for (s, n) in want if s == side})
        if got == want or time.monotonic() > deadline:
            assert got == want, f"{got}\n{pair.log_text()}"
            return got
        time.sleep(0.2)


class Call(threading.Thread):
    """One Generate in the background; `t_end` (monotonic) is when it reached its terminal state."""

    def __init__(self, addr: str, ids: list[int], n: int, timeout: float = 60.0, mode: str = "auto"):
        super().__init__(daemon=True)
        self.args = (addr, ids, n, mode)
        self.timeout = timeout
        self.result = self.code = self.details = None
        self.t_end = None
        self.start()

    def run(self) -> None:
        addr, ids, n, mode = self.args
        try:
            self.result = asyncio.run(generate(addr, ids, n, mode, timeout=self.timeout))
            self.code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            self.code, self.details = e.code(), e.details()
        self.t_end = time.monotonic()

    def outcome(self, timeout: float) -> "Call":
        self.join(timeout)
        assert not self.is_alive(), "the request did not reach a terminal state"
        return self
