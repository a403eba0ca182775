"""bench/probes/step_curve.py on CPU (`tiny`): each size's step carries the steady mix asked for (decode rows by the
workload's ratio, every other row a prompt row, none padding), the ratios are priced against the decode step they
name, and the efficiency is rows x t_r over the step's time."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from bench.probes import step_curve


@pytest.mark.parametrize("rows, p, o, want", [(512, 1024, 128, 56), (1024, 1024, 128, 113), (256, 1024, 128, 28),
                                              (24, 40, 8, 4), (8, 1000, 2, 1),
                                              (100, 2, 2, 33)])  # (O - 1) / (P + O - 1): 1 / 3, not 1 / 4
def test_the_steady_mix_feeds_o_minus_1_decode_rows_for_every_p_prompt_rows(rows, p, o, want):
    assert step_curve.mix(rows, p, o) == want


def test_efficiency_is_rows_times_t_r_over_the_step_and_the_ratio_is_over_each_decode_step():
    r = {"steps": [{"rows": 500, "step_ms": 12.5}], "decode_step_ms": {"64": 7.5, "128": 10.0}}
    step_curve.figures(r, SimpleNamespace(), 18.0)
    s = r["steps"][0]
    assert s["efficiency"] == pytest.approx(500 * 18.0 / 12_500)
    assert s["itl_over_decode_step"] == pytest.approx({"64": 12.5 / 7.5, "128": 1.25})


def test_t_r_is_the_request_s_roofline_time_over_the_tokens_it_feeds():
    from bench.measure import roofline
    from kvtransfer.model.spec import load_config

    dims = roofline.Dims.of(load_config("tiny"))
    measured = {"layer_tflops": 500.0, "lm_head_tflops": 250.0}
    fig = roofline.run_figures(measured, dims, [40], 8, None)
    f = roofline.request_flops(dims, 40, 8)
    seconds = (f["layers"] + f["attention"]) / 500e12 + f["lm_head"] / 250e12  # the request at the roofline
    assert step_curve.t_r_us(fig, 40, 8) == pytest.approx(seconds / (40 + 8 - 1) * 1e6)


def test_the_curve_on_cpu_builds_each_size_at_the_steady_mix(monkeypatch):
    buckets_seen = []
    ran = step_curve.attention_ran
    monkeypatch.setattr(step_curve, "attention_ran", lambda runner, b: buckets_seen.append(b) or ran(runner, b))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        step_curve.main(["--model", "tiny", "--device", "cpu", "--sizes", "24,32", "--context", "48", "--input-len",
                         "40", "--output-len", "8", "--itl-batches", "4,8", "--no-roofline", "--runs", "2"])
    r = json.loads(out.getvalue().strip().splitlines()[-1])
    assert r["bench"] == "step_curve" and set(r["decode_step_ms"]) == {"4", "8"}
    for size, s in zip((24, 32), r["steps"]):
        d = step_curve.mix(size, 40, 8)
        assert (s["rows"], s["decode_rows"], s["prompt_rows"]) == (size, d, size - d)  # no padding rows
        assert s["step_rows"] == size  # the graphs' layout (staged on CPU): the bucket's free rows carry prompt
        assert s["prompt_start"] + s["prompt_rows"] <= 40 and s["step_ms"] > 0 and s["decode_only_ms"] > 0
        assert set(s["itl_over_decode_step"]) == {"4", "8"} and s["efficiency"] is None
        assert s["attention"] == "two"  # on CPU: no Triton, the two kernels' torch references
    assert buckets_seen == [4, 8]  # the runner decides by the decode rows' bucket (5 rows: 8), not their count


def test_bad_sizes_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        step_curve.main(["--model", "tiny", "--device", "cpu", "--sizes", "24,x", "--no-roofline"])
    assert e.value.code == 2 and "--sizes" in capsys.readouterr().err


def test_the_pool_rows_hold_a_servers_positions_with_only_the_blocks_the_step_uses():
    """The kernels' grids follow the rows' length (the decode kernel's splits, whether the mixed attention fuses), so
    the curve's pool has a server's rows: --pool-seq positions, blocks for --context / --input-len only."""
    from bench.probes.mixed_step import build
    from kvtransfer.model.spec import ModelSpec, load_model

    a = step_curve.build_parser().parse_args(["--model", "tiny", "--device", "cpu", "--context", "48",
                                              "--input-len", "40", "--output-len", "8", "--pool-seq", "4096"])
    a.dtype = "float32"
    model = load_model(ModelSpec("tiny", "float32", 0), "cpu")
    st, *_ = build(step_curve.step_args(a, 24, 4), model)
    pool = st.runner.pool
    assert (pool.max_seq, pool.width, pool.blocks) == (4096, 4096 // 64, (4 + 1) * -(-48 // 64))
    assert st.staged  # off CUDA the step runs in the graphs' padded layout (the bucket's free rows carry prompt)
    a.pool_seq = 0  # as the probe's own pool: the step's positions
    st, *_ = build(step_curve.step_args(a, 24, 4), model)
    assert st.runner.pool.max_seq == 48


def test_the_attention_reported_is_what_the_runner_runs_not_what_was_asked(monkeypatch):
    """--attention fused cannot fuse rows longer than the decode kernel's per-split cap (a server's 32k rows): the
    curve must not label such steps fused."""
    from kvtransfer.engine import runner as runner_module
    from kvtransfer.kernels import ops

    runner = SimpleNamespace(hq=28, hkv=4, device="cuda", pool=SimpleNamespace(max_seq=32768))
    calls = []

    def fuses(bucket, hq, hkv, device, max_seq=None, **_):
        calls.append((bucket, max_seq))
        return max_seq <= 1024

    monkeypatch.setattr(ops, "mixed_attention_fuses", fuses)
    monkeypatch.setattr(runner_module, "MIXED_ATTENTION", "fused")
    assert step_curve.attention_ran(runner, 64) == "two" and calls == [(64, 32768)]
    runner.pool.max_seq = 1024
    assert step_curve.attention_ran(runner, 64) == "fused"
    monkeypatch.setattr(runner_module, "MIXED_ATTENTION", "two")
    assert step_curve.attention_ran(runner, 64) == "two"


@pytest.mark.parametrize("argv, flag", [(["--sizes", "24", "--output-len", "40"], "--sizes 24"),
                                        (["--sizes", "24", "--itl-batches", "300"], "--itl-batches")])
def test_a_mix_or_batch_the_engine_cannot_build_is_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        step_curve.main(["--model", "tiny", "--device", "cpu", "--input-len", "40", "--no-roofline", *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err
