"""Start a prefill/decode pair (or a colocated decode server) as real processes for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    addr: str
    prefill_addr: str = ""
    procs: list = field(default_factory=list)
    logs: list = field(default_factory=list)

    def log_text(self) -> str:
        out = []
        for path in self.logs:
            with open(path) as f:
                out.append(f"--- {os.path.basename(path)}\n{f.read()[-4000:]}")
        return "\n".join(out)


def _spawn(module: str, args: list[str], log_path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    f = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT)


def wait_serving(addr: str, procs, timeout: float = 90.0, credentials: grpc.ChannelCredentials | None = None) -> None:
    """Poll the health service (TLS when `credentials` are given) until SERVING."""
    deadline = time.monotonic() + timeout
    with (grpc.secure_channel(addr, credentials) if credentials else grpc.insecure_channel(addr)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a server process exited during start-up")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"{addr} not serving after {timeout} s")


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


@contextmanager
def server_pair(tmp_path, model="tiny", dtype="float32", prefill_args=(), decode_args=(), wait=True,
                credentials: grpc.ChannelCredentials | None = None):
    dist = f"tcp://127.0.0.1:{free_port()}"
    p_addr, d_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    common = ["--model", model, "--dtype", dtype, "--dist-init", dist, "--log-level", "INFO"]
    run = Running(d_addr, p_addr, logs=[str(tmp_path / "prefill.log"), str(tmp_path / "decode.log")])
    run.procs.append(_spawn("prefill_server", [*common, "--listen", p_addr, *prefill_args], run.logs[0]))
    run.procs.append(_spawn("decode_server", [*common, "--listen", d_addr, "--prefill-addr", p_addr,
                                              *decode_args], run.logs[1]))
    try:
        if wait:
            try:
                wait_serving(d_addr, run.procs, credentials=credentials)
            except (RuntimeError, TimeoutError) as e:
                raise RuntimeError(f"{e}\n{run.log_text()}") from None
        yield run
    finally:
        stop(run.procs)


@contextmanager
def colocated_server(tmp_path, model="tiny", dtype="float32", args=(),
                     wait_credentials: grpc.ChannelCredentials | None = None):
    addr = f"127.0.0.1:{free_port()}"
    run = Running(addr, logs=[str(tmp_path / "colocated.log")])
    run.procs.append(_spawn("decode_server", ["--colocated", "--model", model, "--dtype", dtype,
                                              "--listen", addr, *args], run.logs[0]))
    try:
        wait_serving(addr, run.procs, credentials=wait_credentials)
        yield run
    finally:
        stop(run.procs)
