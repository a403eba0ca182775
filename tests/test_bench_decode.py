"""`kvtransfer-bench decode` on CPU: the grid runs (engine eager, HF eager), its JSON, tables and chart are
written; plus the pieces a GPU run leans on: a second StepRunner over one model copies no weights, a failing
cell is filed (not raised), and the floor, ratios and targets are the stated arithmetic."""

from __future__ import annotations

import contextlib
import io
import json
import struct

import pytest
import torch

from bench.measure.decode_measure import Grid
from bench.report.decode import finish_cell, targets
from bench.runs.decode import DecodeBenchConfig, points
from kvtransfer.model.spec import ModelSpec, load_model


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    """The CLI in this process, as tests/test_bench_link.py runs it: an interpreter start less on a CI core."""
    from bench.cli import main

    out = tmp_path_factory.mktemp("decode")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["decode", "--model", "tiny", "--device", "cpu", "--batches", "1,2", "--contexts", "64,128",
                   "--runs", "2", "--warmup", "1", "--hf", "eager", "--out", str(out)])
    assert rc == 0, stdout.getvalue()[-3000:] + stderr.getvalue()[-3000:]
    return json.loads(stdout.getvalue().strip().splitlines()[-1]), out


def test_decode_json(decode_run):
    r, _ = decode_run
    assert r["kind"] == r["bench"] == "decode" and r["ok"] and r["failures"] == [] and r["skipped"] == []
    assert (r["device"], r["model"], r["dtype"]) == ("cpu", "tiny", "float32")
    assert r["bandwidth_gbps"] > 0 and r["weights_bytes"] > 0 and r["targets"] == {}  # no 1k/32k cell here
    assert [(c["batch"], c["context"]) for c in r["cells"]] == [(1, 64), (2, 64), (1, 128), (2, 128)]
    for c in r["cells"]:
        assert 0 < c["step_ms_p10"] <= c["step_ms_p50"] <= c["step_ms_p90"] and c["graphed"] is False
        floor = (r["weights_bytes"] + c["batch"] * c["context"] * r["bytes_per_token"]) / (r["bandwidth_gbps"] * 1e6)
        assert c["floor_ms"] == pytest.approx(floor)
        assert c["ratio"] == pytest.approx(c["step_ms_p50"] / c["floor_ms"])
        assert c["tok_s"] == pytest.approx(c["batch"] * 1e3 / c["step_ms_p50"])
        assert c["share_of_floor_throughput"] == pytest.approx(c["tok_s"] / c["floor_tok_s"])
        assert c["hf_eager_ms"] > 0 and c["engine_vs_hf_eager"] == pytest.approx(c["hf_eager_ms"] / c["step_ms_p50"])
        assert c["hf_static_compile_ms"] is None and c["engine_vs_hf_static_compile"] is None
    assert [(s["context"], s["batch"], s["ok"]) for s in r["sanity"]] == [(64, 2, True), (128, 2, True)]


def test_decode_files(decode_run):
    r, out = decode_run
    assert json.load(open(out / "result.json"))["cells"] == r["cells"]
    png = (out / "decode.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 100
    report = (out / "report.md").read_text()
    assert "kvtransfer-bench decode --model tiny" in report and "(decode.png)" in report and "| 2 | 128 |" in report


def test_second_runner_copies_no_weights():
    from kvtransfer.engine.pool import KVPool
    from kvtransfer.engine.runner import StepRunner
    from kvtransfer.geometry import CacheGeometry
    model = load_model(ModelSpec("tiny", "float32"))  # own copy: fusing rebinds its parameters
    geom = CacheGeometry.from_config(model.config, torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    before = model(input_ids=ids).logits
    first = StepRunner(model, KVPool(geom, torch.device("cpu"), slots=2, max_seq=32))
    second = StepRunner(model, KVPool(geom, torch.device("cpu"), slots=3, max_seq=64))
    for a, b, layer in zip(first.layers, second.layers, model.model.layers):
        assert a.qkv.data_ptr() == b.qkv.data_ptr() and a.gate_up.data_ptr() == b.gate_up.data_ptr()
        q = layer.self_attn.q_proj.weight
        assert layer.self_attn.k_proj.weight.data_ptr() == b.qkv.data_ptr() + q.numel() * q.element_size()
        assert b.qkv.shape[0] == q.shape[0] + 2 * layer.self_attn.k_proj.weight.shape[0]
    assert torch.equal(model(input_ids=ids).logits, before)
    assert second.cos.shape[0] == 64


def test_grid_files_failures():
    grid = Grid(torch.device("cpu"), lambda _: None)
    grid.guard([(8, 1024)], "engine", lambda: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory")))
    grid.guard([(1, 64), (2, 64)], "hf eager", lambda: (_ for _ in ()).throw(ValueError("bad shape")))
    assert [(s["batch"], s["context"], s["what"]) for s in grid.skipped] == [(8, 1024, "engine"), (1, 64, "hf eager"),
                                                                            (2, 64, "hf eager")]
    assert grid.skipped[0]["why"].startswith("out of memory") and "bad shape" in grid.skipped[1]["why"]
    assert len(grid.failures) == 1 and "1x64,2x64" in grid.failures[0]  # an OOM is a skip, not a failure


def test_floor_ratios_targets():
    c = finish_cell({"batch": 64, "context": 1024, "step_ms_p50": 16.0, "hf_eager_ms": 40.0}, 10**9, 1000, 100.0)
    assert c["floor_ms"] == pytest.approx((10**9 + 64 * 1024 * 1000) / 100e9 * 1e3)
    assert c["engine_vs_hf_eager"] == 2.5 and c["engine_vs_hf_static_compile"] is None
    one = finish_cell({"batch": 1, "context": 1024, "step_ms_p50": 12.0}, 10**9, 1000, 100.0)
    skipped = finish_cell({"batch": 1, "context": 32768}, 10**9, 1000, 100.0)
    assert skipped["ratio"] is None and skipped["tok_s"] is None
    assert targets([c, one, skipped]) == {"batch1_1k_ratio_le_1.3": True, "batch64_1k_share_of_floor_ge_0.6": True}
    assert targets([finish_cell({"batch": 1, "context": 1024, "step_ms_p50": 14.0}, 10**9, 1000, 100.0)]) == {
        "batch1_1k_ratio_le_1.3": False}


def test_a_sampling_run_times_greedy_beside_it(tmp_path):
    """--temperature: every cell also times the greedy step (argmax), alternating with the sampling step in the
    same process, and reports sampling / greedy; the every-cell target follows the worst cell."""
    from bench.cli import main
    from bench.runs.decode import PAIRED_ROUNDS

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["decode", "--model", "tiny", "--device", "cpu", "--batches", "2", "--contexts", "64", "--runs", "2",
                   "--warmup", "1", "--hf", "none", "--temperature", "1", "--top-p", "0.9", "--out", str(tmp_path)])
    assert rc == 0, stdout.getvalue()[-3000:] + stderr.getvalue()[-3000:]
    (c,) = json.loads(stdout.getvalue().strip().splitlines()[-1])["cells"]
    assert len(c["paired_rounds"]) == PAIRED_ROUNDS
    assert c["step_ms_greedy_p50"] > 0 and c["sampling_over_greedy"] == pytest.approx(
        c["step_ms_p50"] / c["step_ms_greedy_p50"])
    assert "sampling / greedy" in (tmp_path / "report.md").read_text()
    cells = [finish_cell({"batch": b, "context": 1024, "step_ms_p50": 5.0, "step_ms_greedy_p50": g,
                          "sampling_over_greedy": 5.0 / g}, 10**9, 1000, 100.0) for b, g in ((8, 4.9), (64, 4.8))]
    assert targets(cells)["sampling_over_greedy_le_1.03_every_cell"] is False  # 5.0 / 4.8 = 1.042 in one cell
    assert targets(cells[:1])["sampling_over_greedy_le_1.03_every_cell"] is True


def test_config_and_points():
    assert points("1x1024, 8X8192") == [(1, 1024), (8, 8192)]
    with pytest.raises(ValueError, match="BATCHxCONTEXT"):
        points("1024")
    with pytest.raises(ValueError, match="subset"):
        DecodeBenchConfig("tiny", "float32", "cpu", hf=("compiled",))
    with pytest.raises(ValueError, match="one of --contexts"):
        DecodeBenchConfig("tiny", "float32", "cpu", contexts=(64,), hf=("static-compile",), hf_compile_points=((1, 1024),))
    with pytest.raises(ValueError, match="never downloads"):
        DecodeBenchConfig("Qwen/Qwen2.5-7B", "bfloat16", "cpu")
