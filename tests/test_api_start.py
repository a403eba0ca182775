"""A `kvtransfer-api` start that cannot work exits 2 with one line saying what to fix, and nothing after it.

Why "one line" is asserted and not just the words: an operator reads the last line of a failed start (a unit's
journal, a pod's log); a library's message of several lines (transformers explains at length why it could not
build a tokenizer) buries which flag was wrong. tests/test_api_errors.py covers the other refused starts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.servers import ROOT


def _start(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api_server", "--served-model-name", "m", *args], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("files", [{"config.json": {"model_type": "llama"}}, {"tokenizer_config.json": {}}],
                         ids=["model-dir-without-tokenizer", "tokenizer-config-only"])
@pytest.mark.parametrize("flag", ["--tokenizer", "--model"])
def test_a_directory_without_a_tokenizer_exits_2_in_one_line(tmp_path, files, flag):
    """Before: the ValueError transformers raised ran over five lines, the last of them about sentencepiece."""
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    run = _start(flag, str(tmp_path))
    last = run.stderr.rstrip().splitlines()[-1]
    assert run.returncode == 2, run.stderr
    assert "cannot start: " in last and f"{flag} '{tmp_path}': cannot load a tokenizer" in last, run.stderr


@pytest.mark.parametrize("flag", ["--max-body-bytes", "--max-prompts-per-request"])
def test_a_limit_of_zero_exits_2_naming_the_flag(flag):
    run = _start(flag, "0")
    assert run.returncode == 2, run.stderr
    assert f"{flag} 0: must be > 0" in run.stderr.rstrip().splitlines()[-1], run.stderr
