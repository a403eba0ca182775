"""deploy/launch_xpyd.py (issue #28) as a user runs it: a real launcher process on CPU starting N prefill and M
decode workers (`tiny`, gRPC data plane) and the router over them, one request per decode worker through the
router answered with the tokens the engine makes alone, then SIGTERM: the router, the decode and the prefill
workers stop in that order, each exit 0, and so does the launcher.

Why 1P1D here: the launcher's mechanics (start, wait, route, ordered stop) are the same at any N x M, and each
process start costs seconds of a shared CPU; 2P2D in real processes, behind the router, with kills, is
tests/test_xpyd.py, and the dry-run test checks the lists the launcher passes at 2 x 3, at no process start.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from bench.measure.launch import ROOT, free_port
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.enginekit import engine_generate

START_S = 90.0  # the launcher's own --start-timeout-s is a little less, so it reports first
STOP_S = 30.0
LINE = re.compile(r"^(prefill-\d+|decode-\d+|router)\s+pid (\d+)\s+(\S+)\s")


def launcher(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "deploy.launch_xpyd", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "deploy.launch_xpyd", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=60)


class Lines:
    """The launcher's output, read on a thread so every wait has a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.q: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def until(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} line in {timeout} s:\n" + "\n".join(self.seen))

    def rest(self, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
        return self.seen


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def logs(log_dir) -> str:
    if not os.path.isdir(log_dir):
        return ""
    return "\n".join(f"--- {name}\n{open(os.path.join(log_dir, name)).read()[-3000:]}"
                     for name in sorted(os.listdir(log_dir)))


def test_launcher_serves_through_the_router_and_stops_in_order(tmp_path, tiny_fp32):
    n = m = 1
    log_dir, router_addr = tmp_path / "logs", f"127.0.0.1:{free_port()}"
    proc = launcher("--prefill", str(n), "--decode", str(m), "--model", "tiny", "--dtype", "float32",
                    "--transport", "grpc", "--device-prefill", "cpu", "--device-decode", "cpu",
                    "--router-listen", router_addr, "--log-dir", str(log_dir), "--start-timeout-s", str(START_S - 10),
                    "--stop-grace-s", "10", "--decode-args", "--no-prefix-cache --log-level INFO",
                    "--router-args", "--load-poll-s 0.1")
    out, pids = Lines(proc), {}
    try:
        assert out.until("logs in", 30) == f"logs in {log_dir}"
        ready = out.until("ready:", START_S)
        assert router_addr in ready and f"{m} decode x {n} prefill" in ready, ready
        for line in out.seen:
            if hit := LINE.match(line):
                pids[hit.group(1)] = (int(hit.group(2)), hit.group(3))
        names = {f"prefill-{i}" for i in range(n)} | {f"decode-{j}" for j in range(m)} | {"router"}
        assert set(pids) == names and pids["router"][1] == router_addr, out.seen
        decode_addrs = {pids[f"decode-{j}"][1] for j in range(m)}

        served = set()
        with grpc.insecure_channel(router_addr) as ch:
            stub = pbg.DecodeStub(ch)
            for k in range(m):  # sequential: least_loaded's ties go to the worker chosen least recently
                ids = [3 + (7 * k + i) % 500 for i in range(12 + k)]
                call = stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=6), timeout=30)
                tokens = [msg.token_id for msg in call]
                assert tokens == engine_generate(tiny_fp32, ids, 6)[0], (k, tokens)
                served.add(dict(call.initial_metadata())["kvt-worker"])
        assert served == decode_addrs, (served, decode_addrs)

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_S) == 0, "\n".join(out.rest())
        took = time.monotonic() - t0
        lines = out.rest()
        stopped = [line.split()[1] for line in lines if line.startswith("stopped ")]
        assert stopped == ["router", *[f"decode-{j}" for j in range(m)], *[f"prefill-{i}" for i in range(n)]], lines
        assert all(line.endswith(": exit 0") for line in lines if line.startswith("stopped ")), lines
        assert not [name for name, (pid, _) in pids.items() if alive(pid)], lines
        assert took < STOP_S, took
    except BaseException as e:
        raise AssertionError(f"{e}\n{logs(log_dir)}") from e
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid, _ in pids.values():  # only what this launcher started; the children have their own group
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_dry_run_lists_every_prefill_worker_to_every_decode_worker_in_order():
    p = run("--prefill", "2", "--decode", "3", "--transport", "gloo", "--device-prefill", "cpu",
            "--device-decode", "cpu", "--base-port", "41000", "--router-listen", "127.0.0.1:41900", "--dry-run")
    assert p.returncode == 0, p.stderr
    cmds = {line.split(":", 1)[0]: line.split(": ", 1)[1].split() for line in p.stdout.splitlines()}
    assert list(cmds) == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "router"]

    def flag(name: str, key: str) -> str:
        argv = cmds[name]
        return argv[argv.index(key) + 1]
    assert [flag(f"prefill-{i}", "--listen") for i in range(2)] == ["127.0.0.1:41000", "127.0.0.1:41001"]
    assert [flag(f"prefill-{i}", "--dist-init") for i in range(2)] == ["tcp://127.0.0.1:41005",
                                                                       "tcp://127.0.0.1:41006"]
    for j in range(3):
        assert flag(f"decode-{j}", "--listen") == f"127.0.0.1:{41002 + j}"
        assert flag(f"decode-{j}", "--prefill-addr") == "127.0.0.1:41000,127.0.0.1:41001"
        assert flag(f"decode-{j}", "--dist-init") == "tcp://127.0.0.1:41005,tcp://127.0.0.1:41006"
    assert flag("router", "--worker") == "127.0.0.1:41002,127.0.0.1:41003,127.0.0.1:41004"
    assert flag("router", "--listen") == "127.0.0.1:41900"

    p = run("--prefill", "2", "--decode", "2", "--transport", "grpc", "--device-prefill", "cuda:0,cuda:1",
            "--device-decode", "cuda:2,cuda:3", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "--dist-init" not in p.stdout and p.stdout.count("--device cuda:") == 4
    for i, line in enumerate(p.stdout.splitlines()[:4]):
        assert f"--device cuda:{i} " in line, line


@pytest.mark.parametrize("args,words", [
    (["--prefill", "0"], "need at least one of each"),
    (["--decode-args", "--listen 127.0.0.1:1"], "--decode-args sets --listen"),
    (["--device-decode", "gpu0"], "'gpu0' is not a device"),
    (["--transport", "nccl", "--device-prefill", "cpu", "--device-decode", "cpu"], "needs CUDA devices"),
    (["--router-listen", "nowhere"], "--router-listen 'nowhere'"),
    (["--prefill-args", "--x 'unclosed"], "--prefill-args: No closing quotation"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    p = run(*args, "--dry-run")
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and words in p.stderr, p.stderr


def test_torchrun_pair_takes_a_lone_flag_as_a_servers_extra_flags():
    """`--decode-args "--no-prefix-cache"` exited 2 ("expected one argument"): argparse took the lone flag for an
    option of its own (an operator's pass); launch_xpyd's parser already took it as the value."""
    from deploy.torchrun_pair import parse
    known, shared = parse(["--model", "tiny", "--decode-args", "--no-prefix-cache", "--prefill-args", "--seed 3"])
    assert known.decode_args == "--no-prefix-cache" and known.prefill_args == "--seed 3"
    assert shared == ["--model", "tiny"] and not known.deterministic
