"""A decode worker killed 30-60 ms after its handshake, then the next one: how long until the next one serves?

Why: a decode worker that dies while its process group is being joined (after the prefill worker answered its
handshake, before the group was up) once held the prefill worker's next pairing about a minute (torch's group
constructor waiting on the dead peer's connection, on the prefill worker's device thread), whatever
--dist-timeout-s said. This runs that case `--runs` times against one prefill worker (gloo, CPU, `tiny`). The next
decode worker is started first, its model loaded, against a closed gate in front of the prefill worker's control
port (bench/measure/gate.py); the gate opens at the kill. So the figure, from the kill to the next worker's first
answered request, is the pairing's own time, not a start-up's (seconds of imports, far more on a busy machine).
The last line is every run as JSON.

    python -m bench.probes.abandoned_handshake --runs 10 --dist-timeout-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure.gate import Gate
from bench.measure.launch import free_port, spawn, stop

LISTENING = "NOT_SERVING until paired"  # the decode worker's line once its model is loaded and its port is open


def _wait_line(path: str, text: str, proc, timeout: float) -> float:
    """When (monotonic) `text` appears in the log at `path`; polls every 2 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(f"{path}: the process exited ({proc.returncode}) before {text!r}")
        time.sleep(0.002)
    raise TimeoutError(f"{path}: no {text!r} within {timeout} s")


def _serves(addr: str, proc, timeout: float) -> float:
    """When (monotonic) `addr` first reports SERVING (polled every 20 ms); then one request must come back OK."""
    from decode_server.client import generate
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the decode worker at {addr} exited ({proc.returncode})")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    t = time.monotonic()
                    out = asyncio.run(generate(addr, [5, 6, 7, 8], 4, timeout=30))
                    assert len(out["tokens"]) == 4, out
                    return t
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"{addr} did not serve within {timeout} s")


def run(runs: int, dist_timeout_s: float, log_dir: str, seed: int = 0, give_up_s: float = 300.0) -> list[dict]:
    """`runs` cycles of (decode worker killed 30-60 ms after its handshake, the next one let through); a dict each:
    the kill's delay after the handshake, and seconds from the kill to the next worker serving."""
    rng = random.Random(seed)
    prefill_addr, dist = f"127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", "tiny", "--dtype", "float32", "--transport", "gloo", "--dist-init", dist,
              "--dist-timeout-s", f"{dist_timeout_s:g}", "--log-level", "INFO"]
    prefill_log = os.path.join(log_dir, "prefill.log")
    prefill = spawn("prefill_server", [*common, "--listen", prefill_addr], prefill_log)
    common.append("--no-prefix-cache")  # the decode workers'
    out = []
    try:
        _wait_line(prefill_log, "prefill server ready", prefill, give_up_s)
        for r in range(runs):
            logs = [os.path.join(log_dir, f"decode-{r}-{k}.log") for k in ("killed", "next")]
            addrs = [f"127.0.0.1:{free_port()}" for _ in logs]
            with Gate(prefill_addr) as gate:
                nxt = spawn("decode_server", [*common, "--listen", addrs[1], "--prefill-addr", gate.addr,
                                              "--handshake-timeout-s", f"{give_up_s:g}"], logs[1])
                try:
                    _wait_line(logs[1], LISTENING, nxt, give_up_s)  # loaded, waiting at the closed gate
                    victim = spawn("decode_server", [*common, "--listen", addrs[0], "--prefill-addr", prefill_addr],
                                   logs[0])
                    _wait_line(logs[0], "handshake ok", victim, give_up_s)
                    delay = rng.uniform(0.030, 0.060)
                    time.sleep(delay)
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    t_kill = time.monotonic()
                    gate.open()
                    t_serve = _serves(addrs[1], nxt, give_up_s)
                finally:
                    stop([nxt])
            out.append({"run": r, "killed_after_ms": round(delay * 1e3, 1),
                        "served_after_s": round(t_serve - t_kill, 2)})
            print(f"run {r}: killed {delay * 1e3:.0f} ms after its handshake; the next decode worker served "
                  f"{t_serve - t_kill:.2f} s after the kill", flush=True)
    finally:
        stop([prefill])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--dist-timeout-s", type=float, default=10.0)
    p.add_argument("--log-dir", default="", help="the servers' logs (default: a new temp directory)")
    p.add_argument("--seed", type=int, default=0, help="seeds the 30-60 ms kill delays")
    a = p.parse_args()
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="kvt-abandoned-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)
    runs = run(a.runs, a.dist_timeout_s, log_dir, a.seed)
    print(json.dumps({"dist_timeout_s": a.dist_timeout_s, "runs": runs,
                      "worst_served_after_s": max(r["served_after_s"] for r in runs)}))


if __name__ == "__main__":
    main()
