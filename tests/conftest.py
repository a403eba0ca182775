"""Shared fixtures: the `tiny` preset in float32 and bfloat16, built once per session.

The session models are shared: tests must never change their weights and must remove
any hook they register (use the `forward_inputs` fixture, which cleans up after itself).
Tests that need to mutate weights load their own copy (`load_model` of `tiny` is ~0.2 s).

The decode and prefill servers the tests start through bench/measure/launch.py (support.servers, the benches run
in process) or support.faultkit are forked from a fork server that imported them once (support/forked.py says
why and what still starts `python -m`); KVT_TEST_SPAWN=1 spawns each as a fresh interpreter instead.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from bench.measure import launch

from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model

DTYPES = ("float32", "bfloat16")
PROMPT_LEN = 24


@pytest.fixture(scope="session", autouse=True)
def _forked_servers():
    from support import forked
    with mock.patch.object(launch, "spawn", forked.spawn):
        yield


@pytest.fixture(scope="session")
def _tiny_cache() -> dict:
    return {}


def _tiny(cache: dict, dtype: str):
    if dtype not in cache:
        cache[dtype] = load_model(ModelSpec("tiny", dtype=dtype, seed=0))
    return cache[dtype]


@pytest.fixture(scope="session")
def tiny_fp32(_tiny_cache):
    """`tiny` preset, seed 0, float32, CPU, eval mode."""
    return _tiny(_tiny_cache, "float32")


@pytest.fixture(scope="session")
def tiny_bf16(_tiny_cache):
    """`tiny` preset, seed 0, bfloat16, CPU, eval mode."""
    return _tiny(_tiny_cache, "bfloat16")


@pytest.fixture(params=DTYPES)
def tiny_model(request, _tiny_cache):
    """The session `tiny` model, once per dtype (float32 and bfloat16)."""
    return _tiny(_tiny_cache, request.param)


@pytest.fixture(scope="session")
def prompt() -> torch.Tensor:
    """(1, PROMPT_LEN) reproducible token ids valid for `tiny` (vocab 512)."""
    return random_prompt(512, PROMPT_LEN, seed=1234)


@pytest.fixture
def forward_inputs():
    """Factory: `forward_inputs(model)` returns a list that records the input length
    (`input_ids.shape[-1]`) of every call of `model.model` (the decoder stack, one call
    per prefill or decode step). Hooks are removed at teardown."""
    handles = []

    def attach(model) -> list[int]:
        seen: list[int] = []

        def pre_hook(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            seen.append(int(ids.shape[-1]))

        handles.append(model.model.register_forward_pre_hook(pre_hook, with_kwargs=True))
        return seen

    yield attach
    for h in handles:
        h.remove()
