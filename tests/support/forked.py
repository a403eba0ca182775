"""Server processes for the CPU tests, forked from a fork server that imported the servers once.

Why: a server started as `python -m decode_server` spends most of its start importing torch, transformers and
the engine (~5 s of a CI core, measured), and the suite starts ~170 servers. Forked instead from one process per
test worker that imported them once (multiprocessing's "forkserver": it never ran torch, gRPC or any server
code, so nothing of either is live in it when it forks; tests/support/harness.py's transport pairs fork from the
same one), each server is still its own process with its own pid, ports, signals, log and exit code: the child
takes its environment and working directory, points its stdout/stderr at its log, and runs the module as
`python -m` does (`runpy.run_module(..., "__main__")`), so `main()` parses the flags and ends the process as it
does for a user (exit 2 at start, 70 fatal, 0 after SIGTERM).

What it does not exercise is the import itself: the CLI tests that start `python -m ...` or the console scripts
(tests/test_operability.py, test_api_readme.py, test_stacks.py, test_start_checks.py, test_churn.py) still do.
Only the decode and prefill servers fork (the router and the HTTP front import little); a server in a network
namespace (`prefix`) or on a CUDA machine is spawned as before; KVT_TEST_SPAWN=1 spawns every server.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from multiprocessing.connection import wait as _wait_ready

from bench.measure import launch

__all__ = ["PRELOAD", "context", "spawn"]

# What the fork server imports once: the transport pairs' sides (harness), the p2p bench's side, and the servers.
PRELOAD = ["support.harness", "support.forked", "bench.measure.p2p", "kvtransfer.transport.dist.backend",
           "kvtransfer.transport.grpc.backend", "decode_server.__main__", "prefill_server.__main__"]
FORKED = ("decode_server", "prefill_server")
_SPAWN = launch.spawn  # the real one (tests/conftest.py puts `spawn` below in its place)


def context():
    """The fork server's multiprocessing context (one per test worker; PRELOAD applies when it starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@functools.cache
def enabled() -> bool:
    if os.environ.get("KVT_TEST_SPAWN") == "1":
        return False
    import torch
    return not torch.cuda.is_available()


def _run(module: str, args: list[str], log_path: str, env: dict) -> None:
    """In the forked child: the environment, working directory and log a spawned server gets, then the module
    as `python -m module args` runs it (its main ends the process with the server's exit code)."""
    import runpy
    os.environ.clear()
    os.environ.update(env)
    os.chdir(launch.ROOT)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # PYTHONUNBUFFERED
    sys.argv = [module, *args]  # run_module puts the module's file first, as -m does
    sys.modules.pop(f"{module}.__main__", None)  # preloaded (its imports stay); -m runs it afresh as __main__
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class Forked:
    """The subprocess.Popen surface the tests and bench/measure/launch.py use, over a forked server."""

    def __init__(self, proc, args: list[str]):
        self._proc, self.args, self.pid = proc, args, proc.pid
        self._lock = threading.Lock()  # the exit status is read once from the fork server's pipe
        self.stdout = self.stderr = self.stdin = None

    def poll(self) -> int | None:
        with self._lock:
            return self._proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None and not _wait_ready([self._proc.sentinel], timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        code = self.poll()
        assert code is not None
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


def spawn(module: str, args: list[str], log_path: str, env: dict | None = None, prefix: tuple = ()):
    """bench.measure.launch.spawn's signature and result: the decode and prefill servers forked (module doc), any
    other module, a `prefix`ed command or a CUDA machine's servers spawned by launch.spawn itself."""
    if prefix or module not in FORKED or not enabled():
        return _SPAWN(module, args, log_path, env=env, prefix=prefix)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = launch.ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "w"):
        pass
    proc = context().Process(target=_run, args=(module, [str(a) for a in args], log_path, env), daemon=True,
                             name=f"{module} (forked)")
    proc.start()
    return Forked(proc, [sys.executable, "-m", module, *args])
