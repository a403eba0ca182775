"""Faults on a real pair (CPU, separate processes): kill -9 mid-stream, restarts, a downed or slow link.

Each test checks that the request in flight ends as --on-failure says, and how long that
took; that requests succeed again once the peer is back, with the survivor never restarted
(the pair is re-established: a fresh process group for gloo, a reconnect for gRPC); and
that nothing leaks (metrics: requests, expected frames, receivers, buffer bytes, threads).
The measured times are printed as `FAULT {...}` lines (pytest -s) for docs/faults.md.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import pytest

from decode_server.client import generate
from kvtransfer.model.prefill import random_prompt
from support import netns
from support.enginekit import engine_generate
from support.faultkit import NOT_SERVING, SERVING, Call, Pair, assert_no_leaks, remote_host, shape, value

NEW = 6
HOLD = ["--fail-after-layers", "2", "--fail-requests", "1"]
REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def prompt(n: int, seed: int) -> list[int]:
    return random_prompt(512, n, seed=seed).view(-1).tolist()


def want(model, ids) -> list[int]:
    return engine_generate(model, ids, NEW)[0]


def report(record_property, name: str, **figures) -> None:
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    record_property("fault", json.dumps(figures))
    print(f"FAULT {name} {json.dumps(figures)}")


def ended_as_policy(call: Call, policy: str, tokens: list[int]) -> None:
    if policy == "fail":
        assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
        assert "prefill worker" in call.details and "--on-failure recompute" in call.details, call.details
    else:
        assert call.code == grpc.StatusCode.OK, (call.code, call.details)
        assert call.result["tokens"] == tokens and call.result["timing"]["mode"] == "recompute"


def remote_ok(pair: Pair, ids, tokens) -> float:
    out = asyncio.run(generate(pair.addr, ids, NEW, timeout=60))
    assert out["tokens"] == tokens and out["timing"]["mode"] in ("layerwise", "bulk"), out["timing"]
    return out["timing"]["cache_ready_ms"]


@pytest.fixture
def pair_factory(tmp_path):
    made = []

    def make(*args, **kwargs) -> Pair:
        made.append(Pair(tmp_path, *args, **kwargs))
        return made[-1]
    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("transport,policy", [("gloo", "fail"), ("grpc", "recompute")])
def test_prefill_killed_mid_stream(pair_factory, tiny_fp32, record_property, transport, policy):
    """kill -9 the prefill worker while it holds a transfer; then start it again: the decode worker re-pairs."""
    ids, later = prompt(200, 1), prompt(37, 2)
    pair = pair_factory(transport, prefill_args=[*HOLD, "--fail-stall-s", "60"],
                        decode_args=["--on-failure", policy, "--request-timeout-s", "30"])
    pair.start()
    decode_pid = pair.decode.proc.pid
    call = Call(pair.addr, ids, NEW)
    pair.wait_line(pair.prefill, "fault injection: holding")
    t_fault = time.monotonic()
    pair.prefill.kill(signal.SIGKILL)
    ended_as_policy(call.outcome(30), policy, want(tiny_fp32, ids))
    to_terminal = call.t_end - t_fault
    to_not_serving = pair.wait_health(NOT_SERVING, 10)
    assert pair.health("kvtransfer.v1.Decode") == (SERVING if policy == "recompute" else NOT_SERVING)
    t0 = time.monotonic()
    while_down = Call(pair.addr, later, NEW).outcome(30)
    ended_as_policy(while_down, policy, want(tiny_fp32, later))
    down_ms = (while_down.t_end - t0) * 1e3
    pair.prefill.args += ["--fail-after-layers", "-1"]  # the restarted worker holds nothing
    pair.prefill.start()
    to_repaired = pair.wait_health(SERVING, 60)
    assert pair.decode.proc.pid == decode_pid and pair.decode.proc.poll() is None
    ttft = remote_ok(pair, later, want(tiny_fp32, later))
    assert_no_leaks(pair)
    assert value(pair.metrics("decode"), "kvt_pairings_total") == 2
    assert "the prefill worker restarted" in pair.decode.log_text()
    report(record_property, f"prefill_kill9[{transport}-{policy}]", in_flight_to_terminal_s=to_terminal,
           health_not_serving_after_s=to_not_serving, request_while_down_ms=down_ms,
           restart_to_repaired_s=to_repaired, ttft_after_ms=ttft)


@pytest.mark.parametrize("transport", ["gloo", "grpc"])
def test_decode_restarted_mid_stream(pair_factory, tiny_fp32, record_property, transport):
    """kill -9 the decode worker during a transfer, start it again: the prefill worker (never restarted) re-pairs."""
    ids = prompt(120, 3)
    pair = pair_factory(transport, prefill_args=[*HOLD, "--fail-stall-s", "2"])
    pair.start()
    prefill_pid = pair.prefill.proc.pid
    call = Call(pair.addr, ids, NEW)
    pair.wait_line(pair.prefill, "fault injection: holding")
    t_fault = time.monotonic()
    pair.decode.kill(signal.SIGKILL)
    call.outcome(30)
    assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
    to_terminal = call.t_end - t_fault
    if transport == "gloo":  # the held transfer meets the dead peer: the group is closed for good
        pair.wait_line(pair.prefill, "data plane lost")
    pair.decode.start()
    to_repaired = pair.wait_health(SERVING, 60)
    assert pair.prefill.proc.pid == prefill_pid and pair.prefill.proc.poll() is None
    ttft = remote_ok(pair, ids, want(tiny_fp32, ids))
    assert_no_leaks(pair)
    assert value(pair.metrics("prefill"), "kvt_pairings_total") == 2
    assert "pairing epoch 2" in pair.prefill.log_text()
    report(record_property, f"decode_kill9_restart[{transport}]", in_flight_to_terminal_s=to_terminal,
           restart_to_repaired_s=to_repaired, ttft_after_ms=ttft)


def test_prefill_stalled(pair_factory, tiny_fp32, record_property):
    """A prefill worker that hangs mid-transfer (alive, link fine): --peer-timeout-s bounds the wait, then recompute."""
    ids, other = prompt(90, 7), prompt(20, 8)
    # --peer-timeout-s also bounds the request after the stall, which must not miss it under load: 4 s (2 s was as
    # tight as the one that missed in test_paged_servers, CI run 36), the stall well past it
    pair = pair_factory("gloo", prefill_args=[*HOLD, "--fail-stall-s", "10"],
                        decode_args=["--on-failure", "recompute", "--peer-timeout-s", "4"])
    pair.start()
    t0 = time.monotonic()
    call = Call(pair.addr, ids, NEW)
    pair.wait_line(pair.prefill, "fault injection: holding")
    behind = Call(pair.addr, other, NEW)  # queued behind the held transfer on the prefill worker
    ended_as_policy(call.outcome(30), "recompute", want(tiny_fp32, ids))
    ended_as_policy(behind.outcome(30), "recompute", want(tiny_fp32, other))
    to_terminal = call.t_end - t0
    pair.wait_line(pair.prefill, "transfer released")
    ttft = remote_ok(pair, ids, want(tiny_fp32, ids))  # the late frames were drained and dropped: in step again
    assert_no_leaks(pair)
    assert value(pair.metrics("decode"), "kvt_pairings_total") == 1  # slow is not dead: no re-pairing
    assert value(pair.metrics("decode"), "kvt_failures_total", cause="peer_timeout") == 2
    report(record_property, "prefill_stalled[gloo-recompute]", in_flight_to_terminal_s=to_terminal,
           ttft_after_ms=ttft)


@needs_netns
@pytest.mark.parametrize("transport,policy", [("gloo", "recompute"), ("grpc", "fail")])
def test_link_down_mid_transfer(pair_factory, tiny_fp32, record_property, transport, policy):
    """Down the veth while a transfer is held; bring it back: the policy, then the pair is rebuilt, once. (Keepalive
    at 2 s, the default: at 1 s, under a load of ~7.7, it once paired a third time; a missed ping is suspected.)"""
    ids = prompt(150, 4)
    with remote_host(transport[:2]) as r, pair_factory(
            transport, remote=r, prefill_args=[*HOLD, "--fail-stall-s", "3", "--send-timeout-s", "5"],
            decode_args=["--on-failure", policy, "--peer-keepalive-s", "2", "--request-timeout-s", "60",
                         "--dist-timeout-s", "30"]) as pair:
        pair.start()
        call = Call(pair.addr, ids, NEW)
        pair.wait_line(pair.prefill, "fault injection: holding")
        t_fault = time.monotonic()
        netns.set_link(r.host, False)
        ended_as_policy(call.outcome(30), policy, want(tiny_fp32, ids))
        to_terminal = call.t_end - t_fault
        to_not_serving = time.monotonic() - t_fault + pair.wait_health(NOT_SERVING, 10)
        time.sleep(max(0.0, 5 - (time.monotonic() - t_fault)))
        t_up = time.monotonic()
        netns.set_link(r.host, True)
        to_repaired = pair.wait_health(SERVING, 60)
        ttft = remote_ok(pair, ids, want(tiny_fp32, ids))
        assert_no_leaks(pair, timeout=30)
        assert value(pair.metrics("decode"), "kvt_pairings_total") == 2
        report(record_property, f"link_down[{transport}-{policy}]", in_flight_to_terminal_s=to_terminal,
               health_not_serving_after_s=to_not_serving, link_down_s=t_up - t_fault,
               link_up_to_repaired_s=to_repaired, ttft_after_ms=ttft)


@needs_netns
def test_slow_link(pair_factory, tiny_fp32, record_property):
    """A rate-limited veth (tc tbf): correct but slower; slower than --peer-timeout-s: the policy, then recovery."""
    ids, big = prompt(64, 5), prompt(1000, 6)  # 1000 tokens of tiny float32: 1 MiB of cache
    with remote_host("s") as r, pair_factory("gloo", remote=r, decode_args=["--peer-timeout-s", "4",
                                                                            "--request-timeout-s", "60"]) as pair:
        pair.start()
        fast = remote_ok(pair, big, want(tiny_fp32, big))
        shape(r, "tbf rate 8mbit burst 32kbit latency 50ms")  # 1 MiB: ~1 s
        slow = remote_ok(pair, big, want(tiny_fp32, big))
        shape(r, "tbf rate 1mbit burst 32kbit latency 50ms")  # 1 MiB now takes ~8 s: over --peer-timeout-s
        t0 = time.monotonic()
        call = Call(pair.addr, big, NEW).outcome(30)
        ended_as_policy(call, "fail", [])
        assert "--peer-timeout-s 4" in call.details, call.details
        to_terminal = call.t_end - t0
        shape(r, None)
        ttft = remote_ok(pair, ids, want(tiny_fp32, ids))
        assert_no_leaks(pair)
        assert value(pair.metrics("decode"), "kvt_pairings_total") == 1  # slow is not dead: no re-pairing
        report(record_property, "slow_link[gloo-fail]", ttft_1k_fast_ms=fast, ttft_1k_8mbit_ms=slow,
               over_peer_timeout_to_terminal_s=to_terminal, ttft_after_ms=ttft)
