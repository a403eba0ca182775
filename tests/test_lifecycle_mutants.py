"""Cases a mutation pass over how the servers live, die and report found untested: kvtransfer/rpc/lifecycle.py (the
one outcome per request, the drain at shutdown, the fatal stop, the first signal), kvtransfer/rpc/main.py (the exit
codes), kvtransfer/rpc/metrics.py (what a transfer and a step record), decode_server/reports.py (the Load answer and
the live gauges) and api_server/shutdown.py (a request cut off by the grace's end). Each test here failed on a
one-line change of that code that the status, supervision, operability, metrics, admission and API shutdown tests
let through; its docstring names the change it kills.

Why in process, with stand-ins: the real-process tests (test_supervision.py, test_operability.py,
test_api_shutdown.py) see these paths only through one scenario each, where a swapped count in a log line, a
second failure overwriting the first, or a stream's missing [DONE] after a finished answer does not show. Here each
case is a fake context, a fake server and health, a fake engine or a fake ASGI app, so the file runs in seconds on
2 cores, the same way every time. Waits are on conditions, bounded by GUARD_S; the only timeout that elapses is the
drain's grace, which is what is under test.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from types import SimpleNamespace

import grpc
import pytest

from kvtransfer.rpc.lifecycle import (EXIT_FATAL, FatalStop, Request, RunningRequests, Stop, end_by_cancel, outcome,
                                      request_budget, shut_down)
from kvtransfer.rpc.metrics import Metrics, check_metrics_flags

GUARD_S = 10.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Ctx:
    """A grpc.aio servicer context as `outcome` reads it."""

    def __init__(self, code=None, left=None):
        self._code, self.left = code, left

    def code(self):
        return self._code

    def time_remaining(self):
        return self.left


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


# --- kvtransfer/rpc/lifecycle.py: the budget and the outcome ---

def test_a_request_past_its_deadline_gets_no_time_and_a_short_one_a_quarter_less():
    """Caught: the budget's `max(..., 0.0)` dropped (a negative budget when the client's time is already gone)."""
    assert request_budget(None, 5.0) == 5.0
    assert request_budget(-0.5, 5.0) == 0.0
    assert request_budget(0.2, 5.0) == pytest.approx(0.15)
    assert request_budget(10.0, 5.0) == 5.0


def test_an_exception_with_no_status_is_unknown_even_when_the_context_says_ok():
    """Caught: `return "UNKNOWN"` -> another name; GeneratorExit not counted as the client's cancel;
    `left <= DEADLINE_SLACK_S` -> `left <= 0`; `code != OK` dropped (a handler that raised after its context said OK
    counted OK)."""
    assert outcome(Ctx(), None) == "OK"
    assert outcome(Ctx(), RuntimeError("x")) == "UNKNOWN"
    assert outcome(Ctx(grpc.StatusCode.OK), RuntimeError("x")) == "UNKNOWN"
    assert outcome(Ctx(grpc.StatusCode.RESOURCE_EXHAUSTED), RuntimeError("x")) == "RESOURCE_EXHAUSTED"
    assert outcome(Ctx(left=None), asyncio.CancelledError()) == "CANCELLED"
    assert outcome(Ctx(left=5.0), asyncio.CancelledError()) == "CANCELLED"
    assert outcome(Ctx(left=0.03), asyncio.CancelledError()) == "DEADLINE_EXCEEDED"  # within DEADLINE_SLACK_S
    assert outcome(Ctx(left=None), GeneratorExit()) == "CANCELLED"  # a streaming handler closed at its `yield`


# --- the drain and the stop ---

def _drain_scenario(grace_s: float):
    """Two requests in flight: A finishes 50 loop turns into the drain, B waits until it is ended."""
    async def scenario():
        metrics = Metrics("decode")
        running = RunningRequests(metrics)
        forever = asyncio.Event()
        reqs = {}

        async def handler(name, turns):
            with running.request(Ctx()) as r:
                reqs[name] = r
                if turns is None:
                    await forever.wait()
                while not running.draining:
                    await asyncio.sleep(0)
                for _ in range(turns):  # loop turns, well within any grace but more than a grace of 0 gives
                    await asyncio.sleep(0)

        tasks = [asyncio.create_task(handler("A", 50)), asyncio.create_task(handler("B", None))]
        while len(reqs) < 2:
            await asyncio.sleep(0)
        ended = []

        def end(r):
            ended.append(r)
            end_by_cancel(r)

        result = await asyncio.wait_for(running.drain(grace_s, end), GUARD_S)
        await asyncio.gather(*tasks, return_exceptions=True)
        return result, reqs, ended, metrics, running
    return asyncio.run(scenario())


def test_the_drain_lets_a_request_finish_within_its_grace_and_ends_the_rest():
    """Caught: the grace not waited for (timeout 0: a request about to finish is ended); `r.ending = True` dropped
    (a request at a `yield` would never see it was told to end); the drain's count of ended requests 0; a finished
    request not discarded from the running set (its --max-inflight place held for good)."""
    (count, ended_n), reqs, ended, metrics, running = _drain_scenario(1.0)
    assert (count, ended_n) == (2, 1)
    assert ended == [reqs["B"]] and reqs["B"].ending and not reqs["A"].ending
    assert running.draining and not running.requests
    assert sample(metrics, "kvt_requests_total", outcome="OK") == 1
    assert sample(metrics, "kvt_requests_total", outcome="CANCELLED") == 1


def test_end_by_cancel_leaves_a_request_at_a_yield_to_see_ending_itself():
    """Caught: `not r.at_yield` dropped (cancelling a handler suspended at a `yield` leaves its client waiting)."""
    async def scenario():
        task = asyncio.create_task(asyncio.Event().wait())
        at_yield = Request(lambda: task, at_yield=True)
        end_by_cancel(at_yield)
        await asyncio.sleep(0)
        kept = not task.cancelled()
        end_by_cancel(Request(lambda: task))
        with pytest.raises(asyncio.CancelledError):
            await task
        return kept
    assert asyncio.run(scenario())


class FakeServer:
    def __init__(self, calls):
        self.calls = calls

    async def stop(self, grace):
        self.calls.append("stop")


class FakeHealth:
    def __init__(self, calls):
        self.calls = calls

    async def enter_graceful_shutdown(self):
        self.calls.append("health")


def test_shut_down_turns_health_first_and_logs_finished_and_ended_counts(caplog):
    """Caught: health's `enter_graceful_shutdown` skipped (probes keep sending traffic to a stopping replica); the
    log line's finished and ended counts swapped."""
    async def scenario():
        calls = []
        running = RunningRequests(Metrics("decode"))
        gate = asyncio.Event()

        async def handler(wait):
            with running.request(Ctx()):
                if wait:
                    await gate.wait()

        async def slow():  # finishes once health is NOT_SERVING and the drain has begun
            with running.request(Ctx()):
                while "health" not in calls:
                    await asyncio.sleep(0)

        tasks = [asyncio.create_task(handler(True)), asyncio.create_task(handler(True)), asyncio.create_task(slow())]
        while len(running.requests) < 3:
            await asyncio.sleep(0)
        stop = SimpleNamespace(signal="SIGTERM", fatal="")
        log = logging.getLogger("kvtransfer.test_lifecycle_mutants")
        await asyncio.wait_for(shut_down(FakeServer(calls), FakeHealth(calls), running, stop, 1.0, log, "decode"),
                               GUARD_S)
        await asyncio.gather(*tasks, return_exceptions=True)
        return calls
    with caplog.at_level(logging.INFO, logger="kvtransfer.test_lifecycle_mutants"):
        calls = asyncio.run(scenario())
    assert calls == ["health", "stop"]
    line = [r.getMessage() for r in caplog.records if "stopped on" in r.getMessage()]
    assert len(line) == 1 and "decode stopped on SIGTERM" in line[0], line
    assert "3 requests in flight, 1 finished, 2 ended UNAVAILABLE" in line[0], line


def test_only_the_first_failure_is_the_cause_and_it_wakes_the_server(caplog):
    """Caught: `if self.fatal: return` dropped (a later failure, often a consequence, overwrites the cause every
    request and the exit line report); `event.set()` dropped from `_fail_now` (the server never wakes to stop)."""
    async def scenario():
        stop = Stop()
        seen = []
        stop.on_fatal = seen.append
        stop.fail("the scheduler thread", RuntimeError("first"))
        stop.fail("a receive loop", RuntimeError("second"))
        await asyncio.wait_for(stop.event.wait(), GUARD_S)
        return stop, seen
    with caplog.at_level(logging.ERROR, logger="kvtransfer"):
        stop, seen = asyncio.run(scenario())
    assert stop.fatal == "the scheduler thread died: RuntimeError: first"
    assert seen == [stop.fatal] and stop.signal == ""
    assert sum("died" in r.getMessage() for r in caplog.records) == 1


def test_the_first_signal_names_the_stop():
    """Caught: `if not self.event.is_set()` dropped (a second Ctrl-C renames the stop the log line reports)."""
    async def scenario():
        stop = Stop()
        stop._on(signal.SIGTERM)
        stop._on(signal.SIGINT)
        return stop
    stop = asyncio.run(scenario())
    assert stop.event.is_set() and stop.signal == "SIGTERM"


def test_wait_or_says_whether_the_work_ended_or_a_stop_came():
    """Caught: `wait_or` answering False when its work ended (the server then shuts down as if signalled)."""
    async def scenario():
        stop = Stop()
        ended = await asyncio.wait_for(stop.wait_or(asyncio.sleep(0)), GUARD_S)
        stop._on(signal.SIGTERM)
        stopped = await asyncio.wait_for(stop.wait_or(asyncio.Event().wait()), GUARD_S)
        return ended, stopped
    assert asyncio.run(scenario()) == (True, False)


def test_the_fatal_exit_code_is_the_documented_70():
    """Caught: EXIT_FATAL changed (test_supervision.py compares the exit against the constant itself); README and
    docs/errors.md tell operators the process exits 70."""
    assert EXIT_FATAL == 70
    for doc in ("README.md", os.path.join("docs", "errors.md")):
        assert "exits 70" in open(os.path.join(ROOT, doc)).read(), doc


# --- kvtransfer/rpc/main.py: the exit codes ---

class Exited(Exception):
    pass


def _run_main(monkeypatch, raise_):
    from kvtransfer.rpc import main, stacks

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    monkeypatch.setattr(stacks, "enable_stack_dumps", lambda: None)
    monkeypatch.setattr(main, "configure_logging", lambda level: None)
    loops = []
    new_loop = main.new_event_loop
    monkeypatch.setattr(main, "new_event_loop", lambda: loops.append(new_loop()) or loops[-1])
    config = SimpleNamespace(log_level="INFO", one_line=lambda: "test")

    async def serve(config):
        if raise_ is not None:
            raise raise_

    try:
        with pytest.raises(Exited) as e:
            main.run_main(None, [], "test", serve, logging.getLogger("kvtransfer.test"), parse=lambda argv: config)
    finally:
        asyncio.set_event_loop(None)
        for loop in loops:
            loop.close()
    return e.value.args[0]


@pytest.mark.parametrize("raise_, code", [(None, 0), (KeyboardInterrupt(), 0), (ValueError("bad port"), 2),
                                          (FatalStop("x died"), EXIT_FATAL)])
def test_run_main_exits_0_after_a_stop_2_on_a_bad_setting_and_70_after_a_failure(monkeypatch, raise_, code):
    """Caught: a Ctrl-C before the loop's handler exiting non-zero; a setting that only shows at start-up exiting 1
    (README: a bad flag exits 2); a FatalStop exiting 0 (a supervisor would not restart a dead engine)."""
    assert _run_main(monkeypatch, raise_) == code


# --- kvtransfer/rpc/device_thread.py ---

def test_the_device_executor_is_one_thread_and_runs_on_a_cpu_device():
    """Caught: two workers (requests no longer serialized on the device); the CUDA initializer run for a CPU device
    (every job then fails: BrokenThreadPool)."""
    import threading

    import torch

    from kvtransfer.rpc.device_thread import gpu_executor
    ex = gpu_executor(torch.device("cpu"), "kvt-test-gpu")
    try:
        assert ex._max_workers == 1
        names = {ex.submit(lambda: threading.current_thread().name).result(timeout=GUARD_S) for _ in range(4)}
        assert len(names) == 1 and names.pop().startswith("kvt-test-gpu")
    finally:
        ex.shutdown(wait=True)


# --- kvtransfer/rpc/metrics.py ---

def test_a_transfer_records_its_bytes_milliseconds_and_gigabytes_per_second():
    """Caught: `kvt_transfer_ms` observed in seconds; `kvt_transfer_gbps` in MB/s."""
    m = Metrics("prefill")
    m.moved(2_000_000_000, 0.5, "layer")
    assert sample(m, "kvt_transfer_bytes_total") == 2e9
    assert sample(m, "kvt_transfer_ms_sum", mode="layer") == pytest.approx(500.0)
    assert sample(m, "kvt_transfer_ms_bucket", mode="layer", le="200.0") == 0
    assert sample(m, "kvt_transfer_gbps") == pytest.approx(4.0)


def test_a_step_counts_a_mixed_step_only_when_it_carried_prompt_rows():
    """Caught: `if stats.prompt_rows` -> `if stats.rows` (every decode step counted as a mixed one)."""
    m = Metrics("decode")
    m.stepped(SimpleNamespace(rows=8, prompt_rows=0, step_rows=8, device_s=0.01, staging_s=0.0))
    m.stepped(SimpleNamespace(rows=24, prompt_rows=16, step_rows=32, device_s=0.02, staging_s=0.0))
    assert sample(m, "kvt_decode_mixed_steps_total", rows="8") == 0
    assert sample(m, "kvt_decode_mixed_steps_total", rows="32") == 1
    assert sample(m, "kvt_decode_prompt_rows_total") == 16
    assert sample(m, "kvt_decode_batch_size_count") == 2
    assert sample(m, "kvt_decode_device_seconds_total") == pytest.approx(0.03)


def test_requests_are_counted_by_their_outcome_and_peer_up_leaves_only_a_colocated_server():
    """Caught: `finished` labelling every outcome OK; `export_peer_up(True)` unregistering the pair's gauge."""
    m = Metrics("decode")
    m.finished("UNAVAILABLE")
    assert sample(m, "kvt_requests_total", outcome="UNAVAILABLE") == 1
    assert sample(m, "kvt_requests_total", outcome="OK") == 0
    m.export_peer_up(True)
    assert m.registry.get_sample_value("kvt_peer_up") == 0.0
    m.export_peer_up(False)
    assert m.registry.get_sample_value("kvt_peer_up") is None


def test_the_metrics_port_ends_at_65535():
    """Caught: the port check's bound off by one (65536 passed to the HTTP server, which fails later)."""
    check_metrics_flags(65535, "127.0.0.1")
    check_metrics_flags(0, "127.0.0.1")
    for port in (65536, -1):
        with pytest.raises(ValueError, match="--metrics-port"):
            check_metrics_flags(port, "127.0.0.1")


# --- decode_server/reports.py ---

class FakePool:
    slots, blocks, page, max_seq = 8, 100, 16, 4096

    def used(self):
        return 3

    def free_blocks(self):
        return 40

    def shared_blocks(self):
        return 2


def _engine():
    return SimpleNamespace(pool=FakePool(), cache=None,
                           scheduler=SimpleNamespace(active=lambda: 2, prompts_queued=lambda: 1))


def test_load_counts_decoding_requests_their_tokens_and_waiting_prompts():
    """Caught: a finished sequence (`seq.over`) still counted running; a negative `remaining` not clamped at 0;
    `free_slots` ignoring the slots in use; `waiting_tokens` counting requests instead of prompt tokens."""
    from decode_server.reports import load_response
    seq = lambda length, remaining, over=False: SimpleNamespace(length=length, remaining=remaining, over=over)  # noqa
    reqs = [SimpleNamespace(seq=seq(100, 20), prompt_tokens=80),
            SimpleNamespace(seq=seq(50, -3), prompt_tokens=40),
            SimpleNamespace(seq=seq(70, 0, over=True), prompt_tokens=0),
            SimpleNamespace(seq=None, prompt_tokens=30),
            SimpleNamespace(seq=None, prompt_tokens=0)]
    out = load_response(reqs, _engine(), serving=True, queued=1, preemptions=4)
    assert (out.running_requests, out.running_tokens, out.remaining_tokens) == (2, 150, 20)
    assert (out.waiting_requests, out.waiting_tokens) == (1, 30)
    assert (out.free_slots, out.free_blocks, out.shared_blocks, out.cached_slots) == (5, 40, 2, 0)
    assert out.serving and out.queued_requests == 1 and out.preemptions == 4


def test_the_live_gauges_read_their_own_figures():
    """Caught: `kvt_waiting_requests` reading the requests in flight instead of those waiting for KV memory."""
    from decode_server.reports import watch_gauges
    m = Metrics("decode")
    watch_gauges(m, _engine(), None, lambda: 7, lambda: 3)
    assert sample(m, "kvt_inflight_requests") == 7
    assert sample(m, "kvt_waiting_requests") == 3
    assert sample(m, "kvt_kv_pool_slots_used") == 3
    assert sample(m, "kvt_kv_pool_free_blocks") == 40
    assert sample(m, "kvt_decode_running") == 2


# --- api_server/shutdown.py ---

def _cut_off(stopping_set: bool, messages, cancel=True):
    """Run CutOffAtShutdown over an app that sends `messages`, then is cancelled; returns what reached the client
    and the exception that left the middleware."""
    from api_server.shutdown import CutOffAtShutdown

    async def app(scope, receive, send):
        for m in messages:
            await send(m)
        raise asyncio.CancelledError()

    async def scenario():
        stopping = asyncio.Event()
        if stopping_set:
            stopping.set()
        sent = []

        async def send(m):
            sent.append(m)

        async def receive():
            return {"type": "http.disconnect"}

        try:
            await CutOffAtShutdown(app, stopping)({"type": "http", "method": "POST", "path": "/"}, receive, send)
            return sent, None
        except asyncio.CancelledError as e:
            return sent, e
    return asyncio.run(scenario())


SSE_START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def test_a_stream_cut_off_at_shutdown_ends_with_an_error_event_and_done():
    """Caught: `elif state["sse"]` negated (a stream under way ends without its error event); `data: [DONE]` dropped."""
    chunk = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
    sent, error = _cut_off(True, [SSE_START, chunk])
    assert error is None
    last = sent[-1]
    assert last["type"] == "http.response.body" and not last.get("more_body", False)
    assert b'"shutting_down"' in last["body"] and last["body"].endswith(b"data: [DONE]\n\n"), last


def test_a_request_that_already_ended_is_not_answered_twice():
    """Caught: `or state["ended"]` dropped (an answer already sent whole gets a second response after it)."""
    body = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    sent, error = _cut_off(True, [SSE_START, body])
    assert isinstance(error, asyncio.CancelledError) and sent == [SSE_START, body]


def test_nothing_sent_yet_is_answered_503_and_no_shutdown_passes_the_cancellation_on():
    sent, error = _cut_off(True, [])
    assert error is None and sent[0]["status"] == 503 and b"shutting_down" in sent[1]["body"]
    sent, error = _cut_off(False, [])
    assert isinstance(error, asyncio.CancelledError) and sent == []


def test_stopping_is_set_before_uvicorn_begins_its_shutdown(monkeypatch):
    """Caught: `self.stopping.set()` dropped from `Stopping.shutdown` (every cut-off request then gets uvicorn's
    text/plain 500 or a stream cut mid-token)."""
    import uvicorn

    from api_server.shutdown import Stopping
    seen = []

    async def base_shutdown(self, sockets=None):
        seen.append(self.stopping.is_set())

    monkeypatch.setattr(uvicorn.Server, "shutdown", base_shutdown)

    async def scenario():
        server = Stopping(uvicorn.Config(lambda scope, receive, send: None))
        await server.shutdown()
        return server
    server = asyncio.run(scenario())
    assert seen == [True] and server.stopping.is_set()
