"""Every Triton kernel variant compiles for sm_90 (H200) on a machine without a GPU.

Why: GPU time is scarce and the interpreter does not check what the compiler accepts. Runs
tests/support/sm90_compile_check.py in its own process (it swaps Triton's driver).
Skipped without triton, under the interpreter, and where CUDA is present (the GPU tests
compile for real there).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the GPU tests compile for real"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiler, not the interpreter"),
]


def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    res = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "support", "sm90_compile_check.py")],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
