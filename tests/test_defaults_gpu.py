"""On a GPU with no tuning flags: the servers start, say what they chose, and serve (run by `make gpu-test`).

Why here: the default GPU start once served nothing while reporting healthy (`--device auto` gave an
index-less `cuda` that the scheduler thread died of). Each accepted --device value is started for real.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from bench.measure.launch import ROOT, free_port, spawn, stop, wait_serving
from decode_server.client import generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPT = [1 + i % 500 for i in range(600)]  # longer than one 512-row mixed step; ids inside tiny's vocabulary


@pytest.mark.parametrize("device", [None, "auto", "cuda", "cuda:0"])
def test_a_colocated_start_with_no_tuning_flags_serves(tmp_path, device):
    addr, log = f"127.0.0.1:{free_port()}", str(tmp_path / "decode.log")
    proc = spawn("decode_server", ["--colocated", "--listen", addr, *(["--device", device] if device else [])], log)
    try:
        wait_serving(addr, [proc], timeout=240)
        got = asyncio.run(generate(addr, PROMPT, 16, timeout=120))
        assert len(got["tokens"]) == 16
        text = open(log).read()
        assert "engine defaults on cuda:0: dtype bfloat16 (auto); prefill: mixed steps of up to 512 rows" in text, text[-3000:]
    finally:
        stop([proc])
    assert proc.returncode == 0, open(log).read()[-3000:]


def test_the_pair_on_one_gpu_with_defaults_serves(tmp_path):
    """Two processes on cuda:0 over cuda_ipc (NCCL refuses two ranks on one GPU); the decode side leaves the
    prefill worker its share of the memory."""
    p_addr, d_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [spawn("prefill_server", ["--transport", "cuda_ipc", "--listen", p_addr], str(tmp_path / "prefill.log")),
             spawn("decode_server", ["--transport", "cuda_ipc", "--listen", d_addr, "--prefill-addr", p_addr,
                                     "--gpu-memory-utilization", "0.6"], str(tmp_path / "decode.log"))]
    try:
        wait_serving(d_addr, procs, timeout=240)
        got = asyncio.run(generate(d_addr, PROMPT, 16, timeout=120))
        assert len(got["tokens"]) == 16 and got["timing"]["mode"] != "colocated"
    finally:
        stop(procs)


def test_a_cuda_device_that_does_not_exist_exits_2_naming_the_flag(tmp_path):
    missing = f"cuda:{torch.cuda.device_count()}"
    for module in ("decode_server", "prefill_server"):
        out = subprocess.run([sys.executable, "-m", module, "--device", missing, "--listen", f"127.0.0.1:{free_port()}",
                              *(["--colocated"] if module == "decode_server" else [])],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
        assert out.returncode == 2 and f"--device {missing}" in out.stderr + out.stdout, out.stderr[-2000:]
