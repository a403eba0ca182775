"""`--gemv auto|on|off`: which batch-1 projections run the Triton GEMV (kvtransfer/engine/runner.py).

Why a flag: `auto` times the GEMV against cuBLAS at start and keeps it where it is >= 5% faster; near that margin
the timing flips from one start to the next (gate_up, o and lm_head did over 45 starts on one H100 and one H200), so
two servers with the same flags could run other kernels and give other bits (the ttft bench's colocated and
disaggregated decode servers did: bench/results/accept-h100-2026-12-06, call 3). `on` and `off` pin the choice.
"""

from __future__ import annotations

import pytest
import torch

from decode_server.config import DecodeConfig
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import PROJECTIONS, StepRunner
from kvtransfer.geometry import CacheGeometry
from kvtransfer.kernels import ops
from kvtransfer.model.loaded import load_model
from kvtransfer.model.spec import ModelSpec
from kvtransfer.rpc.configargs import from_args


@pytest.fixture(scope="module")
def model():
    return load_model(ModelSpec("tiny", "float32"))


def runner(model, **kw) -> StepRunner:
    geom = CacheGeometry.from_config(model.config, torch.float32)
    return StepRunner(model, KVPool(geom, torch.device("cpu"), slots=2, max_seq=32), **kw)


def test_on_and_off_pin_every_projection_without_timing(model):
    # use_triton forced: the choice is made as on a GPU, and no timing runs (it would need CUDA here)
    assert runner(model, use_triton=True, gemv="on").gemv_rows == dict.fromkeys(PROJECTIONS, ops.GEMV_MAX_ROWS)
    assert runner(model, use_triton=True, gemv="off").gemv_rows == dict.fromkeys(PROJECTIONS, 0)
    assert runner(model, use_triton=True, gemv="on", gemv_rows=0).gemv_rows == dict.fromkeys(PROJECTIONS, 0)


def test_no_gemv_without_triton(model):
    assert runner(model, use_triton=False, gemv="on").gemv_rows == dict.fromkeys(PROJECTIONS, 0)


def test_a_bad_choice_names_the_flag(model, capsys):
    with pytest.raises(ValueError, match="--gemv 'fast'"):
        runner(model, gemv="fast")
    with pytest.raises(SystemExit) as e:
        from_args(DecodeConfig, ["--colocated", "--gemv", "fast"], "")
    assert e.value.code == 2 and "--gemv" in capsys.readouterr().err
    assert DecodeConfig().gemv == "auto"
