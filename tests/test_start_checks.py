"""Settings that cannot work are said plainly, and what the decode worker says about a peer stays true (issue #36,
item 7), in real processes on CPU (`tiny`, gloo):

- `--max-seq-len` over the model's context: exit 2 at start, one line naming the flag and the context, before a
  pool is allocated (it once allocated the memory and told clients the slot was longer than the model's context);
- a wrong rendezvous port (`--dist-init` naming a port the prefill worker does not host): exit 2 within
  `--dist-timeout-s`, one log line per retry, no C++ traces (it once retried for --handshake-timeout-s, 120 s,
  each try a torch trace);
- a prefill worker that stopped and exited: the decode worker's refusals say it is unreachable, not that it "reports
  NOT_SERVING (it is stopping)" (what it last said before it went);
- the test-only fault flags are left out of `--help` and still work;
- every flag of the xPyD launcher is in deploy/README.md (`--metrics-base-port` was not).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from bench.measure.launch import ROOT, free_port, stop
from decode_server.client import generate
from support.faultkit import SERVING, Half, Pair
from support.forked import spawn


def python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_max_seq_len_over_the_models_context_is_refused_at_start(tmp_path):
    """A forked server (support/forked.py): its own flags, load and exit, without a start's imports."""
    log = tmp_path / "decode.log"
    p = spawn("decode_server", ["--colocated", "--model", "tiny", "--max-seq-len", "100000",
                                "--listen", f"127.0.0.1:{free_port()}"], str(log))
    try:
        rc = p.wait(timeout=300)
    finally:
        stop([p], grace_s=5)
    text = log.read_text()
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert rc == 2, (rc, text[-2000:])
    assert len(errors) == 1 and "--max-seq-len 100000 is over the model's context of 4096 tokens" in errors[0], errors
    assert "KV pool:" not in text  # refused before the pool was allocated


def test_a_wrong_rendezvous_port_fails_clearly_within_dist_timeout(tmp_path):
    dist_timeout = 5.0
    with Pair(tmp_path) as pair:
        args = pair.decode.args
        wrong = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there; the prefill worker hosts another port
        pair.decode.args = [wrong if a.startswith("tcp://") else a for a in args] + [
            "--dist-timeout-s", f"{dist_timeout:g}", "--handshake-timeout-s", "120"]
        pair.prefill.start()
        pair.wait_line(pair.prefill, "prefill server ready")
        pair.decode.start()
        pair.wait_line(pair.decode, "NOT_SERVING until paired")
        t0 = time.monotonic()
        try:
            rc = pair.decode.proc.wait(timeout=dist_timeout + 60)  # generous: the old code ran for 120 s
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still retrying {dist_timeout + 60:g} s later\n{pair.log_text()}") from None
        took = time.monotonic() - t0
        text = pair.decode.log_text()
        lines = text[text.index("NOT_SERVING until paired"):].splitlines()[1:]
        assert rc == 2 and took < dist_timeout + 30, (rc, took, text[-3000:])
        assert "cannot start" in lines[-1] and wrong.removeprefix("tcp://") in lines[-1] \
            and "--dist-init" in lines[-1], lines[-1]
        retries = [line for line in lines if "pairing failed: nothing answers at the rendezvous" in line]
        # one line per retry: the first handshake's, then each retry's own line, then the refusal
        assert 1 <= len(retries) and len(lines) == len(retries) + 2, "\n".join(lines)
        assert "frame #" not in text and "[c10d]" not in text, text[-3000:]
        assert pair.prefill.proc.poll() is None  # the prefill worker is not disturbed


def refusal(addr: str) -> tuple[grpc.StatusCode, str]:
    try:
        asyncio.run(generate(addr, [5, 6, 7], 2, timeout=10))
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()


def test_a_prefill_worker_that_exited_is_reported_unreachable_not_stopping(tmp_path):
    with Pair(tmp_path) as pair:
        pair.start()
        pair.prefill.proc.send_signal(signal.SIGTERM)
        pair.wait_line(pair.decode, "prefill peer 127.0.0.1")  # the decode side saw it stop
        assert pair.prefill.proc.wait(timeout=30) == 0
        deadline, seen = time.monotonic() + 15, []
        while time.monotonic() < deadline:
            code, details = refusal(pair.addr)
            seen.append(details)
            if "unreachable" in details:
                break
            time.sleep(0.2)
        assert code == grpc.StatusCode.UNAVAILABLE and "unreachable" in details, seen[-3:]
        assert "it is stopping" not in details and pair.prefill_addr in details, details
        # and once it is back, the pair heals as before
        pair.prefill.start()
        pair.wait_health(SERVING, 120)


def test_the_fault_injection_flags_are_left_out_of_help_and_still_work():
    """In process, through the servers' own argument parsing (kvtransfer.rpc.configargs, what `python -m
    prefill_server` runs): four server starts cost ~30 s of CI, for what the parser alone decides."""
    from decode_server.config import DecodeConfig
    from kvtransfer.rpc.configargs import Parser, add_arguments, from_args
    from prefill_server.config import PrefillConfig

    for cls, hidden in ((PrefillConfig, ("--fail-after-layers", "--fail-stall-s", "--fail-requests")),
                        (DecodeConfig, ("--fail-scheduler-after-steps",))):
        parser = Parser(prog="x")
        add_arguments(parser, cls)
        text = parser.format_help()
        assert "--max-prompt-tokens" in text and not [f for f in hidden if f in text], text
    # still parsed: the flags are taken, and their values reach the config (or are refused, named)
    pre = from_args(PrefillConfig, ["--fail-after-layers", "2", "--fail-stall-s", "1", "--fail-requests", "2"], "")
    assert (pre.fail_after_layers, pre.fail_stall_s, pre.fail_requests) == (2, 1.0, 2)
    with pytest.raises(SystemExit) as e:
        from_args(DecodeConfig, ["--colocated", "--fail-scheduler-after-steps", "-5"], "")
    assert e.value.code == 2


def test_every_launcher_flag_is_in_the_deploy_readme():
    p = python("-m", "deploy.launch_xpyd", "--help", timeout=60)
    assert p.returncode == 0, p.stderr
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", p.stdout)) - {"--help"}
    with open(os.path.join(ROOT, "deploy", "README.md")) as f:
        readme = f.read()
    assert len(flags) > 10 and not sorted(f for f in flags if f"`{f}" not in readme), flags
