"""Start kvtransfer servers as real processes: a prefill/decode pair, or a colocated decode server.

Why processes: the bench measures what a user runs (two servers, a process group, gRPC
between them), not an in-process shortcut; the tests start servers the same way.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from kvtransfer.rpc.stacks import request_dump

DUMP_WAIT_S = 1.0  # faulthandler writes from its signal handler at once; this covers a loaded machine
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


PORT_FLOOR = 20000  # free_port's ports: from here up to the kernel's ephemeral range
HELD_S = 300.0  # a port handed out stays reserved this long: a server's start (imports) on a loaded machine
REGISTRY = os.path.join(tempfile.gettempdir(), f"kvtransfer-free-ports-{os.getuid()}.json")
_rng = random.Random()  # private: a seeded global `random` must not make two processes pick alike
_local: dict[int, float] = {}  # the registry where its file cannot be used


def free_port() -> int:
    """A loopback port that is free now, below the kernel's ephemeral range, and handed out by no free_port on this
    machine (any process of this user) in the last HELD_S seconds.

    Why not bind(0): the port the kernel picks is free only until that socket closes, and a server binds it
    seconds later (a start imports torch and transformers). Meanwhile every bind(0) and outgoing connection on the
    machine draws from the same range: in CI run 53 (bench/results/ci-2cpu-2026-12-06) a gRPC server of another
    test process held an API front's port when the front came to bind it, and the front's health poll got HTTP/2
    frames. Below the range only free_port picks, and the ports it handed out are kept in a file under a lock
    (REGISTRY), so two processes (pytest-xdist workers, their children, two test runs) never get the same one."""
    low = _ephemeral_low()
    if low - PORT_FLOOR < 1024:  # no room below the range (a machine that widened it): the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    with _registry() as held:  # port -> when it was handed out
        now = time.time()
        for port in [p for p, t in held.items() if now - t > HELD_S or not PORT_FLOOR <= p < low]:
            del held[port]
        drawn = (_rng.randrange(PORT_FLOOR, low) for _ in range(1024))  # then every port in turn (a full range),
        fresh = (p for p in itertools.chain(drawn, range(PORT_FLOOR, low)) if p not in held)
        for port in itertools.chain(fresh, sorted(held, key=held.get)):  # then, all taken: the longest held first
            if _bindable(port):
                held[port] = now
                return port
    raise OSError(f"no free loopback port in {PORT_FLOOR}..{low - 1}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextmanager
def _registry():
    """The ports free_port handed out, {port: time}, read and written back under an exclusive lock on REGISTRY (this
    process's own dict where the file cannot be opened)."""
    try:
        f = open(REGISTRY, "a+")
    except OSError:
        yield _local
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        try:
            held = {int(p): float(t) for p, t in json.loads(f.read() or "{}").items()}
        except (ValueError, AttributeError):
            held = {}  # a torn or foreign file: start over
        yield held
        f.seek(0)
        f.truncate()
        f.write(json.dumps(held))


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (bind(0), outgoing connections); Linux's default elsewhere."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class Running:
    addr: str
    prefill_addr: str = ""
    procs: list = field(default_factory=list)
    logs: list = field(default_factory=list)

    def log_text(self, tail: int = 4000) -> str:
        out = []
        for path in self.logs:
            with open(path) as f:
                out.append(f"--- {os.path.basename(path)}\n{f.read()[-tail:]}")
        return "\n".join(out)


def spawn(module: str, args: list[str], log_path: str, env: dict | None = None, prefix: tuple = ()
          ) -> subprocess.Popen:
    """`python -m module args` (after `prefix`, e.g. `ip netns exec NS`), output to `log_path`."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "w") as f:
        return subprocess.Popen([*prefix, sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT)


def wait_serving(addr: str, procs, timeout: float = 300.0, credentials: grpc.ChannelCredentials | None = None) -> None:
    """Poll the health service (TLS when `credentials` are given) until SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # only where servers run
    deadline = time.monotonic() + timeout
    with (grpc.secure_channel(addr, credentials) if credentials else grpc.insecure_channel(addr)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a server process exited during start-up")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"{addr} not serving after {timeout} s")


def dump_stacks(procs) -> None:
    """Each live server's Python stacks into its log (kvtransfer.rpc.stacks), then a moment for them to land."""
    if sum(request_dump(p.pid) for p in procs if p.poll() is None):
        time.sleep(DUMP_WAIT_S)


def stop(procs, grace_s: float = 15.0, dump: bool = False) -> None:
    """SIGTERM, SIGKILL after `grace_s`. Stacks first when `dump` (what ran them failed or was stopped), and
    before any SIGKILL: a server that does not stop is stuck somewhere, and its log then says where."""
    if dump:
        dump_stacks(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            dump_stacks([p])
            p.kill()
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver call): left to the OS
                pass


@contextmanager
def _running(run: Running, wait: bool, credentials=None):
    dump = True  # unless the body ends well: then the servers are only stopped
    try:
        if wait:
            try:
                wait_serving(run.addr, run.procs, credentials=credentials)
            except TimeoutError as e:  # up but never serving: a hang; its stacks go into the error's log text
                dump_stacks(run.procs)
                dump = False
                raise RuntimeError(f"{e}\n{run.log_text()}") from None
            except RuntimeError as e:
                raise RuntimeError(f"{e}\n{run.log_text()}") from None
        yield run
        dump = False
    finally:
        stop(run.procs, dump=dump)


@contextmanager
def server_pair(log_dir: str | None = None, model="tiny", dtype="auto", prefill_device="auto",
                decode_device="auto", prefill_args=(), decode_args=(), common_args=(), wait=True,
                credentials: grpc.ChannelCredentials | None = None):
    """Prefill (rank 0) and decode (rank 1) joined by a process group on a free loopback port."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvt-logs-")
    os.makedirs(log_dir, exist_ok=True)
    dist = f"tcp://127.0.0.1:{free_port()}"
    p_addr, d_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    common = ["--model", model, "--dtype", dtype, "--dist-init", dist, *common_args]
    run = Running(d_addr, p_addr, logs=[os.path.join(log_dir, "prefill.log"), os.path.join(log_dir, "decode.log")])
    run.procs.append(spawn("prefill_server", [*common, "--device", prefill_device, "--listen", p_addr,
                                              *prefill_args], run.logs[0]))
    run.procs.append(spawn("decode_server", [*common, "--device", decode_device, "--listen", d_addr,
                                             "--prefill-addr", p_addr, *decode_args], run.logs[1]))
    with _running(run, wait, credentials) as r:
        yield r


@contextmanager
def colocated_server(log_dir: str | None = None, model="tiny", dtype="auto", device="auto", args=(),
                     credentials: grpc.ChannelCredentials | None = None):
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvt-logs-")
    os.makedirs(log_dir, exist_ok=True)
    addr = f"127.0.0.1:{free_port()}"
    run = Running(addr, logs=[os.path.join(log_dir, "colocated.log")])
    run.procs.append(spawn("decode_server", ["--colocated", "--model", model, "--dtype", dtype, "--device", device,
                                             "--listen", addr, *args], run.logs[0]))
    with _running(run, True, credentials) as r:
        yield r
