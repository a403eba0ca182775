"""N prefill x M decode workers behind the router, on one box (issue #28): `python -m deploy.launch_xpyd ...`.

Why a launcher: an xPyD layout is N + M + 1 processes whose flags must agree (the model, the transport, every
prefill worker's address and rendezvous in every decode worker's lists, every decode worker in the router's),
that must start in an order-free way but stop in order (the router first, so no new request reaches a worker
that is going; then the decode workers, whose requests need their prefill peers to finish; the prefill workers
last), and one of which dying should not leave the others running unseen. The typical box: 4 GPUs, 2P2D:

    python -m deploy.launch_xpyd --prefill 2 --decode 2 --model qwen2.5-7b --dtype bfloat16 \\
        --device-prefill cuda:0,cuda:1 --device-decode cuda:2,cuda:3 --transport nccl

Prefill worker i listens at HOST:P_i and, for nccl/gloo (and auto, which is one of them), hosts its rendezvous
store at tcp://HOST:R_i; each decode worker gets `--prefill-addr HOST:P_0,HOST:P_1,...` and the matching
`--dist-init tcp://HOST:R_0,tcp://HOST:R_1,...` (one rendezvous per prefill worker, in the same order); the router
gets every decode worker as `--worker`. Ports: free ones, or from `--base-port B`: prefill i at B+i, decode j at
B+N+j, rendezvous i at B+N+M+i. Devices are dealt round robin from each list; `auto` (the default) gives the
N + M workers one GPU each in turn (prefill first) when GPUs are visible, else cpu.

All processes start at once (the decode workers wait for their peers' handshake, --handshake-timeout-s, so model
loads overlap); the launcher then polls each one's gRPC health until SERVING (a prefill worker serves once
paired), prints one line per process and a `ready:` line. SIGTERM/SIGINT: stop in the order above, each group
SIGTERM (the servers drain for their --shutdown-grace-s) then SIGKILL after --stop-grace-s; a second signal kills at
once. Exit 0 when every process stopped cleanly on request; 1 when one died on its own (the rest are stopped) or
did not start in --start-timeout-s; 2 for bad flags. The children run in their own process group (a terminal's
Ctrl-C reaches only the launcher, which orders the stop) and get SIGTERM if the launcher itself dies (Linux).

Each decode worker pairs with every prefill worker in its --prefill-addr list and picks one per request
(decode_server/peer/peers.py). `--metrics-base-port P` gives each process its /metrics (prefill i at P+i, decode j
at P+N+j, the router at P+N+M). `--dry-run` prints every command line and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script (python deploy/launch_xpyd.py): the repository on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deploy.xpyd_plan import PROG, ROOT, Child, Refused, build_parser, plan  # noqa: E402

POLL_S = 0.2


def say(text: str) -> None:
    print(text, flush=True)


def fail(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _pdeathsig():
    """A preexec_fn giving the child SIGTERM when the launcher dies (Linux); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class Launcher:
    def __init__(self, children: list[Child], ns: argparse.Namespace, log_dir: str):
        self.children, self.ns, self.log_dir = children, ns, log_dir
        self.signals = 0  # SIGTERM/SIGINT received

    def _on_signal(self, signum, _frame) -> None:
        self.signals += 1

    def spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        pre = _pdeathsig()
        for c in self.children:
            c.log = os.path.join(self.log_dir, f"{c.name}.log")
            with open(c.log, "w") as f:
                c.proc = subprocess.Popen(c.command(), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**env, **c.env}, cwd=ROOT, process_group=0, preexec_fn=pre)

    def died(self) -> Child | None:
        return next((c for c in self.children if c.proc is not None and c.proc.poll() is not None), None)

    def wait_serving(self) -> str | None:
        """None once every process reports SERVING; else why not (a signal, a death, the timeout)."""
        import grpc  # after the children are forked: grpc's threads never meet a fork
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        creds = None
        if self.ns.check_tls_ca:
            read = (lambda p: open(p, "rb").read() if p else None)
            creds = grpc.ssl_channel_credentials(read(self.ns.check_tls_ca), read(self.ns.check_tls_key),
                                                 read(self.ns.check_tls_cert))
        channels = {c.name: grpc.secure_channel(c.addr, creds) if c.tls else grpc.insecure_channel(c.addr)
                    for c in self.children}
        deadline = time.monotonic() + self.ns.start_timeout_s
        try:
            while True:
                if self.signals:
                    return "stop requested during start-up"
                if (c := self.died()) is not None:
                    return (f"{c.name} (pid {c.proc.pid}) exited {c.proc.returncode} during start-up: "
                            f"{c.last_line()} (log {c.log})")
                waiting = [c for c in self.children if not c.serving]
                if not waiting:
                    return None
                if time.monotonic() > deadline:
                    return (f"not serving after --start-timeout-s {self.ns.start_timeout_s:g}: "
                            + "; ".join(f"{c.name} ({c.last_line()[-160:]})" for c in waiting))
                for c in waiting:
                    try:
                        status = health_pb2_grpc.HealthStub(channels[c.name]).Check(
                            health_pb2.HealthCheckRequest(), timeout=1).status
                    except grpc.RpcError:
                        continue
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        c.serving = True
                        say(f"{c.name:<10} pid {c.proc.pid:<7} {c.addr:<22} {c.device or '-':<7} serving "
                            f"(log {c.log})")
                time.sleep(POLL_S)
        finally:
            for ch in channels.values():
                ch.close()

    def stop(self) -> bool:
        """Router, then decode, then prefill workers: SIGTERM, SIGKILL after --stop-grace-s (or at a second
        signal). True when every process exited 0 (or on that SIGTERM itself, still loading) without a SIGKILL."""
        clean, seen = True, self.signals
        for role in ("router", "decode", "prefill"):
            group = [c for c in self.children if c.role == role and c.proc is not None]
            for c in group:
                if c.proc.poll() is None:
                    c.proc.terminate()
            deadline = time.monotonic() + self.ns.stop_grace_s
            while any(c.proc.poll() is None for c in group):
                if time.monotonic() > deadline or self.signals > seen:
                    for c in group:
                        if c.proc.poll() is None:
                            fail(f"{c.name} (pid {c.proc.pid}) still running: SIGKILL")
                            c.proc.kill()
                            clean = False
                    for c in group:
                        try:
                            c.proc.wait(timeout=10)
                        except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver call)
                            fail(f"{c.name} (pid {c.proc.pid}) did not die; left to the OS")
                    break
                time.sleep(0.05)
            for c in group:
                code = c.proc.poll()
                if code not in (0, -signal.SIGTERM):  # -SIGTERM: stopped before its handler was set (loading)
                    clean = False
                say(f"stopped {c.name} (pid {c.proc.pid}): exit {code}")
        return clean

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        say(f"logs in {self.log_dir}")
        self.spawn()
        why = self.wait_serving()
        if why is not None:
            requested = self.signals > 0 and why.startswith("stop requested")
            if not requested:
                fail(why)
            clean = self.stop()
            return 0 if requested and clean else 1
        n = sum(c.role == "prefill" for c in self.children)
        m = sum(c.role == "decode" for c in self.children)
        router = self.children[-1]
        say(f"ready: router at {router.addr} over {m} decode x {n} prefill workers ({self.ns.transport}, "
            f"model {self.ns.model}); SIGTERM or Ctrl-C stops all")
        while not self.signals:
            if (c := self.died()) is not None:
                fail(f"{c.name} (pid {c.proc.pid}) exited {c.proc.returncode} unexpectedly: {c.last_line()} "
                     f"(log {c.log}); stopping the rest")
                self.stop()
                return 1
            time.sleep(POLL_S)
        say(f"signal received: stopping the router, then {m} decode, then {n} prefill workers")
        clean = self.stop()
        if not clean:
            fail(f"not every process stopped cleanly (logs in {self.log_dir})")
        return 0 if clean else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        children = plan(ns)
    except Refused as e:
        parser.error(str(e))
    if ns.dry_run:
        for c in children:
            env = " ".join(f"{k}={v}" for k, v in c.env.items())
            say(f"{c.name}: {env + ' ' if env else ''}{shlex.join(c.command())}")
        return 0
    shared = {d: k for d in {c.device for c in children} if d.startswith("cuda")
              if (k := sum(c.device == d for c in children)) > 1}
    for d, k in sorted(shared.items()):
        say(f"note: {k} workers share {d}; give each its share (--decode-args \"--gpu-memory-utilization ...\")")
    log_dir = ns.log_dir or tempfile.mkdtemp(prefix="kvt-xpyd-")
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        parser.error(f"--log-dir {log_dir}: {e}")
    return Launcher(children, ns, log_dir).run()


if __name__ == "__main__":
    sys.exit(main())
