"""The runbooks (bench/runbooks/) run end to end on CPU with `python3` standing in: every bench command
they would run on the GPU machine parses with the bench's own flags, so a session that gets the GPUs does not
spend its device minutes on a typo.

The stand-in (tests/support/runbook_checker.py) only records each command line; this test then parses them all
here, in one interpreter, with the same parsers (one interpreter start with torch per line cost ~8 s each)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from support.runbook_checker import check
from support.servers import ROOT

RUNBOOKS = {"two-gpu-1-smoke.sh": 4, "two-gpu-2-interference.sh": 2, "two-gpu-3-serve.sh": 1,
            "one-gpu-39-budget.sh": 7}  # python3 calls


def parse_error(argv: list[str]) -> str | None:
    """None when the bench's parsers take `argv`; else what they said (argparse's message, or the refusal)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            check(argv)
    except SystemExit as e:
        return f"{argv}: exit {e.code}: {err.getvalue().strip()}"
    return None


def run_runbook(tmp_path, name: str, gpus: int) -> subprocess.CompletedProcess:
    """`name` run with python3 standing in (each call recorded in tmp_path/calls.jsonl) and an nvidia-smi whose -L
    lists `gpus` GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT}/tests/support/runbook_checker.py" "$@"\n')
    shim.chmod(0o755)
    smi = bin_dir / "nvidia-smi"
    listing = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\\n" for i in range(gpus))
    smi.write_text(f'#!/bin/sh\n[ "$1" = -L ] && printf "{listing}"\nexit 0\n')
    smi.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               RUNBOOK_CALLS=str(tmp_path / "calls.jsonl"), PYTHONPATH=ROOT)
    return subprocess.run(["bash", os.path.join(ROOT, "bench", "runbooks", name)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name,calls", RUNBOOKS.items())
def test_a_runbooks_commands_parse(tmp_path, name, calls):
    p = run_runbook(tmp_path, name, gpus=2)
    record = tmp_path / "calls.jsonl"
    assert p.returncode == 0, p.stdout + p.stderr
    ran = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    assert len(ran) == calls, (ran, p.stdout, p.stderr)
    rcs = [line for line in p.stdout.splitlines() if " rc=" in line]
    assert rcs and all(" rc=0" in line for line in rcs), p.stdout + "".join(
        (tmp_path / "out" / f).read_text() for f in os.listdir(tmp_path / "out") if f.endswith(".log"))
    errors = [e for e in map(parse_error, ran) if e]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", [n for n in RUNBOOKS if n.startswith("two-gpu")])
def test_a_two_gpu_runbook_on_one_gpu_stops_at_once_and_says_why(tmp_path, name):
    p = run_runbook(tmp_path, name, gpus=1)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs 2 GPUs" in p.stderr and "lists 1" in p.stderr, p.stderr
    assert not (tmp_path / "calls.jsonl").exists()  # no bench ran


def test_the_checker_refuses_a_bad_flag_and_an_unexpected_command():
    """The in-process parse fails as the stand-in used to: a flag the bench does not have, a decode-server flag
    in --decode-args that does not exist, a python3 command that is not a bench."""
    assert parse_error(["-m", "bench.cli", "ttft", "--lengths", "8"]) is None
    assert "--no-such-flag" in parse_error(["-m", "bench.cli", "ttft", "--no-such-flag"])
    assert parse_error(["-m", "bench.runs.serve_sweep", "--out", "x", "--decode-args", "--no-such-flag 1"])
    assert "unexpected python3 command" in parse_error(["-c", "print(1)"])
    assert parse_error(["-m", "decode_server", "--colocated", "--model", "tiny"]) is None
    assert "--no-such-flag" in parse_error(["-m", "decode_server", "--colocated", "--no-such-flag"])
    assert "--no-such-flag" in parse_error(["-m", "bench.probes.profile_mixed", "--no-such-flag"])
    assert "--no-such-flag" in parse_error(["-m", "bench.probes.chunk_attention", "--no-such-flag"])
