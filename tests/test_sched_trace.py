"""bench/probes/sched_trace: the scheduler trace a decode server writes when the folder is first on PYTHONPATH with
KVT_TRACE set, and its report. A CPU run of the interference bench's chunked arm (a real server process on the tiny
preset): the trace holds every wrapped piece, the long prompt's join and its chunks' forwards, and the report finds
the prompt's last forward and the delivery gaps around it. Structure only, no timed asserts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_traced_interference_run_and_its_report(tmp_path):
    trace = tmp_path / "trace.jsonl"
    env = {**os.environ, "KVT_TRACE": str(trace),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench/probes/sched_trace"), str(ROOT)])}
    subprocess.run([sys.executable, "-m", "bench.cli", "interference", "--model", "tiny", "--device", "cpu",
                    "--streams", "2", "--context", "64", "--arrivals", "500", "--arms", "chunked", "--chunks", "128",
                    "--gap-s", "0.5", "--out", str(tmp_path / "out")], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=240)
    recs = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = {r["k"] for r in recs}
    assert {"advance", "queue_step", "deliver", "make_room", "forward", "to_host", "add", "drain"} <= kinds, kinds
    assert max(r["n"] for r in recs if r["k"] == "add") == 500  # the long prompt joined the batch
    assert [r["tokens"] for r in recs if r["k"] == "forward"][-4:] == [128] * 4  # its chunks, the last (116) padded
    assert all(r.get("t1", r["t0"]) >= r["t0"] for r in recs)
    out = subprocess.run([sys.executable, "-m", "bench.probes.sched_trace.report", str(trace)], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.startswith("long prompt: 500 tokens")
    assert "longest delivery gap" in out and " forward " in out and " deliver " in out
