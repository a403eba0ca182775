"""The decode server's step metrics and the serve bench's reading of them (bench/serve_metrics.py).

Why: the serve bench's mean batch, prompt rows and device-busy share come from counters the
scheduler feeds once per delivered step; a step counted twice, a prompt-only step counted as a
batch of 0, or a busy share read off the wrong series would misreport the run.
"""

from __future__ import annotations

from decode_server.scheduler import StepStats
from kvtransfer.metrics import Metrics


def series(m: Metrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    from bench.serve_metrics import parse

    return parse(generate_latest(m.registry).decode())


def test_steps_feed_the_batch_prompt_rows_and_device_time():
    m = Metrics("decode")
    m.stepped(StepStats(rows=3, prompt_rows=0, step_rows=0, device_s=0.004))
    m.stepped(StepStats(rows=0, prompt_rows=200, step_rows=256, device_s=0.02))  # prompt rows only: not a batch of 0
    m.stepped(StepStats(rows=5, prompt_rows=10, step_rows=256, device_s=0.006))
    s = series(m)
    assert (s["kvt_decode_batch_size_count"], s["kvt_decode_batch_size_sum"]) == (2, 8)
    assert s["kvt_decode_prompt_rows_total"] == 210 and s["kvt_decode_mixed_steps_total:256"] == 2
    assert abs(s["kvt_decode_device_seconds_total"] - 0.03) < 1e-9


def test_the_bench_reports_the_runs_share_of_device_time(monkeypatch):
    import bench.serve_metrics as sm

    m, clock = Metrics("decode"), iter([100.0, 102.0])
    monkeypatch.setattr(sm, "scrape", lambda url: series(m))
    monkeypatch.setattr(sm.time, "perf_counter", lambda: next(clock))
    watch = sm.BatchWatch("http://unused")
    m.stepped(StepStats(rows=4, prompt_rows=100, step_rows=512, device_s=1.5))
    r = watch.report()
    assert (r["steps"], r["mean_batch_per_step"], r["prompt_rows_in_steps"]) == (1, 4, 100)
    assert r["mixed_steps_by_rows"] == {"512": 1}
    assert r["device_busy"] == 0.75  # 1.5 s of steps in 2 s of wall


def test_no_device_time_reads_as_unknown_not_idle(monkeypatch):
    import bench.serve_metrics as sm

    m = Metrics("decode")
    monkeypatch.setattr(sm, "scrape", lambda url: series(m))
    watch = sm.BatchWatch("http://unused")
    m.stepped(StepStats(rows=2, prompt_rows=0, step_rows=0, device_s=0.0))  # CPU: no CUDA events
    assert watch.report()["device_busy"] is None
