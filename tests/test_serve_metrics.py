"""The decode server's step metrics and the serve bench's reading of them (bench/measure/serve_metrics.py).

Why: the serve bench's mean batch, prompt rows and device-busy share come from counters the
scheduler feeds once per delivered step; a step counted twice, a prompt-only step counted as a
batch of 0, or a busy share read off the wrong series would misreport the run.
"""

from __future__ import annotations

from kvtransfer.engine.queued import StepStats
from kvtransfer.rpc.metrics import Metrics


def series(m: Metrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    from bench.measure.serve_metrics import parse

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
    assert s["kvt_decode_decode_only_steps_total"] == 1
    assert abs(s["kvt_decode_step_device_seconds_total:256"] - 0.026) < 1e-9  # the two mixed steps
    assert abs(s["kvt_decode_step_device_seconds_total:decode"] - 0.004) < 1e-9


def test_the_bench_reports_each_kind_of_step_s_mean_device_time(monkeypatch):
    """The served step's own time (#39: the probe prices a step alone; the served one is the figure to match), from
    the restart on: decode-only steps apart from each mixed size."""
    import bench.measure.serve_metrics as sm

    m = Metrics("decode")
    m.stepped(StepStats(rows=4, prompt_rows=100, step_rows=512, device_s=9.0))  # before the watch: not the run's
    monkeypatch.setattr(sm, "scrape", lambda url: series(m))
    watch = sm.BatchWatch("http://unused")
    for device_s in (0.014, 0.016):
        m.stepped(StepStats(rows=56, prompt_rows=456, step_rows=512, device_s=device_s))
    m.stepped(StepStats(rows=60, prompt_rows=68, step_rows=128, device_s=0.005))
    for _ in range(3):
        m.stepped(StepStats(rows=64, prompt_rows=0, step_rows=64, device_s=0.007))
    r = watch.report()
    assert r["decode_only_steps"] == 3
    assert set(r["step_ms_by_rows"]) == {"512", "128", "decode"}
    for kind, ms in (("512", 15.0), ("128", 5.0), ("decode", 7.0)):
        assert abs(r["step_ms_by_rows"][kind] - ms) < 1e-9, kind


def test_the_bench_reports_the_runs_share_of_device_time(monkeypatch):
    import bench.measure.serve_metrics as sm

    m, clock = Metrics("decode"), iter([100.0, 102.0])
    monkeypatch.setattr(sm, "scrape", lambda url: series(m))
    monkeypatch.setattr(sm.time, "perf_counter", lambda: next(clock))
    watch = sm.BatchWatch("http://unused")
    m.stepped(StepStats(rows=4, prompt_rows=100, step_rows=512, device_s=1.5, staging_s=0.3))
    r = watch.report()
    assert (r["steps"], r["mean_batch_per_step"], r["prompt_rows_in_steps"]) == (1, 4, 100)
    assert r["mixed_steps_by_rows"] == {"512": 1}
    assert r["device_busy"] == 0.75  # 1.5 s of steps in 2 s of wall
    assert abs(r["staging_share"] - 0.2) < 1e-9  # 0.3 s of the 1.5 before the graphs' replays


def test_a_steps_staging_is_its_start_to_its_graphs_replay():
    """QueuedStep.staging_s: start -> the replay's event (the device's wait for the host's launches shows here,
    #39), not start -> end, and 0 without a replay (an eager step) or off CUDA."""
    from kvtransfer.engine.queued import QueuedStep

    class Mark:  # a CUDA event's elapsed_time: ms from this mark to `other`
        def __init__(self, ms: float):
            self.ms = ms

        def elapsed_time(self, other: "Mark") -> float:
            return other.ms - self.ms

    q = QueuedStep([], None, None, Mark(14.0), {}, [], start=Mark(1.0), replayed=Mark(1.5))
    assert abs(q.staging_s() - 0.0005) < 1e-12 and abs(q.device_s() - 0.013) < 1e-12
    assert QueuedStep([], None, None, Mark(14.0), {}, [], start=Mark(1.0)).staging_s() == 0.0
    assert QueuedStep([], None, None, None, {}, []).staging_s() == 0.0


def test_no_device_time_reads_as_unknown_not_idle(monkeypatch):
    import bench.measure.serve_metrics as sm

    m = Metrics("decode")
    monkeypatch.setattr(sm, "scrape", lambda url: series(m))
    watch = sm.BatchWatch("http://unused")
    m.stepped(StepStats(rows=2, prompt_rows=0, step_rows=0, device_s=0.0))  # CPU: no CUDA events
    assert watch.report()["device_busy"] is None
    assert watch.report()["step_ms_by_rows"] == {}  # no step time to average, not 0 ms


def test_the_scheduler_reports_every_delivered_step_once():
    """A 61-token prompt prefilled in 17-row mixed steps while nothing decodes (prompt-only steps), then decoded
    for 10 tokens while a 12-token prompt rides in its steps and decodes 6: the steps' prompt rows add up to the
    prompts, their decode rows to the tokens the steps made, and every step with decode rows is one of the
    scheduler's steps."""
    import torch

    from kvtransfer.engine.engine import DecodeEngine, EngineOptions
    from kvtransfer.geometry import CacheGeometry
    from kvtransfer.model.loaded import LoadedModel
    from kvtransfer.model.spec import ModelSpec, load_model
    from support.enginekit import decode_prompts

    model = load_model(ModelSpec("tiny", "float32", 0))
    lm = LoadedModel(ModelSpec("tiny", "float32", 0), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    stats: list[StepStats] = []
    e = DecodeEngine(lm, EngineOptions(max_batch=4, max_seq_len=256, cuda_graphs=False, prefill_chunk=17,
                                       mixed_prefill=True), on_step=stats.append)
    try:
        decode_prompts(e, model.config.vocab_size, [(61, 10), (12, 6)])
    finally:
        e.close()
    assert sum(s.prompt_rows for s in stats) == 61 + 12  # the 12 rode in a step of the first one's decode
    assert sum(s.rows for s in stats) == 10 + 6
    assert sum(1 for s in stats if s.rows) == e.scheduler.steps
    assert [s.step_rows for s in stats if s.prompt_rows] == [0] * 5  # 4 steps of the 61, 1 of the 12; eager: 0


def test_the_bench_reports_how_often_no_prompt_waited(monkeypatch):
    """kvt_decode_prompts_queued (the scheduler's prompts waiting to ride in steps) sampled over a run: its median
    and the share of samples with none waiting, when a step can only decode."""
    import asyncio

    import bench.measure.serve_metrics as sm

    m, queued = Metrics("decode"), iter([0, 3, 0, 5, 0, 2])
    m.prompts_queued.set_function(lambda: next(queued))
    monkeypatch.setattr(sm, "scrape", lambda url: series(m))
    monkeypatch.setattr(sm, "SAMPLE_S", 0.0)
    watch = sm.BatchWatch("http://unused")

    async def run():
        task = asyncio.create_task(watch.sample(0.0))
        while len(watch.queued) < 4:
            await asyncio.sleep(0)
        task.cancel()
    asyncio.run(run())
    r = watch.report()
    assert watch.queued == [3.0, 0.0, 5.0, 0.0] and r["prompts_queued_p50"] == 1.5
    assert r["prompts_queued_none_share"] == 0.5


def test_the_warm_up_steps_are_no_part_of_the_run(monkeypatch):
    """serve sends its warm-up requests (each a batch of one) before the clock starts; the server's figures count
    from the restart after them (bench/runs/serve_load.py), so steps, mean batch and busy share are the run's."""
    import bench.measure.serve_metrics as sm

    m = Metrics("decode")
    monkeypatch.setattr(sm, "scrape", lambda url: series(m))
    watch = sm.BatchWatch("http://unused")
    for _ in range(128):  # a warm-up request's 128 one-row steps
        m.stepped(StepStats(rows=1, prompt_rows=0, step_rows=0, device_s=0.005))
    watch.restart()
    m.stepped(StepStats(rows=56, prompt_rows=456, step_rows=512, device_s=0.013))
    r = watch.report()
    assert (r["steps"], r["mean_batch_per_step"], r["prompt_rows_in_steps"]) == (1, 56, 456)


def test_serve_restarts_the_watch_after_its_warm_up(monkeypatch):
    """The order in the load itself: warm-up requests, then the watch's restart, then the run's requests."""
    import asyncio
    from contextlib import asynccontextmanager

    import bench.runs.serve_load as sl
    from bench.runs.serve_config import ServeConfig

    order = []

    @asynccontextmanager
    async def door(cfg, metadata):
        async def send(ids, timeout, stop_after=None):
            order.append("send")
            return {"code": None, "error": "", "input_len": len(ids), "times": [0.0], "sent": 0.0}
        yield send

    class Watch:
        def restart(self):
            order.append("restart")

        async def sample(self, start):
            await asyncio.sleep(3600)
    monkeypatch.setattr(sl, "grpc_door", door)
    cfg = ServeConfig(addr="127.0.0.1:1", num_prompts=3, warmup=2, input_len=8, output_len=2, vocab_size=100)
    asyncio.run(sl._run(cfg, [[1, 2, 3]] * 3, lambda _: None, None, Watch()))
    assert order == ["send", "send", "restart", "send", "send", "send"]


def test_the_serve_report_prints_each_kind_of_step_s_mean_time():
    """On a real run's result (one H100, bench/results/stall-h100-2026-12-07/call14) with the new fields added."""
    import json
    from pathlib import Path

    from bench.report.serve import run_tables

    path = Path(__file__).parents[1] / "bench/results/stall-h100-2026-12-07/call14/serve/c64/result.json"
    result = json.loads(path.read_text())
    result["server_batch"].update(decode_only_steps=126, step_ms_by_rows={"128": 5.0, "512": 14.104, "decode": 7.0})
    label = "server: mean step device ms, by rows (decode: no prompt rows)"
    rows = {r[0]: r[1] for r in run_tables(result)[0].rows}
    assert rows["server: steps without prompt rows"] == "126"
    assert rows[label] == "128: 5.00, 512: 14.10, decode: 7.00"
    del result["server_batch"]["step_ms_by_rows"], result["server_batch"]["decode_only_steps"]  # an older server's
    rows = {r[0]: r[1] for r in run_tables(result)[0].rows}
    assert (rows[label], rows["server: steps without prompt rows"]) == ("-", "-")
