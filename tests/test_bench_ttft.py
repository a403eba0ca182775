"""`kvtransfer-bench ttft` smoke test: real servers on CPU, JSON fields, verified equality."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ttft_cli_json(tmp_path):
    cmd = [sys.executable, "-m", "bench.cli", "ttft", "--lengths", "8,40", "--runs", "2", "--warmup", "1",
           "--decode-tokens", "3", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["kind"] == "ttft" and result["ok"] and result["verified"]
    assert {(r["length"], r["mode"]) for r in result["rows"]} == {(8, "layerwise"), (8, "bulk"), (40, "layerwise"),
                                                                  (40, "bulk")}
    for r in result["rows"]:
        assert r["cache_equal"] and r["tokens_equal"] and r["logits_equal"]
        assert r["ttft_disagg"]["n"] == 2 and r["ttft_colo"]["median_ms"] > 0
        assert abs(r["overhead_ms"] - (r["ttft_disagg"]["median_ms"] - r["ttft_colo"]["median_ms"])) < 1e-9
        assert "second_token_disagg" in r and "prefill_slowdown_pct" in r
    assert result["links"]["p2p whole cache"]["gbps"] > 0
    assert os.path.exists(tmp_path / "result.json") and os.path.exists(tmp_path / "report.md")
