"""GPU-only checks of the core (run on the device machine: `make gpu-test`)."""

from __future__ import annotations

import warnings

import pytest
import torch

from bench.measure.reference_decode import decode
from kvtransfer.determinism import enable_deterministic
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model, weights_fingerprint
from kvtransfer.model.streaming import assemble_cache, cache_layers, caches_equal
from support.generate import colocated_generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def smollm():
    enable_deterministic()
    return load_model(ModelSpec("smollm2-135m", "bfloat16"), "cuda")


def test_seeded_weights_reproducible_on_gpu(smollm):
    again = load_model(ModelSpec("smollm2-135m", "bfloat16"), "cuda")
    assert weights_fingerprint(again) == weights_fingerprint(smollm)


@pytest.mark.parametrize("length", [1, 300, 4096])
def test_assembled_cache_decodes_bit_identical_on_gpu(smollm, length):
    ids = random_prompt(smollm.config.vocab_size, length, seed=length, device="cuda")
    cache, first = prefill(smollm, ids)
    moved = [(k.clone(), v.clone()) for k, v in cache_layers(cache)]
    ref, _ = colocated_generate(smollm, ids, 8)
    got = decode(smollm, assemble_cache(smollm.config, moved), first, 8, prompt_len=length)
    assert got.tokens == ref.tokens
    assert torch.equal(got.logits, ref.logits)


def _syncs_during(fn) -> int:
    """How many synchronizing CUDA calls `fn` made (torch's sync debug mode, as warnings)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_layer_callback_never_syncs_the_host(smollm):
    """The hook path (event record + side-stream hand-off) adds no device sync per layer."""
    ids = random_prompt(smollm.config.vocab_size, 512, seed=1, device="cuda")
    prefill(smollm, ids)  # warm-up outside the count
    side = torch.cuda.Stream()
    sums = []

    def on_layer(i, k, v):
        ev = torch.cuda.Event()
        ev.record()
        side.wait_event(ev)
        with torch.cuda.stream(side):
            sums.append(k.float().sum())

    plain = _syncs_during(lambda: prefill(smollm, ids))
    hooked = _syncs_during(lambda: prefill(smollm, ids, on_layer=on_layer))
    assert len(sums) == smollm.config.num_hidden_layers
    assert hooked == plain, f"the hook added {hooked - plain} synchronizing calls"
    cache, logits = prefill(smollm, ids, on_layer=on_layer)
    ref_cache, ref_logits = prefill(smollm, ids)
    assert torch.equal(logits, ref_logits)
    assert caches_equal(cache_layers(cache), cache_layers(ref_cache))
