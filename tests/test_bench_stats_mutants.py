"""Cases a mutation pass over the benchmarks' own arithmetic that no earlier pass covered found untested: the
interference bench's figures (bench/measure/interference_stats.py: gaps, windows, stall, goodput, the timeline),
serve --multi-turn's figures and conversations (multiturn_stats.py, conversations.py), the pool record of serve
--memory-pressure (pool_report.py), the two doors' records (serve_doors.py, openai_stream.py) and the router's skew
figures (router_skew.py); its tiers and xPyD launcher half is tests/test_launch_tiers_mutants.py. Each test here
failed on a one-line change of that code that test_bench_interference.py, test_bench_multiturn.py,
test_bench_pressure.py, test_bench_serve.py, test_bench_invariance.py, test_bench_mutants.py and test_router.py's
skew test let through; its docstring names the change it kills ("kills ..."), and each was seen failing with that
change planted and passing on the clean code.

Of 83 planted changes in the pass (here: interference_stats 20, multiturn_stats 14, conversations 8, pool_report 8,
serve_doors 5, openai_stream 5, router_skew 7; tiers 6 and launch_xpyd 10 in the other file), 41 were caught
already, 40 only by these two files, and 2 are equivalent: the SSE payload read from `line[6:]` instead of
`line[5:]` (every front this bench meets writes `data: ` with its space, which the strip drops either way) and the
launcher's child environment merged the other way round (a child's own env holds only NCCL_NVLS_ENABLE, copied
from the launcher's environment or "0" where that has none). None is left. Of this file's 67, 37 were caught
before and 29 only here.

Why these: every figure the interference, multi-turn, memory-pressure and router-skew results publish is one of
these functions applied to client times and server counters. The benches' own tests run them end to end on a stand-in
or tiny server, where one window, one tier per cell, every turn completed, a concurrency equal to the prompts and
one token per SSE chunk make a stall read as the smallest ITL, a median read as the first turn, reused tokens
counted over turn 1, or a load over the pool sized by every prompt read exactly as the right figure. Here each is
one call on hand-made records whose figures are worked out in the comments (times in binary fractions, so exact),
with stand-in stubs, sessions and clocks: nothing is timed, and the file runs in well under a second.
"""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest

from bench.measure import conversations, multiturn_stats, openai_stream, pool_report, router_skew, serve_doors
from bench.measure import interference_stats as st
from proto import kvtransfer_pb2 as pb

# --- the interference bench's figures (bench/measure/interference_stats.py) ---


def test_a_gap_overlapping_any_one_window_is_not_outside():
    """kills outside() keeping a gap that overlaps some window but not all of them (`not all` for `not any`): with
    one window, as in the bench's other tests, the two read the same."""
    gaps = [(0.0, 1.0), (2.0, 3.0), (4.0, 5.0)]
    assert st.outside(gaps, [(0.5, 0.75), (4.5, 4.75)]) == [(2.0, 3.0)]


def test_the_window_p99_is_the_99th_percentile():
    """kills itl_p99_in_window_ms as the 90th percentile. Window [0, 1] s; inside, ITLs of 0 and 500 ms, so the
    p99 is 0 + 0.99 x 500 = 495 ms (the p90 450); outside, gaps of 125 and 62.5 ms. Also kills the largest ITL
    outside read as the smallest."""
    out = [(2.0, 2.125), (3.0, 3.0625)]
    f = st.arrival_figures([(0.25, 0.25), (0.25, 0.75), *out], (0.0, 1.0), out)
    assert f == {"ttft_ms": 1000.0, "stall_ms": 500.0, "gaps_in_window": 2,
                 "itl_p99_in_window_ms": pytest.approx(495.0), "itl_max_outside_ms": 125.0}


def test_the_timeline_bins_gaps_by_their_end_over_the_margins():
    """kills timeline() binning a gap by its start (`a - window[0]`), the last bin as `bins` (a gap ending at the
    edge plotted past it) and the left margin dropped (lo = 0). Window [0, 1] s, margin 1 s, 3 bins of 1 s over
    [-1, 2]: a gap ending at -1 (the left edge) goes in bin 0 (centre -0.5); gaps ending at 0.5 in bin 1 (the
    larger ITL kept); one ending at 2 (the right edge) in bin 2 (centre 1.5)."""
    gaps = [(-1.25, -1.0), (0.0, 0.5), (0.375, 0.5), (1.5, 2.0)]
    assert st.timeline(gaps, (0.0, 1.0), 1.0, bins=3) == {
        "t_s": [-0.5, 0.5, 1.5], "itl_ms": [250.0, 500.0, 500.0], "window_s": [0.0, 1.0], "bin_s": 1.0}


def test_a_long_prompt_is_judged_on_its_gaps_before_stop_and_sent_from_start():
    """kills arm_figures judging a long prompt's ITL on gaps after `stop` (the streams were cancelled: what comes
    after is not under the load measured) and `sent_s` counted from 0 instead of the measured start. Measured over
    [0.5, 2] s; the long prompt, sent at 1, has its first token at 1.5 and a 7 s gap after stop."""
    stream = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]  # measured gaps: (0.5, 1), (1, 1.5), (1.5, 2)
    long = {"kind": "single", "tokens": 64, "sent": 1.0, "times": [1.5, 1.625, 9.0]}
    f = st.arm_figures([stream], [long], start=0.5, stop=2.0, ttft_slo_ms=1000, itl_slo_ms=200, margin_s=0.5)
    (a,) = f["arrivals"]
    assert a["sent_s"] == 0.5 and a["ttft_ms"] == 500.0 and a["stall_ms"] == 500.0 and a["gaps_in_window"] == 1
    g = f["goodput_detail"]
    assert (g["streams_met_itl"], g["long_met_ttft"], g["long_met_itl"], g["long_met_both"]) == (0, 1, 1, 1)
    assert f["goodput"] == 0.5 and f["measured_s"] == 1.5


# --- serve --multi-turn: the figures (multiturn_stats.py) and the conversations (conversations.py) ---


def _turn(conv: int, turn: int, input_len: int, times: list[float], reused: int = 0, tier: str = "none",
          reload: float = 0.0, code: str | None = None) -> dict:
    return {"conversation": conv, "turn": turn, "input_len": input_len, "times": times, "reused_tokens": reused,
            "reuse_tier": tier, "reload_bytes": reload, "code": code, "error": "x" if code else "", "mode": "auto",
            "start": 10.0}


def test_the_reuse_figures_count_later_turns_only_and_reloads_per_host_hit():
    """kills pass_figures summing reused tokens over every turn (turn 1's reuse is a server still holding an earlier
    run), the prompt share over every turn's prompt tokens (or over prompt + output tokens), the reload mean per
    later turn or per hit of either tier instead of per host hit, and the request rate over failed requests too.
    Conversation 0: turn 1 reuses 32 (a leftover), turn 2 reloads 96 tokens (1000 bytes) from the host, turn 3 hits
    192 on the device; conversation 1's first turn fails. Over a 2 s pass: 3 completed."""
    records = [_turn(0, 1, 100, [0.25, 0.5], 32, "device"), _turn(0, 2, 200, [0.125, 0.25], 96, "host", 1000.0),
               _turn(0, 3, 300, [0.0625, 0.125], 192, "device"), _turn(1, 1, 100, [0.5], code="RESOURCE_EXHAUSTED")]
    p = multiturn_stats.pass_figures({"records": records, "duration": 2.0, "start": 10.0, "not_sent": 0,
                                      "abandoned": 2}, turns=3)
    assert p["reused_tokens"] == {"sum": 288, "mean_per_turn": 144.0, "share_of_prompt_tokens": 288 / 500}
    assert p["reload_bytes"] == {"sum": 1000.0, "mean_per_host_hit": 1000.0} and p["turn1_reused_tokens"] == 32
    assert p["request_throughput"] == 1.5 and p["output_throughput"] == 3.0 and p["failed"] == 1


def test_the_tier_and_length_cell_is_the_median_first_token_time():
    """kills by_tier_and_length taking a cell's first turn for its median, and a turn's last token time for its TTFT.
    Three device hits of < 1k tokens with first tokens at 500, 125 and 250 ms: median 250."""
    done = [_turn(0, 2, 900, [0.5, 0.75], tier="device"), _turn(1, 2, 10, [0.125, 1.0], tier="device"),
            _turn(2, 2, 1023, [0.25, 2.0], tier="device"), _turn(3, 2, 1024, [0.0625, 4.0], tier="tier_7")]
    assert multiturn_stats.by_tier_and_length(done) == {
        "device": {"<1k": {"count": 3, "median_ttft_ms": 250.0}}, "host": {}, "none": {},
        "tier_7": {"1-2k": {"count": 1, "median_ttft_ms": 62.5}}}


def _load(**kw) -> conversations.Load:
    return conversations.Load(**{"conversations": 2, "turns": 3, "first_len": (7, 7), "user_len": 2,
                                 "output_len": 2, "vocab_size": 50, "seed": (1,), "skip_prefix_cache": False, **kw})


def test_a_first_prompt_takes_its_length_from_the_whole_range():
    """kills first_prompt drawing from [lo, hi) instead of [lo, hi]: --input-len-range 0 (lo == hi) draws nothing."""
    assert len(conversations.first_prompt(np.random.default_rng(0), _load())) == 7


def test_a_conversation_past_its_deadline_counts_every_turn_not_sent(monkeypatch):
    """kills conversation() counting one turn too few as not sent (`turns - turn` for `turns - turn + 1`) and a turn
    given the whole --timeout-s instead of what is left of the pass. The clock is a stand-in at 0."""
    monkeypatch.setattr(conversations.time, "perf_counter", lambda: 0.0)
    sent = []

    async def send(ids, timeout):
        sent.append(timeout)
        return {"tokens": [1, 2], "code": None}
    assert asyncio.run(conversations.conversation(send, _load(), 0, -math.inf, lambda _: None)) == ([], 3, 0)
    recs, not_sent, abandoned = asyncio.run(conversations.conversation(send, _load(), 0, 5.0, lambda _: None))
    assert len(recs) == 3 and (not_sent, abandoned) == (0, 0) and sent == [5.0] * 3


def test_a_pass_sums_turns_not_sent_and_abandoned_apart(monkeypatch):
    """kills run_pass reporting the abandoned turns (after a failure) as not sent (the time budget)."""
    outs = {0: ([], 2, 1), 1: ([], 0, 3)}

    async def conversation(send, load, conv, deadline, step):
        return outs[conv]
    monkeypatch.setattr(conversations, "conversation", conversation)
    run = asyncio.run(conversations.run_pass(None, _load()))
    assert (run["not_sent"], run["abandoned"], run["records"]) == (2, 4, [])


# --- the pool record of serve --memory-pressure / --shared-prefix (pool_report.py) ---


def test_the_load_over_the_pool_is_what_the_concurrency_keeps_in_flight():
    """kills report() sizing the load by every prompt at once whatever --concurrency keeps in flight, and by
    --concurrency even where it is over the number of prompts. Prompts of 10, 20 and 30 tokens, 12 out: 32
    positions each at their end; a pool of 4 blocks x 16 = 64 positions."""
    about = pb.InfoResponse(kv_blocks=4, kv_block_tokens=16, max_batch=8)
    before, after = pb.LoadResponse(preemptions=2), pb.LoadResponse(preemptions=5, shared_blocks=1)
    done = [{"timing": pb.Timing(reused_tokens=n)} for n in (0, 16, 32)] + [{"timing": None}]
    prompts = [[1] * 10, [1] * 20, [1] * 30]
    for concurrency, load in ((2, 1.0), (8, 1.5), (None, 1.5)):
        cfg = SimpleNamespace(concurrency=concurrency, output_len=12, shared_prefix=0)
        r = pool_report.report(cfg, prompts, about, before, after, done)
        assert r["load_over_pool"] == load and r["tokens"] == 64 and r["preemptions"] == 3
        assert r["reused_tokens_mean"] == 16.0 and r["requests_reusing"] == 2


# --- the doors (serve_doors.py, openai_stream.py) ---


def test_any_127_address_is_loopback():
    """kills is_loopback_url taking only 127.0.0.x for loopback (all of 127.0.0.0/8 is)."""
    assert openai_stream.is_loopback_url("http://127.1.2.3:8000") and openai_stream.is_loopback_url("http://[::1]:80")
    assert not openai_stream.is_loopback_url("http://10.0.0.1:8000")


class _Call:
    """A Generate call that streams `n` tokens, the last with its Timing."""

    def __init__(self, n: int):
        self.n, self.cancelled = n, False

    async def _messages(self):
        for i in range(self.n):
            yield pb.GenerateResponse(token_id=5 + i, index=i, timing=pb.Timing() if i == self.n - 1 else None)

    def __aiter__(self):
        return self._messages()

    def cancel(self):
        self.cancelled = True


class _Stub:
    def __init__(self, n: int):
        self.call, self.requests = _Call(n), []

    def Generate(self, request, timeout, metadata):
        self.requests.append(request)
        return self.call


def test_a_whole_stream_is_not_cancelled_and_a_stop_after_one_is():
    """kills stream_record cancelling a stream that sent all its max_new_tokens (`want <= max_new_tokens`): the
    server would count a finished request as cancelled."""
    stub = _Stub(3)
    rec = asyncio.run(serve_doors.stream_record(stub, pb.GenerateRequest(token_ids=[1, 2], max_new_tokens=3), 5, None))
    assert rec["tokens"] == [5, 6, 7] and rec["code"] is None and not stub.call.cancelled
    stub = _Stub(3)
    rec = asyncio.run(serve_doors.stream_record(stub, pb.GenerateRequest(token_ids=[1], max_new_tokens=3), 5, None,
                                                stop_after=2))
    assert rec["tokens"] == [5, 6] and rec["code"] is None and stub.call.cancelled


class _Response:
    status = 200

    def __init__(self, lines: list[bytes]):
        self.content = self._lines(lines)

    @staticmethod
    async def _lines(lines):
        for line in lines:
            yield line

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class _Session:
    def __init__(self, lines: list[bytes]):
        self.lines = lines

    def post(self, url, json, headers, timeout):
        return _Response(self.lines)


def _sse(made: int) -> list[bytes]:
    """A stream of 3 tokens, two in one chunk (a character's bytes), whose usage says `made`."""
    return [b'data: {"choices": [{"text": "ab", "token_ids": [5, 6]}]}\n', b"\n",
            b'data: {"choices": [{"text": "c", "token_ids": [7]}]}\n',
            b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n' % made, b"data: [DONE]\n"]


def test_a_chunk_of_two_tokens_is_two_arrivals_and_usage_is_checked():
    """kills openai_stream counting one token per chunk whatever its token_ids, and a count that disagrees with the
    usage chunk let through when the stream's own count is right (`and` for `or`)."""
    rec = asyncio.run(openai_stream.one_request(_Session(_sse(3)), "http://x", "m", [1, 2], 3, 5, {}))
    assert len(rec["times"]) == 3 and rec["times"][0] == rec["times"][1] and rec["code"] is None
    rec = asyncio.run(openai_stream.one_request(_Session(_sse(2)), "http://x", "m", [1, 2], 3, 5, {}))
    assert rec["code"] == "INCOMPLETE" and "usage says 2" in rec["error"]


# --- the router's skew workload (router_skew.py) ---


def test_the_skew_load_puts_the_longs_at_even_positions():
    """kills skew_requests placing the long ones at odd positions or one long too many (`<=`)."""
    assert [n for _, n in router_skew.skew_requests(2, 3, 9, 1, prompt=2)] == [9, 1, 9, 1, 1]


def test_the_imbalance_figures_by_hand():
    """kills imbalance() counting idle samples (0 / 0), dividing by the sum instead of the mean, a ratio of exactly
    the tolerance counted out (`<`), and figures() reading the footprint as the running tokens alone. Ratios of the
    5 busy samples: 1, 0, 0, 0.25 (9 vs 7), 1."""
    samples = [[0, 0], [30, 10], [10, 10], [10, 10], [9, 7], [5, 15]]
    assert router_skew.imbalance(samples) == {"samples": 5, "median": 0.25, "mean": 0.45, "p90": 1.0,
                                              "within_tolerance": 0.6, "mean_tokens": [13, 10]}
    f = router_skew.figures([(0.0, [(10, 10), (10, 30)])])  # running 10 vs 10; footprint 20 vs 40
    assert f["running_tokens"]["median"] == 0.0 and f["footprint_tokens"]["median"] == pytest.approx(0.667)
