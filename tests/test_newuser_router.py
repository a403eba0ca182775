"""What a new user's pass over kvtransfer-router and deploy/launch_xpyd.py on CPU hit, each now fixed and guarded.

Found by trying the router and the launcher as docs/router.md and deploy/README.md say, mistakes included:
- a --max-message-bytes too big for gRPC was a Python traceback and exit 1, not "one line, exit 2"
  (kvtransfer/rpc/limits.py now bounds it);
- a very long --request-timeout-s (1e10 s, or inf) started a router that reported SERVING and failed every request
  DEADLINE_EXCEEDED at once (every time flag is now at most 1e7 s: kvtransfer/rpc/flagchecks.py);
- --shutdown-grace-s nan was accepted, and the SIGTERM that used it ended the router with exit 2 and cut the
  streams in flight;
- placement's "this router's requests as the last Load report counts them" charged a request still waiting for its
  first token with prompt + max_new_tokens, where the docstring (and the worker's report) counts its prompt only;
- the launcher's --router-args/--decode-args refused a lone flag (`--router-args "--no-prefix-affinity"`:
  "expected one argument"), and its refusal of the flags it sets itself was bypassed by an abbreviation
  (`--router-args "--lis 0.0.0.0:50050"` bound the router to every interface): the servers now take no
  abbreviations.
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

from bench.measure.launch import ROOT, free_port, stop, wait_serving
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.faultkit import Half

ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
WORKER_ARGS = ["--colocated", "--model", "tiny", "--dtype", "float32", "--device", "cpu", "--no-prefix-cache"]


def router_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "router", *args]


def launcher(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.launch_xpyd", *args], cwd=ROOT, env=ENV, text=True,
                          capture_output=True, timeout=60)


def test_too_big_max_message_bytes_is_one_line_and_exit_2_not_a_traceback():
    """docs/router.md, "Flags": "A bad value exits 2 with one line naming the flag"."""
    try:
        p = subprocess.run(router_cmd("--worker", "127.0.0.1:5", "--listen", f"127.0.0.1:{free_port()}",
                                      "--max-message-bytes", "3000000000"),
                           cwd=ROOT, env=ENV, text=True, capture_output=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("the router started with --max-message-bytes 3000000000 (over gRPC's int limit) instead of "
                    "refusing it")
    assert "Traceback" not in p.stderr, p.stderr[-1500:]
    assert p.returncode == 2, (p.returncode, p.stderr[-1500:])
    assert "--max-message-bytes" in p.stderr, p.stderr[-1500:]


def test_shutdown_grace_nan_is_refused_at_start():
    """nan passes `< 0`; the SIGTERM that uses it exits 2 'cannot start: cannot convert float NaN to integer'."""
    from router.config import from_args
    with pytest.raises(SystemExit) as e:
        from_args(["--worker", "127.0.0.1:5", "--shutdown-grace-s", "nan"])
    assert e.value.code == 2


def test_a_waiting_request_counts_its_prompt_only_as_the_workers_report_does():
    """Worker.own_as_reported: 'a running one (its first token came) by prompt + max_new_tokens, a waiting one by
    its prompt'. `t.first is not None` is always true (first is a bool), so a waiting one counts prompt + new, and
    the other clients' load (report less this) is under-counted by max_new_tokens per waiting request."""
    from router.workers import Ticket, Worker
    w = Worker("127.0.0.1:5")
    w.tickets.add(Ticket(prompt=100, new=50))  # placed, no first token yet: the worker counts 100 waiting tokens
    assert w.own_as_reported() == 100
    running = Ticket(prompt=10, new=5, first=True)
    w.tickets.add(running)
    assert w.own_as_reported() == 100 + 15


def test_launcher_passes_a_lone_flag_through_router_args():
    """deploy/README.md: `--router-args` is 'more flags for the router, one shell-quoted string'; a single flag
    (`--router-args "--no-prefix-affinity"`, `--decode-args "--deterministic"`) is refused by argparse with
    'argument --router-args: expected one argument'."""
    p = launcher("--router-args", "--no-prefix-affinity", "--device-prefill", "cpu", "--device-decode", "cpu",
                 "--dry-run")
    assert p.returncode == 0, p.stderr
    router_line = [line for line in p.stdout.splitlines() if line.startswith("router:")]
    assert router_line and "--no-prefix-affinity" in router_line[0], p.stdout


def test_an_abbreviated_own_flag_does_not_slip_past_the_launcher():
    """`--router-args "--lis 0.0.0.0:50050"` passes the launcher's refusal of --listen (it matches names exactly),
    and the router's argparse takes `--lis` as --listen: the router binds every interface while the launcher
    checks (and prints) 127.0.0.1:50050. Either the launcher refuses it, or the router does not take the
    abbreviation."""
    p = launcher("--router-args", "--lis 0.0.0.0:50050", "--device-prefill", "cpu", "--device-decode", "cpu",
                 "--dry-run")
    refused_by_launcher = p.returncode == 2
    from router.config import from_args
    try:
        config = from_args(["--worker", "127.0.0.1:5", "--listen", "127.0.0.1:50050", "--lis", "0.0.0.0:50050"])
        refused_by_router = False
    except SystemExit:
        refused_by_router = True
    assert refused_by_launcher or refused_by_router, (p.stdout, config.listen)


def test_a_long_request_timeout_does_not_fail_every_request(tmp_path):
    """`--request-timeout-s 1e10` (or inf: 'no limit'): the router starts, reports SERVING, and every request ends
    at once with DEADLINE_EXCEEDED 'decode worker ADDR: Deadline Exceeded'. Either refuse the value at start (exit
    2, one line naming the flag) or serve the request."""
    waddr, raddr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    w = Half("decode_server", [*WORKER_ARGS, "--listen", waddr], str(tmp_path))
    r = Half("router", ["--worker", waddr, "--listen", raddr, "--request-timeout-s", "1e10"], str(tmp_path))
    w.start()
    r.start()
    try:
        t0 = time.monotonic()
        while r.proc.poll() is None and time.monotonic() - t0 < 5 and "router on port" not in r.log_text():
            time.sleep(0.1)
        if r.proc.poll() is not None:  # refused at start: fine, if it says why as a bad flag does
            assert r.proc.returncode == 2 and "--request-timeout-s" in r.log_text(), r.log_text()[-2000:]
            return
        wait_serving(raddr, [w.proc, r.proc], timeout=60)
        got: list = []

        def call() -> None:  # no deadline of the caller's (as kvtransfer-client sends): the router's limit rules
            with grpc.insecure_channel(raddr) as ch:
                try:
                    got.append([m.token_id for m in pbg.DecodeStub(ch).Generate(
                        pb.GenerateRequest(token_ids=[1, 2, 3], max_new_tokens=4))])
                except grpc.RpcError as e:
                    got.append(f"{e.code().name} {e.details()}")

        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(30)  # bounded here, not by a deadline on the call
        assert got, "no answer within 30 s"
        assert isinstance(got[0], list) and len(got[0]) == 4, \
            f"a router serving with --request-timeout-s 1e10 failed a request: {got[0]}"
    finally:
        for h in (r, w):
            if h.proc.poll() is None:
                h.proc.send_signal(signal.SIGTERM)
        stop([r.proc, w.proc])
