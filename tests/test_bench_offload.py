"""Offload bench and CLI on the tiny preset: every field there, every check True, one JSON line.

Why: the table is only worth publishing if its verification cannot silently pass and its
derived figures (speed-up, break-even) follow the definitions in docs/architecture.md, "Bench definitions".
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.cli import main
from bench.report.kinds import tables_for
from bench.report.table import markdown
from bench.runs.offload import OffloadConfig, run_offload, total_steps

STATS = {"median_ms", "min_ms", "max_ms", "runs"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    cfg = OffloadConfig(lengths=(32, 96), runs=3, warmup=1, decode_tokens=4, link_bytes=1 << 20,
                        disk_dir=str(tmp_path_factory.mktemp("disk")))
    steps = []
    res = run_offload(cfg, steps.append)
    assert len(steps) == total_steps(cfg)
    return res


def test_result_fields_and_checks(result):
    assert result["kind"] == "offload" and result["ok"] is True
    assert [r["length"] for r in result["rows"]] == [32, 96]
    for row in result["rows"]:
        assert STATS <= set(row["prefill"]) and row["prefill"]["runs"] == 3
        assert row["cache_bytes"] == row["bytes_per_token"] * row["length"]
        assert set(row["tiers"]) == {"gpu", "pinned", "pageable", "disk", "disk-fsync"}
        assert row["tiers"]["pinned"] == {"available": False, "skip_reason": row["tiers"]["pinned"]["skip_reason"]}
        for kind, t in row["tiers"].items():
            if not t["available"]:
                continue
            assert STATS <= set(t["offload"]) and STATS <= set(t["reload"])
            assert t["offload"]["min_ms"] <= t["offload"]["median_ms"] <= t["offload"]["max_ms"]
            assert t["byte_equal"] is t["tokens_equal"] is t["logits_equal"] is t["decode_equal"] is True
            assert t["reload_speedup"] == pytest.approx(row["prefill"]["median_ms"] / t["reload"]["median_ms"])
            assert t["reload_gbps"] == pytest.approx(row["cache_bytes"] / (t["reload"]["median_ms"] / 1e3) / 1e9)
            if kind.startswith("disk"):
                assert all(isinstance(t["page_cache"][k], bool) for k in ("fadvise", "drop_caches_tried", "drop_caches", "cold"))


def test_break_even(result):
    for row in result["rows"]:
        prefill_s_per_token = row["prefill"]["median_ms"] / 1e3 / row["length"]
        assert row["break_even_gbps"] == pytest.approx(row["bytes_per_token"] / prefill_s_per_token / 1e9)
        assert row["bytes_per_token"] == 2 * 4 * 2 * 16 * 4  # tiny: K+V x layers x kv_heads x head_dim x fp32


def test_links_and_json(result):
    links = result["links"]
    assert links["bytes"] == 1 << 20
    for name in ("device_clone", "file_write", "file_write_fsync", "file_read"):
        assert STATS <= set(links[name]) and links[name]["gbps"] > 0
    assert isinstance(links["file_read"]["cold"], bool)
    assert json.loads(json.dumps(result, allow_nan=False)) == result


def test_report_tables(result):
    tables = tables_for(result)
    assert len(tables) == 3 and len(tables[1].rows) == 2 * 5
    text = markdown(tables, "offload", "kvtransfer-bench demo")
    assert "| tiny | 96 | disk-fsync |" in text and "skipped" in text


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        OffloadConfig(runs=0)
    with pytest.raises(ValueError, match="unknown tiers"):
        OffloadConfig(tiers=("nvme",))
    with pytest.raises(ValueError, match="never downloads"):
        OffloadConfig(models=("Qwen/Qwen2.5-7B",))


def test_cli_offload_smoke(tmp_path, monkeypatch, capsys):
    """The CLI in this process, from another directory (`python -m bench.cli` itself runs in tests/test_stacks.py):
    an interpreter start less on a CI core."""
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    code = main(["offload", "--model", "tiny", "--lengths", "16,40", "--runs", "2", "--warmup", "0",
                 "--decode-tokens", "3", "--tiers", "gpu,pinned,disk", "--link-mib", "1",
                 "--disk-dir", str(tmp_path), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-3000:]
    res = json.loads(stdout.strip().splitlines()[-1])
    cuda = torch.cuda.is_available()  # the defaults follow the machine
    assert res["ok"] is True and res["config"]["device"] == ("cuda" if cuda else "cpu")
    assert res["config"]["dtype"] == ("bfloat16" if cuda else "float32")
    assert [r["length"] for r in res["rows"]] == [16, 40]
    assert all(t["decode_equal"] and t["byte_equal"] for r in res["rows"] for t in r["tiers"].values()
               if t["available"])
    assert json.loads((out / "result.json").read_text())["rows"] == res["rows"]
    assert "kvtransfer-bench offload --model tiny" in (out / "report.md").read_text()
    assert "Offload / reload per tier" in stdout


def test_cli_demo(monkeypatch):
    """`make demo` is the ttft bench of a gloo pair beside colocated, tiny preset on CPU, every row verified. The
    run itself is tests/test_bench_ttft.py's (same path, other lengths); here: what the demo asks of it."""
    from bench import cli
    from bench.runs import ttft

    seen = []
    monkeypatch.setattr(ttft, "run_ttft", lambda cfg, step: seen.append(cfg))
    monkeypatch.setattr(cli, "finish", lambda args, result: 0)
    assert main(["demo"]) == 0
    (cfg,) = seen
    assert (cfg.model, cfg.dtype, cfg.prefill_device, cfg.decode_device) == ("tiny", "float32", "cpu", "cpu")
    assert cfg.verify and cfg.transport == "auto" and cfg.runs >= 5 and set(cfg.modes) == {"layerwise", "bulk"}
    assert cfg.lengths == (64, 1024) and cfg.decode_tokens >= 2  # a short and a long prompt; a decode step each


def test_cli_rejects_bad_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["offload", "--runs", "0"])
    assert exc.value.code == 2 and "runs" in capsys.readouterr().err
