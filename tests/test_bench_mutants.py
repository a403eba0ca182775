"""Cases a mutation pass over the benchmarks' arithmetic (bench/measure/: stats, roofline, serve figures and the
server-metrics reading; the decode bench's floor and ratios; the ttft bench's overhead against colocated) found
untested: each test here failed on a one-line change of that code that the other tests let through.

Why these figures: a bench's report decides whether a performance issue is met, and a wrong figure in it reads
like a right one. The whole-process tests (test_bench_serve.py, test_bench_decode.py, test_bench_ttft.py) check
that the figures are there and roughly sane (positive, ordered, equal to the formula applied to the figures
beside them); they cannot see ITL counting the first token's wait, TPOT over every token, a busy share in ms, a
warm-up run in a median or a floor in GiB/s. So every case here feeds small hand-made inputs (request records,
/metrics series, timings) to the code that turns them into the report, and checks exact numbers worked out by hand
in its comments. No timing is measured: every clock is a stand-in, so each case runs the same way every time.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from bench.measure import roofline
from bench.measure.serve_figures import by_length
from bench.report.decode import finish_cell, targets
from bench.runs.serve_config import ServeConfig
from bench.runs.serve_load import serve_result
from kvtransfer.engine.queued import StepStats
from kvtransfer.rpc.metrics import Metrics

# --- the timer every bench shares (bench/measure/stats.py) ---


def test_timed_keeps_the_runs_after_the_warm_up_and_only_those(monkeypatch):
    """kills timed() keeping the last warm-up call's time in place of the last timed one (the count stays right,
    so the length check of test_bench_stats.py passes). The clock is a stand-in: call i takes i + 1 s."""
    import bench.measure.stats as stats

    seconds = iter([1.0, 2.0, 3.0, 4.0, 5.0])
    monkeypatch.setattr(stats, "clock", lambda fn, devices: (next(seconds), fn()))
    assert stats.timed(lambda: None, runs=3, warmup=2) == [3.0, 4.0, 5.0]
    assert stats.timed(lambda: None, runs=0, warmup=0) == []


# --- the serve bench's latency and throughput keys (bench/runs/serve_load.py, bench/measure/serve_figures.py) ---


def _record(start: float, times: list[float], code: str | None = None, input_len: int = 8) -> dict:
    """One request's record as the doors write it: token arrival times in s after its own send."""
    return {"input_len": input_len, "start": start, "times": times, "code": code, "error": "", "mode": "colocated"}


def _cfg(**kw) -> ServeConfig:
    return ServeConfig(**{"addr": "127.0.0.1:1", "num_prompts": 3, "input_len": 8, "output_len": 4,
                          "vocab_size": 100, **kw})


# Two requests of 4 tokens each (times in eighths and sixteenths of a second: exact in binary) and one that
# failed after 1 token, over a 2 s run.
A = [0.125, 0.375, 0.5, 0.75]  # ttft 125 ms; gaps 250, 125, 250 ms; e2el 750 ms
B = [0.25, 0.3125, 0.5625, 0.625]  # ttft 250 ms; gaps 62.5, 250, 62.5 ms; e2el 625 ms
RECORDS = [_record(0.0, A), _record(0.0, B), _record(0.0, [0.125], code="CANCELLED")]


def test_itl_is_every_gap_between_two_tokens_and_never_the_wait_for_the_first():
    """kills ITL including the first token's gap (zip([0.0] + times, times): TTFT counted as an inter-token gap)."""
    r = serve_result(_cfg(), [[1] * 8] * 3, RECORDS, 2.0, [])
    # gaps: 250, 125, 250, 62.5, 250, 62.5 ms -> sorted 62.5, 62.5, 125, 250, 250, 250
    assert r["mean_itl_ms"] == pytest.approx(1000.0 / 6)
    assert r["median_itl_ms"] == pytest.approx((125 + 250) / 2)
    assert r["p90_itl_ms"] == pytest.approx(250.0)


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    """kills TPOT dividing by every token instead of tokens - 1, and TPOT counting the wait for the first token."""
    r = serve_result(_cfg(), [[1] * 8] * 3, RECORDS, 2.0, [])
    # A: (750 - 125) / 3 = 208.33 ms; B: (625 - 250) / 3 = 125 ms (over 4: 156.25 and 93.75; from 0: 250, 208.33)
    assert r["mean_tpot_ms"] == pytest.approx((625 / 3 + 125) / 2)
    assert r["median_tpot_ms"] == pytest.approx((625 / 3 + 125) / 2)


def test_e2el_runs_from_the_send_to_the_last_token_and_ttft_to_the_first():
    """kills E2EL measured from the first token (times[-1] - times[0]) instead of from the send."""
    r = serve_result(_cfg(), [[1] * 8] * 3, RECORDS, 2.0, [])
    assert r["mean_e2el_ms"] == pytest.approx((750 + 625) / 2)
    assert r["mean_ttft_ms"] == pytest.approx((125 + 250) / 2)


def test_throughputs_count_only_completed_requests_and_output_only_counts_output():
    """kills output_throughput over input + output tokens, output tokens counted from failed requests too, and
    request_throughput counting sent instead of completed requests."""
    r = serve_result(_cfg(), [[1] * 8] * 3, RECORDS, 2.0, [])
    assert (r["completed"], r["failed"], r["total_output_tokens"], r["total_input_tokens"]) == (2, 1, 8, 16)
    assert r["output_throughput"] == 4.0  # 8 tokens of the 2 completed requests / 2 s (not 9 / 2, not 24 / 2)
    assert r["request_throughput"] == 1.0  # 2 completed / 2 s (3 sent)
    assert r["total_token_throughput"] == 12.0  # (16 + 8) / 2 s


def test_latencies_are_reported_in_milliseconds():
    """kills the summary's scale slipping from s -> ms to none (a 125 ms TTFT reported as 0.125)."""
    r = serve_result(_cfg(), [[1] * 8] * 3, RECORDS[:1], 1.0, [])
    assert (r["median_ttft_ms"], r["median_e2el_ms"], r["p99_ttft_ms"]) == (125.0, 750.0, 125.0)


def test_a_run_paced_by_a_request_rate_has_no_sustained_figure():
    """kills `sustained` computed for a run with a finite --request-rate (its window assumes every client re-sends
    at once on a completion, which Poisson arrivals do not)."""
    sent = [_record(0.0, [1.0, 2.0]), _record(0.0, [1.5, 2.0]), _record(2.5, [0.5, 1.0]), _record(3.5, [0.2])]
    closed = serve_result(_cfg(num_prompts=4, concurrency=2), [[1] * 8] * 4, sent, 4.0, [])
    assert closed["sustained_output_throughput"] == pytest.approx(1.0)  # r2's 3.0 in [2.5, 3.5): 1 token / 1 s
    paced = serve_result(_cfg(num_prompts=4, concurrency=2, request_rate=10.0), [[1] * 8] * 4, sent, 4.0, [])
    assert paced["sustained_output_throughput"] is None and paced["sustained_window_s"] is None


def test_a_prompt_exactly_at_the_long_length_counts_as_long():
    """kills by_length's split putting a prompt of exactly long_from tokens among the short ones (< vs <=)."""
    done = [_record(0.0, [0.25, 0.5], input_len=15), _record(0.0, [1.0, 1.5], input_len=16)]
    split = by_length(done, 16)
    assert (split["short"]["completed"], split["long"]["completed"]) == (1, 1)
    assert (split["short"]["median_ttft_ms"], split["long"]["median_ttft_ms"]) == (250.0, 1000.0)


# --- the server's figures over a run (bench/measure/serve_metrics.py) ---


def _watch(monkeypatch, m: Metrics, clock=None):
    import bench.measure.serve_metrics as sm
    from prometheus_client import generate_latest

    monkeypatch.setattr(sm, "scrape", lambda url: sm.parse(generate_latest(m.registry).decode()))
    if clock is not None:
        monkeypatch.setattr(sm.time, "perf_counter", lambda: next(clock))
    return sm.BatchWatch("http://unused")


def test_the_runs_prompt_rows_mixed_steps_and_prefills_are_counted_from_the_restart(monkeypatch):
    """kills prompt_rows_in_steps, mixed_steps_by_rows and the local prefill count read as the server's totals
    instead of the run's deltas (the warm-up's prompt rows and prefills in the run's figures)."""
    m = Metrics("decode")
    watch = _watch(monkeypatch, m)
    m.stepped(StepStats(rows=1, prompt_rows=100, step_rows=256, device_s=0.0))  # the warm-up's
    m.prefill_ms.labels(mode="colocated").observe(1000.0)
    watch.restart()
    m.stepped(StepStats(rows=4, prompt_rows=30, step_rows=256, device_s=0.0))
    m.stepped(StepStats(rows=4, prompt_rows=10, step_rows=64, device_s=0.0))
    m.prefill_ms.labels(mode="colocated").observe(20.0)
    m.prefill_ms.labels(mode="colocated").observe(40.0)
    r = watch.report()
    assert (r["steps"], r["mean_batch_per_step"], r["prompt_rows_in_steps"]) == (2, 4.0, 40)
    assert r["mixed_steps_by_rows"] == {"64": 1, "256": 1}  # the warm-up's 256-row step is not the run's
    assert (r["local_prefills"], r["local_prefill_ms_mean"]) == (2, 30.0)  # (20 + 40) / 2, not 1060 / 3


def test_the_local_prefill_mean_sums_every_mode_label(monkeypatch):
    """kills parse() keeping one label's series of kvt_prefill_ms (max instead of sum over the mode label)."""
    m = Metrics("decode")
    watch = _watch(monkeypatch, m)
    m.prefill_ms.labels(mode="colocated").observe(10.0)
    m.prefill_ms.labels(mode="colocated").observe(20.0)
    m.prefill_ms.labels(mode="recompute").observe(90.0)
    r = watch.report()
    assert (r["local_prefills"], r["local_prefill_ms_mean"]) == (3, 40.0)  # (10 + 20 + 90) / 3


def test_running_is_the_median_of_the_samples_and_the_pool_its_extremes(monkeypatch):
    """kills running_p50 read as the mean of the samples, and free_blocks_min read as their max."""
    watch = _watch(monkeypatch, Metrics("decode"))
    watch.samples = [(0.0, 1.0), (0.1, 1.0), (0.2, 7.0)]
    watch.pool = [(0.0, 10.0), (2.0, 3.0), (1.0, 6.0)]  # (shared, free) blocks
    r = watch.report()
    assert (r["running_p50"], r["running_max"]) == (1.0, 7.0)  # the mean would be 3
    assert (r["shared_blocks_max"], r["free_blocks_min"]) == (2.0, 3.0)


def test_the_busy_share_is_device_seconds_over_wall_seconds(monkeypatch):
    """kills the busy share with a unit slip (device s over wall ms)."""
    m = Metrics("decode")
    watch = _watch(monkeypatch, m, clock=iter([10.0, 14.0]))
    m.stepped(StepStats(rows=2, prompt_rows=0, step_rows=0, device_s=1.0))
    assert watch.report()["device_busy"] == 0.25  # 1 s of steps in 4 s


# --- the compute roofline's GEMM rate (bench/measure/roofline.py) ---


def test_the_gemm_rate_is_each_shapes_flops_over_its_time_and_the_layer_rate_their_sums(monkeypatch):
    """kills a GEMM's rate counting a multiply-add as 1 FLOP (rows x n x k), and the layer rate taken as the mean of
    the four shapes' rates instead of their summed FLOPs over their summed time. CUDA stands in: the shapes' times
    are given, the GEMMs run on the CPU."""
    import bench.measure.timing as timing

    dims = roofline.Dims(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, layers=2, vocab=32)
    # (n, k): qkv (8 + 2 x 4, 8), o (8, 8), gate_up (32, 8), down (8, 16), lm_head (32, 8); at 4 rows, 2 x 4 x n x k
    # FLOPs: 1024, 512, 2048, 1024 and 2048
    us = iter([1.0, 1.0, 2.0, 4.0, 0.5])
    randn = torch.randn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "stand-in")
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None, dtype=None: randn(*shape, dtype=dtype))
    monkeypatch.setattr(timing, "loop_us", lambda fn, calls, reps: (fn(), next(us))[1])
    m = roofline.measure_gemm(dims, "cuda", rows=4)
    assert {k: (s["n"], s["k"]) for k, s in m["shapes"].items()} == {
        "qkv": (16, 8), "o": (8, 8), "gate_up": (32, 8), "down": (8, 16), "lm_head": (32, 8)}
    assert m["shapes"]["qkv"]["tflops"] == pytest.approx(1024 / 1e-6 / 1e12)  # 1.024e-3
    assert m["shapes"]["down"]["tflops"] == pytest.approx(1024 / 4e-6 / 1e12)  # 0.256e-3
    # (1024 + 512 + 2048 + 1024) FLOPs in (1 + 1 + 2 + 4) us = 0.576e-3 TFLOP/s; the shapes' mean rate is 0.704e-3
    assert m["layer_tflops"] == pytest.approx(4608 / 8e-6 / 1e12)
    assert m["lm_head_tflops"] == pytest.approx(2048 / 0.5e-6 / 1e12)


def test_the_roofline_of_a_stop_after_run_prices_the_tokens_the_requests_made():
    """A bug this pass found (fixed with it): with_roofline passed cfg.output_len (4 here) to run_figures, while
    --stop-after 2,2 ends every request after 2 tokens (output_lens [2, 2] in the result). A request of 8 + 2 tokens
    has its prompt's FLOPs spread over 2 tokens, not 4: the honest roofline is run_figures(..., [8, 8], 2, ...), and
    of_roofline is the measured tok/s over it."""
    from bench.runs.serve_roofline import RooflinePlan, with_roofline

    dims = roofline.Dims(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, layers=2, vocab=32)
    rates = {"on": True, "layer_tflops": 1.0, "lm_head_tflops": 1.0}
    cfg = _cfg(num_prompts=2, concurrency=2, stop_after=(2, 2))
    r = {"output_throughput": 100.0, "input_lens": [8, 8], "output_lens": [2, 2], "failures": [], "ok": True}
    got = with_roofline(r, cfg, RooflinePlan(dims, "cuda", "", True), rates)
    want = roofline.run_figures(rates, dims, [8, 8], 2, 100.0)
    assert got["roofline_output_tok_s"] == pytest.approx(want["roofline_output_tok_s"])


# --- the decode bench's floor, ratios and targets (bench/report/decode.py, bench/runs/decode.py) ---


def test_the_floor_throughput_is_every_rows_token_in_one_floor_step():
    """kills floor_tok_s counting one token per step (1 / floor) instead of one per row (batch / floor)."""
    # floor = (1e9 + 4 x 1000 x 25000) B / 100 GB/s = 11 ms; 4 tokens in 11 ms = 363.6 tok/s
    c = finish_cell({"batch": 4, "context": 1000, "step_ms_p50": 22.0}, 10**9, 25_000, 100.0)
    assert c["floor_ms"] == pytest.approx(11.0)
    assert c["floor_tok_s"] == pytest.approx(4 / 0.011)
    assert (c["tok_s"], c["share_of_floor_throughput"]) == (pytest.approx(4 / 0.022), pytest.approx(0.5))


def test_the_back_to_back_ratio_prices_the_back_to_back_step():
    """kills ratio_back_to_back computed from the single step's time instead of the back-to-back one."""
    c = finish_cell({"batch": 1, "context": 1000, "step_ms_p50": 22.0, "step_ms_back_to_back_p50": 13.2},
                    10**9, 25_000, 100.0)  # floor 10.25 ms
    assert c["ratio"] == pytest.approx(22.0 / 10.25) and c["ratio_back_to_back"] == pytest.approx(13.2 / 10.25)


def test_the_batch_64_target_is_the_share_of_the_floor_throughput():
    """kills the batch-64 target read off the step/floor ratio instead of the share of the floor throughput."""
    # floor = (1e9 + 64 x 1024 x 1000) / 100e9 s = 10.655 ms; a 40 ms step: share 0.266 (ratio 3.75)
    slow = finish_cell({"batch": 64, "context": 1024, "step_ms_p50": 40.0}, 10**9, 1000, 100.0)
    assert slow["share_of_floor_throughput"] == pytest.approx(10.65536 / 40.0)
    assert targets([slow]) == {"batch64_1k_share_of_floor_ge_0.6": False}


def test_the_bandwidth_counts_the_copys_bytes_read_and_written(monkeypatch):
    """kills the device bandwidth counting the copy's bytes once (read only) instead of read + written."""
    import bench.measure.decode_measure as dm

    monkeypatch.setattr(dm, "time_calls", lambda fn, device, runs, warmup: {"p50": 1.0, "p10": 1.0, "p90": 1.0})
    gbps, n = dm.bandwidth_gbps(torch.device("cpu"))
    assert n == 64 << 20 and gbps == pytest.approx(2 * (64 << 20) / 1e-3 / 1e9)  # 134.2 GB/s for 1 ms


class _LM(torch.nn.Module):
    """An embedding (10 x 4), one 4 x 4 layer and an lm_head (10 x 4), float32; `tied`: lm_head is the embedding."""

    def __init__(self, tied: bool):
        super().__init__()
        self.emb, self.layer = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head


def test_a_step_reads_every_weight_once_and_the_embedding_only_when_it_is_lm_head():
    """kills weights_read counting the embedding table when it is not tied (a step reads B rows of it), and
    leaving it out when it is tied (then lm_head reads it whole)."""
    from bench.runs.decode import weights_read

    assert weights_read(_LM(tied=False)) == (16 + 40) * 4  # layer + lm_head, float32
    assert weights_read(_LM(tied=True)) == (40 + 16) * 4  # the shared table once + layer


def test_a_cells_back_to_back_time_is_per_step(monkeypatch, tiny_fp32):
    """kills step_ms_back_to_back_p50 reported as the time of the whole chain of BACK_TO_BACK steps. The timer is
    a stand-in (every call 30 ms); the engine's step itself runs, on the CPU."""
    import bench.runs.decode as dec
    from bench.measure.decode_measure import Grid
    from kvtransfer.geometry import CacheGeometry

    def time_calls(fn, device, runs, warmup, reset=None):
        fn()
        return {"p50": 30.0, "p10": 20.0, "p90": 40.0, "runs": runs}
    monkeypatch.setattr(dec, "time_calls", time_calls)
    cfg = dec.DecodeBenchConfig("tiny", "float32", "cpu", batches=(1,), contexts=(16,), runs=2, warmup=0,
                                cuda_graphs=False, hf=())
    grid = Grid(torch.device("cpu"), lambda _: None)
    dec.engine_context(tiny_fp32, CacheGeometry.from_config(tiny_fp32.config, torch.float32), 16, [1], cfg, grid, [])
    assert grid.failures == []
    cell = grid.cells[(1, 16)]
    assert (cell["step_ms_p50"], cell["step_ms_back_to_back_p50"]) == (30.0, 30.0 / dec.BACK_TO_BACK)


# --- the ttft bench's overhead against colocated (bench/runs/ttft.py) ---


def test_ttft_overhead_is_the_medians_of_the_timed_runs_against_colocated(monkeypatch):
    """kills the overhead read off the disaggregated first_token_ms instead of cache_ready_ms, its % taken of the
    disaggregated TTFT instead of the colocated one, the colocated TTFT as a mean instead of a median, the warm-up
    calls kept in place of timed ones, the prefill slowdown inverted, and the spread's ms scaled by 1e3 again.
    The servers are stand-ins: each call's timing is scripted (warm-up calls 1000 ms in every figure)."""
    from bench.runs import ttft

    @contextlib.contextmanager
    def server(*args, **kwargs):
        yield types.SimpleNamespace(addr="unused")

    timed = {  # per mode, the 3 timed calls after the 2 warm-up ones
        "colocated": [dict(first_token_ms=f, cache_ready_ms=f, prefill_ms=8.0, second_token_ms=2.0)
                      for f in (10.0, 12.0, 30.0)],
        "layerwise": [dict(first_token_ms=14.0, cache_ready_ms=c, prefill_ms=10.0, second_token_ms=3.0)
                      for c in (15.0, 16.0, 18.0)]}
    calls: dict[str, int] = {}

    async def generate(addr, ids, n, mode="auto", **kw):
        i = calls[mode] = calls.get(mode, -1) + 1
        timing = (dict.fromkeys(("first_token_ms", "cache_ready_ms", "prefill_ms", "second_token_ms"), 1000.0)
                  if i < 2 else timed[mode][i - 2])
        return {"tokens": [1, 2], "timing": timing, "logits_digests": [], "cache_digest": ""}

    monkeypatch.setattr(ttft, "colocated_server", server)
    monkeypatch.setattr(ttft, "server_pair", server)
    monkeypatch.setattr(ttft, "generate", generate)
    monkeypatch.setattr(ttft, "raw_links", lambda cfg, geom: {})
    cfg = ttft.TtftConfig(lengths=(8,), modes=("layerwise",), runs=3, warmup=2, decode_tokens=2, verify=False)
    (row,) = ttft.run_ttft(cfg)["rows"]
    assert calls == {"colocated": 4, "layerwise": 4}  # 5 calls each, counted from 0
    assert row["ttft_colo"] == {"median_ms": 12.0, "min_ms": 10.0, "max_ms": 30.0, "n": 3}
    assert row["ttft_disagg"] == {"median_ms": 16.0, "min_ms": 15.0, "max_ms": 18.0, "n": 3}
    assert row["overhead_ms"] == 4.0  # 16 - 12 (the mean colocated TTFT is 17.3; disagg first_token_ms 14)
    assert row["overhead_pct"] == pytest.approx(100 * 4 / 12)  # of the colocated TTFT, not of 16
    assert row["prefill_slowdown_pct"] == pytest.approx(25.0)  # 10 / 8 - 1 (inverted: -20)
    assert row["tokens_equal_timed"] is True


def test_a_run_whose_requests_made_different_token_counts_is_priced_request_by_request():
    """run_figures over each request's own (prompt, output) lengths: the mean request's output tokens in the mean
    request's time, i.e. all their tokens over all their FLOPs' time (kills pricing every request at the first
    one's output length, and the mean of per-request rooflines); lengths that do not pair up are refused."""
    dims = roofline.Dims(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, layers=2, vocab=32)
    rates = {"on": True, "layer_tflops": 1.0, "lm_head_tflops": 2.0}
    a, b = roofline.request_flops(dims, 8, 2), roofline.request_flops(dims, 5, 6)
    seconds = sum((f["layers"] + f["attention"]) / 1e12 + f["lm_head"] / 2e12 for f in (a, b))
    got = roofline.run_figures(rates, dims, [8, 5], [2, 6], 10.0)
    assert got["roofline_output_tok_s"] == pytest.approx((2 + 6) / seconds)
    assert got["of_roofline"] == pytest.approx(10.0 / ((2 + 6) / seconds))
    with pytest.raises(ValueError):
        roofline.run_figures(rates, dims, [8, 5], [2], 10.0)
