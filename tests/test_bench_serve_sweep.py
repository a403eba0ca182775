"""The serve sweep on CPU (tiny): every arm and baseline runs, the batching server batches, the summary adds up."""

from __future__ import annotations

import json


def test_serve_sweep_smoke(tmp_path, capsys):
    """The driver in this process (its servers are real processes): an interpreter start less on a CI core."""
    from bench.runs.serve_sweep import main

    code = main(["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--transport", "gloo", "--max-batch", "4",
                 "--max-seq-len", "256", "--concurrency", "1,4", "--baseline-concurrency", "4", "--input-len", "16",
                 "--output-len", "12", "--min-prompts", "4", "--prompts-per-slot", "4", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["ok"] and result["complete"] and len(result["runs"]) == 6
    rows = {(s["arm"], s["concurrency"]): s for s in result["summary"]}
    assert set(rows) == {("colocated", 1), ("colocated", 4), ("pair", 1), ("pair", 4)}
    for arm in ("colocated", "pair"):
        assert rows[(arm, 4)]["mean_batch"] > 1  # the batching server advanced several requests per step
        assert rows[(arm, 4)]["speedup_vs_max_batch_1"] is not None
        assert rows[(arm, 4)]["sustained_tok_s"] > 0 and rows[(arm, 4)]["sustained_speedup_vs_max_batch_1"] > 0
    base = [r for r in result["runs"] if r["server_max_batch"] == 1]
    assert all(r["server_batch"]["running_max"] <= 1 for r in base)


def test_baseline_takes_its_own_decode_args_when_given():
    from argparse import Namespace

    from bench.runs.serve_sweep import extra_args

    mixed = "--prefill-chunk 256 --mixed-prefill"
    assert extra_args(Namespace(decode_args=mixed, baseline_decode_args=None), 1) == mixed
    assert extra_args(Namespace(decode_args=mixed, baseline_decode_args=""), 1) == ""
    assert extra_args(Namespace(decode_args=mixed, baseline_decode_args=""), 64) == mixed


def test_sustained_speedup_against_the_baselines_steady_state_or_its_whole_run():
    from bench.runs.serve_sweep import sustained_speedup

    run = {"sustained_output_throughput": 300.0}
    assert sustained_speedup(run, {"sustained_output_throughput": 20.0, "output_throughput": 30.0}) == {
        "sustained_tok_s": 300.0, "sustained_speedup_vs_max_batch_1": 15.0}
    assert sustained_speedup(run, {"sustained_output_throughput": None, "output_throughput": 30.0})[
        "sustained_speedup_vs_max_batch_1"] == 10.0
    assert sustained_speedup({"sustained_output_throughput": None}, None) == {
        "sustained_tok_s": None, "sustained_speedup_vs_max_batch_1": None}


def test_prompt_count_per_concurrency_and_its_cap():
    from argparse import Namespace

    from bench.runs.serve_sweep import prompt_count

    args = Namespace(min_prompts=8, prompts_per_slot=32, max_prompts=1024)
    assert [prompt_count(args, c) for c in (1, 8, 32, 64)] == [32, 256, 1024, 1024]
    assert prompt_count(Namespace(min_prompts=8, prompts_per_slot=2, max_prompts=0), 1) == 8


def test_a_cut_short_sweep_keeps_its_runs_marked_incomplete(tmp_path):
    from argparse import Namespace

    from bench.runs.serve_sweep import write_result

    args = Namespace(arms="colocated", max_batch=64, out=str(tmp_path))
    run = {"arm": "colocated", "server_max_batch": 64, "max_concurrency": 8, "output_throughput": 100.0,
           "sustained_output_throughput": 110.0, "median_ttft_ms": 1, "p99_ttft_ms": 2, "median_itl_ms": 3,
           "p99_itl_ms": 4}
    write_result(args, [run], [], complete=False)
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert not on_disk["ok"] and not on_disk["complete"] and on_disk["runs"] == [run]
    row = on_disk["summary"][0]
    assert row["output_tok_s"] == 100.0 and row["baseline_max_batch_1_tok_s"] is None
    assert not (tmp_path / "result.json.tmp").exists()  # written aside, then moved in


def test_a_run_that_made_no_tokens_has_no_ratio():
    from bench.runs.serve_sweep import ratio, sustained_speedup

    assert ratio(None, 200.0) is None and ratio(300.0, None) is None and ratio(300.0, 0.0) is None
    assert ratio(300.0, 20.0) == 15.0
    assert sustained_speedup({"sustained_output_throughput": 0.0}, {"sustained_output_throughput": 10.0})[
        "sustained_speedup_vs_max_batch_1"] == 0.0


def test_the_pair_arm_puts_prefill_on_its_own_device(monkeypatch):
    from bench.runs import serve_sweep

    seen = []
    monkeypatch.setattr(serve_sweep, "server_pair", lambda log, model, dtype, pre, dec, **kw: seen.append((pre, dec)))
    from argparse import Namespace
    ns = Namespace(model="tiny", dtype="float32", device="cuda:0", prefill_device="", transport="nccl",
                   max_seq_len=256, decode_args="", baseline_decode_args=None)
    serve_sweep.arm_servers("pair", ns, 4, "logs", 1)
    serve_sweep.arm_servers("pair", Namespace(**{**vars(ns), "prefill_device": "cuda:1"}), 4, "logs", 1)
    assert seen == [("cuda:0", "cuda:0"), ("cuda:1", "cuda:0")]  # one GPU shared by default; two when asked


def test_a_long_share_run_summarizes_short_itl_and_long_ttft():
    from bench.runs.serve_sweep import split_figures

    assert split_figures({"median_itl_ms": 5.0}) == {}
    split = {"short": {"completed": 90, "median_itl_ms": 5.0, "p99_itl_ms": 40.0, "median_ttft_ms": 50.0,
                       "p99_ttft_ms": 90.0},
             "long": {"completed": 10, "median_itl_ms": 6.0, "p99_itl_ms": 9.0, "median_ttft_ms": 900.0,
                      "p99_ttft_ms": 1500.0}}
    assert split_figures({"by_length": split}) == {"short_p50_itl_ms": 5.0, "short_p99_itl_ms": 40.0,
                                                   "long_p50_ttft_ms": 900.0, "long_p99_ttft_ms": 1500.0,
                                                   "long_completed": 10}
