"""Restart churn: kill -9, SIGTERM and restart of either worker, one after another, under load.

Why: each lifecycle fix (tests/test_pair_lifecycle.py) is one order of events; an operator's restarts come in
any order, while clients keep sending. What must hold after every cycle: the pair serves again (within
SERVE_AGAIN_S of the restart: a bound that catches a pair that never comes back, not a speed), a stopped process
is gone within its grace plus EXIT_S, and no request hangs (each ends by its deadline, give or take CALL_SLACK_S).
The times (a busy machine stretches them) are printed as one `CHURN {...}` line, not asserted. The workers are forked
from the test worker's fork server (support/forked.py), so a restart is the model's load and the pairing, not the
seconds of imports of a fresh interpreter (~1 s a cycle, was ~9 s).

The order (ORDER): every kind of restart comes right after every other kind once (an Eulerian circuit of the
four kinds: 12 transitions in 13 cycles), so each of the 12 "this, then that" sequences runs, each kind 3 or 4
times, and either worker survives several restarts of the other in a row. (It was 20 cycles in a seeded random
order, which ran 7 of the 12 and took ~9 s a cycle, a worker's start being mostly its imports.)
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import grpc
import pytest

from decode_server.client import generate
from support.faultkit import SERVING, Pair

KINDS = {"A": ("prefill", "kill"), "B": ("prefill", "term"), "C": ("decode", "kill"), "D": ("decode", "term")}
ORDER = "ABACADBCBDCDA"  # AB BA AC CA AD DB BC CB BD DC CD DA: every ordered pair of two kinds, once
CYCLES = len(ORDER)
GRACE_S = 3.0  # --shutdown-grace-s of both workers
EXIT_S = 10.0  # a stopped process is gone within its grace plus this (~1 s on an idle machine; a torch process's
# exit takes seconds more on a busy one; a stop that hangs is still caught)
SERVE_AGAIN_S = 60.0  # a restarted worker's pair serves again within this of its restart (~1-2 s forked on an idle
# machine; a spawned start, KVT_TEST_SPAWN=1, is ~8-10 s of imports and loading on a CI core, 16.5 s was seen beside
# other work: the bound catches a pair that never comes back)
CALL_S = 5.0  # each client request's deadline
CALL_SLACK_S = 5.0  # a call's own set-up beyond its deadline (a fresh event loop and channel): a hang is longer
PROMPT = [5, 6, 7, 8]
pytestmark = pytest.mark.churn  # run alone: make test's last pass


class Client(threading.Thread):
    """Sends one request after another until stopped; records each one's outcome and how long it took."""

    def __init__(self, addr: str):
        super().__init__(daemon=True)
        self.addr, self.stopped, self.calls = addr, threading.Event(), []

    def run(self) -> None:
        while not self.stopped.is_set():
            t0 = time.monotonic()
            try:
                asyncio.run(generate(self.addr, PROMPT, 4, timeout=CALL_S))
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            self.calls.append((code, time.monotonic() - t0))
            if code != "OK":
                time.sleep(0.05)


def serves_within(addr: str, limit: float) -> float | None:
    """Seconds until the pair served a request again; None if it did not within `limit`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            asyncio.run(generate(addr, PROMPT, 2, timeout=2))
            return time.monotonic() - t0
        except grpc.aio.AioRpcError:
            time.sleep(0.1)
    return None


def test_the_order_runs_every_kind_after_every_other():
    pairs = {ORDER[i:i + 2] for i in range(len(ORDER) - 1)}
    assert len(pairs) == len(ORDER) - 1 == 12 and pairs == {a + b for a in KINDS for b in KINDS if a != b}


def test_restart_churn_keeps_the_pair_serving(tmp_path):
    common = ["--shutdown-grace-s", str(GRACE_S), "--dist-timeout-s", "20"]
    with Pair(tmp_path, prefill_args=common, decode_args=[*common, "--handshake-timeout-s", "60"]) as pair:
        pair.start()
        client = Client(pair.addr)
        client.start()
        cycles = []
        try:
            for kind in ORDER:
                side, how = KINDS[kind]
                half = pair.prefill if side == "prefill" else pair.decode
                t0 = time.monotonic()
                half.proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
                code = half.proc.wait(timeout=GRACE_S + EXIT_S + 30)
                gone = time.monotonic() - t0
                if how == "term":
                    assert code == 0 and gone <= GRACE_S + EXIT_S, (side, code, gone, pair.log_text())
                t1 = time.monotonic()
                half.start()
                again = serves_within(pair.addr, SERVE_AGAIN_S)
                assert again is not None, (side, how, f"not serving again {SERVE_AGAIN_S} s after", pair.log_text())
                cycles.append({"side": side, "how": how, "exit_s": round(gone, 2), "serving_again_s": round(again, 2),
                               "restart_to_serving_s": round(time.monotonic() - t1, 2)})
            # the client that kept sending through every restart is served once the pair is back (how many of its
            # calls succeeded depends on the machine's speed: how short the windows between restarts are)
            mark, end = len(client.calls), time.monotonic() + SERVE_AGAIN_S
            while time.monotonic() < end and not any(c == "OK" for c, _ in client.calls[mark:]):
                time.sleep(0.1)
            client_served = any(c == "OK" for c, _ in client.calls[mark:])
        finally:
            client.stopped.set()
            client.join(timeout=CALL_S + 10)
        assert pair.wait_health(SERVING, 30) >= 0
    assert not client.is_alive()
    hung = [c for c in client.calls if c[1] > CALL_S + CALL_SLACK_S]
    codes = {}
    for code, _ in client.calls:
        codes[code] = codes.get(code, 0) + 1
    print("CHURN " + json.dumps({"cycles": len(cycles), "requests": len(client.calls), "outcomes": codes,
                                 "hung": len(hung), "max_call_s": round(max(c[1] for c in client.calls), 2),
                                 "max_serving_again_s": max(c["serving_again_s"] for c in cycles),
                                 "max_exit_after_term_s": max([c["exit_s"] for c in cycles if c["how"] == "term"],
                                                              default=None),
                                 "per_cycle": cycles}))
    assert len(cycles) == CYCLES and not hung and client_served, codes
