"""Streaming cache and the reference halves (prefill / decode), float32 and bfloat16.

The invariant: a cache assembled from the layers the prefill callback saw decodes to the
same tokens and the same logits, bit for bit, as the colocated run, without re-running
prefill.
"""

from __future__ import annotations

import pytest
import torch

from bench.measure.reference_decode import decode
from kvtransfer.model.prefill import prefill
from kvtransfer.model.streaming import (
    StreamingCache,
    assemble_cache,
    cache_layers,
    caches_equal,
    same_bytes,
)
from kvtransfer.transport.layout import kv_pair_view
from support.generate import colocated_generate

STEPS = 8


def record_prefill(model, prompt):
    """Prefill with a callback that records every call; returns (cache, first_logits, calls)."""
    calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    cache, first = prefill(model, prompt, on_layer=lambda i, k, v: calls.append((i, k, v)))
    return cache, first, calls


def clone_layers(layers):
    return [(k.clone(), v.clone()) for k, v in layers]


# ---------------------------------------------------------------- prefill callback

def test_callback_sees_every_layer_once_in_order(tiny_model, prompt):
    cfg = tiny_model.config
    cache, first, calls = record_prefill(tiny_model, prompt)
    assert isinstance(cache, StreamingCache)
    assert [i for i, _, _ in calls] == list(range(cfg.num_hidden_layers))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    want = (1, cfg.num_key_value_heads, prompt.shape[1], head_dim)
    for i, k, v in calls:
        assert tuple(k.shape) == tuple(v.shape) == want, i
        assert k.dtype == v.dtype == tiny_model.dtype
        pair = kv_pair_view(k, v)
        assert pair is not None, f"layer {i}: K and V are not adjacent"
        assert pair.shape == (2, *want)
        assert torch.equal(pair[0], k) and torch.equal(pair[1], v)
    assert first.shape == (cfg.vocab_size,)
    assert cache.get_seq_length() == prompt.shape[1]


def test_callback_tensors_are_the_cache(tiny_model, prompt):
    """What the callback sees is what the cache holds: same memory, in the shared block."""
    cache, _, calls = record_prefill(tiny_model, prompt)
    layers = cache_layers(cache)
    assert cache.block is not None
    assert cache.block.shape == (len(layers), 2, *layers[0][0].shape)
    for (i, k, v), (ck, cv) in zip(calls, layers):
        assert k.data_ptr() == ck.data_ptr() == cache.block[i, 0].data_ptr()
        assert v.data_ptr() == cv.data_ptr() == cache.block[i, 1].data_ptr()
    # consecutive layers are adjacent too (one message per group of layers)
    for i in range(1, len(layers)):
        assert layers[i][0].data_ptr() == layers[i - 1][1].data_ptr() + layers[i - 1][1].nbytes


def test_callback_off_after_prefill_and_never_called_by_decode(tiny_model, prompt):
    cache, first, calls = record_prefill(tiny_model, prompt)
    n_layers = tiny_model.config.num_hidden_layers
    assert cache.on_layer is None
    assert len(calls) == n_layers
    gen = decode(tiny_model, cache, first, STEPS)  # colocated path: decode the StreamingCache
    assert len(gen.tokens) == STEPS
    assert len(calls) == n_layers  # no decode step reached the callback
    assert cache.get_seq_length() == prompt.shape[1] + STEPS - 1


def test_callback_off_even_when_prefill_fails(tiny_model, prompt, monkeypatch):
    seen: list[StreamingCache] = []
    orig_init = StreamingCache.__init__

    def spy_init(self, *a, **kw):
        orig_init(self, *a, **kw)
        seen.append(self)

    monkeypatch.setattr(StreamingCache, "__init__", spy_init)

    def boom(i, k, v):
        raise KeyError("transport down")

    with pytest.raises(KeyError, match="transport down"):
        prefill(tiny_model, prompt, on_layer=boom)
    assert len(seen) == 1 and seen[0].on_layer is None


def test_kv_pair_view_none_when_not_adjacent():
    k = torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 4)
    assert kv_pair_view(k, v) is None
    block = torch.randn(2, 1, 2, 5, 4)
    assert kv_pair_view(block[0], block[1]) is not None
    assert kv_pair_view(block[1], block[0]) is None  # wrong order
    assert kv_pair_view(block[0], block[1].to(torch.bfloat16)) is None
    wide = torch.randn(1, 2, 10, 4)
    assert kv_pair_view(wide[:, :, :5], wide[:, :, 5:]) is None  # not contiguous


# ---------------------------------------------------------------- assemble + decode == colocated

def test_assembled_cache_decodes_bit_identical_to_colocated(tiny_model, prompt):
    ref, ref_cache = colocated_generate(tiny_model, prompt, STEPS)
    cache, first, calls = record_prefill(tiny_model, prompt)
    received = [(k.clone(), v.clone()) for _, k, v in calls]  # what a transport would deliver
    for (k, v), (ck, cv) in zip(received, cache_layers(cache)):
        assert k.data_ptr() != ck.data_ptr()  # really copies
    assembled = assemble_cache(tiny_model.config, received)
    assert caches_equal(cache_layers(assembled), cache_layers(cache))

    gen = decode(tiny_model, assembled, first.clone(), STEPS)
    assert len(gen.tokens) == STEPS
    assert gen.tokens == ref.tokens
    assert gen.logits.shape == ref.logits.shape == (STEPS, tiny_model.config.vocab_size)
    assert gen.logits.dtype == ref.logits.dtype == tiny_model.dtype
    assert torch.equal(gen.logits, ref.logits)
    assert gen.logits_digests() == ref.logits_digests()
    # the two final caches agree too
    assert assembled.get_seq_length() == ref_cache.get_seq_length() == prompt.shape[1] + STEPS - 1
    assert caches_equal(cache_layers(assembled), cache_layers(ref_cache))


def test_assemble_cache_holds_given_tensors_without_copy(tiny_model, prompt):
    cache, _, _ = record_prefill(tiny_model, prompt)
    received = clone_layers(cache_layers(cache))
    assembled = assemble_cache(tiny_model.config, received)
    assert assembled.get_seq_length() == prompt.shape[1]
    for (k, v), (ak, av) in zip(received, cache_layers(assembled)):
        assert ak is k and av is v


def test_decode_does_not_rerun_prefill(tiny_model, prompt, forward_inputs):
    cache, first, calls = record_prefill(tiny_model, prompt)
    assembled = assemble_cache(tiny_model.config, clone_layers(cache_layers(cache)))
    seen = forward_inputs(tiny_model)
    decode(tiny_model, assembled, first, STEPS)
    assert seen == [1] * (STEPS - 1)  # one forward of exactly one token per later token


def test_colocated_runs_prefill_once_then_single_tokens(tiny_model, prompt, forward_inputs):
    seen = forward_inputs(tiny_model)
    colocated_generate(tiny_model, prompt, STEPS)
    # the fused prefill (kvtransfer/model/fused_prefill.py) runs no HF forward; decoding is one token per forward
    assert seen == [1] * (STEPS - 1)


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_cache_length_after_decode(tiny_model, prompt, steps):
    cache, first, _ = record_prefill(tiny_model, prompt)
    assembled = assemble_cache(tiny_model.config, clone_layers(cache_layers(cache)))
    gen = decode(tiny_model, assembled, first, steps)
    assert len(gen.tokens) == steps and gen.logits.shape[0] == steps
    assert gen.tokens[0] == int(first.argmax())
    assert assembled.get_seq_length() == prompt.shape[1] + steps - 1


def test_decode_one_token_is_first_logits(tiny_model, prompt):
    cache, first, _ = record_prefill(tiny_model, prompt)
    gen = decode(tiny_model, cache, first, 1)
    assert torch.equal(gen.logits[0], first)


@pytest.mark.parametrize("n", [0, -1])
def test_decode_rejects_no_tokens(tiny_model, prompt, n):
    cache, first, _ = record_prefill(tiny_model, prompt)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(tiny_model, cache, first, n)
    assert cache.get_seq_length() == prompt.shape[1]  # untouched


# ---------------------------------------------------------------- decode length check

def _tamper_hook(model, mutate):
    """Forward pre-hook on the decoder stack that rewrites each call's kwargs."""

    def hook(_module, args, kwargs):
        return args, mutate(dict(kwargs))

    return model.model.register_forward_pre_hook(hook, with_kwargs=True)


def test_decode_raises_when_cache_grows_too_much(tiny_model, prompt):
    """A decode step that silently re-runs the prompt makes the cache longer than expected."""
    cache, first, _ = record_prefill(tiny_model, prompt)
    assembled = assemble_cache(tiny_model.config, clone_layers(cache_layers(cache)))

    def rerun_prompt(kw):
        kw["input_ids"] = torch.cat([prompt, kw["input_ids"]], dim=1)
        return kw

    handle = _tamper_hook(tiny_model, rerun_prompt)
    try:
        with pytest.raises(RuntimeError, match="expected"):
            decode(tiny_model, assembled, first, 3)
    finally:
        handle.remove()
    assert assembled.get_seq_length() == 2 * prompt.shape[1] + 1


def test_decode_raises_when_cache_gains_an_extra_token(tiny_model, prompt):
    cache, first, _ = record_prefill(tiny_model, prompt)
    assembled = assemble_cache(tiny_model.config, clone_layers(cache_layers(cache)))

    def two_tokens(kw):
        kw["input_ids"] = kw["input_ids"].repeat(1, 2)
        return kw

    handle = _tamper_hook(tiny_model, two_tokens)
    try:
        with pytest.raises(RuntimeError, match=rf"{prompt.shape[1] + 2} tokens .* expected {prompt.shape[1] + 1}"):
            decode(tiny_model, assembled, first, 4)
    finally:
        handle.remove()


def test_decode_raises_when_cache_loses_tokens(tiny_model, prompt):
    cache, first, _ = record_prefill(tiny_model, prompt)
    assembled = assemble_cache(tiny_model.config, clone_layers(cache_layers(cache)))

    def drop_last(kw):
        c = kw["cache"] if "cache" in kw else kw["past_key_values"]
        c.crop(-1)
        return kw

    handle = _tamper_hook(tiny_model, drop_last)
    try:
        with pytest.raises(RuntimeError, match="expected"):
            decode(tiny_model, assembled, first, 4)
    finally:
        handle.remove()


# ---------------------------------------------------------------- equality helpers

def test_caches_equal_detects_flipped_element_and_dtype(tiny_model, prompt):
    cache, _, _ = record_prefill(tiny_model, prompt)
    base = clone_layers(cache_layers(cache))
    assert caches_equal(base, cache_layers(cache))
    assert caches_equal(base, clone_layers(base))

    n = len(base)
    for layer in (0, n - 1):
        for kv in (0, 1):
            other = clone_layers(base)
            t = other[layer][kv]
            bits = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
            bits[bits.numel() // 2] ^= 1  # one bit of one element
            assert not caches_equal(base, other), (layer, kv)
            assert not caches_equal(other, base), (layer, kv)

    other_dtype = torch.float32 if tiny_model.dtype == torch.bfloat16 else torch.bfloat16
    changed = clone_layers(base)
    changed[1] = (changed[1][0].to(other_dtype), changed[1][1])
    assert not caches_equal(base, changed)
    changed = [(k.to(other_dtype), v.to(other_dtype)) for k, v in base]
    assert not caches_equal(base, changed)

    assert not caches_equal(base, base[:-1])  # missing layer
    assert not caches_equal(base, [(k[:, :, :-1], v[:, :, :-1]) for k, v in base])  # shorter


def test_same_bytes_is_bitwise():
    z = torch.zeros(4)
    assert not same_bytes(z, -z)  # -0.0 != +0.0 bitwise, although == numerically
    nan = torch.full((3,), float("nan"))
    assert same_bytes(nan, nan.clone())
    assert not same_bytes(torch.zeros(4), torch.zeros(2, 2))


@pytest.mark.parametrize("delta", [-1, 1])
def test_assemble_cache_wrong_layer_count(tiny_model, prompt, delta):
    cache, _, _ = record_prefill(tiny_model, prompt)
    layers = clone_layers(cache_layers(cache))
    bad = layers[:delta] if delta < 0 else layers + layers[:delta]
    with pytest.raises(ValueError, match="layers"):
        assemble_cache(tiny_model.config, bad)
    with pytest.raises(ValueError):
        assemble_cache(tiny_model.config, [])
