"""Cases a mutation pass over the model layer found untested: kvtransfer/geometry.py (what a cache costs and the
digest both workers compare), kvtransfer/model/spec.py (the checks on a local directory, the seeded weights, the
fingerprint), kvtransfer/model/loaded.py (`load`), kvtransfer/model/prefill.py and streaming.py (the HF path of
the prefill, its callback and block, the cache digest), fused_prefill.py, decoder_stack.py and fused.py (which
models and caches take the fused path, the o_proj bias, a fusion done twice or after the weights moved). Each
test here failed on a one-line change of that code that the model, geometry, streaming, fused prefill, chunked
prefill, model directory, engine and mixed-batch tests let through; its docstring names the change it kills.

Why these paths went unseen: every existing streaming test takes the fused path (the default), so the HF path's
StreamingCache block and its `on_layer` switch-off were never looked at; the presets all carry `head_dim` and
`num_key_value_heads`, no bias on o_proj and tensors far below the fingerprint's 2**24-element chunk; the broken
directories were all broken grossly (half a file, no config.json); and the fusion was only ever asked again after a
weight was rebound, not after its cache entry was gone, a load_state_dict or a bias rebound alone. Some cases
guard a path no HF config of a supported model reaches today (a config without num_key_value_heads, a
multimodal text config, a window named but unused): the code handles them on purpose, so they are pinned too.

Everything here is the `tiny` preset, small HF models of its size, or hand-built configs, tensors and files (the
largest a 32 MiB tensor), on CPU: the file runs in seconds on 2 cores, the same way every time.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from kvtransfer.geometry import CacheGeometry
from kvtransfer.model import fused
from kvtransfer.model import loaded as loaded_mod
from kvtransfer.model.fused import UnsupportedModel, check_supported, fused_layers
from kvtransfer.model.prefill import logits_digest, prefill, random_prompt
from kvtransfer.model.spec import (
    ModelSpec,
    _check_config_json,
    _check_safetensors_file,
    _seeded_init_,
    load_model,
    weights_fingerprint,
)
from kvtransfer.model.streaming import cache_digest, cache_layers, caches_equal, same_bytes
from kvtransfer.transport.layout import kv_pair_view
from tests.test_engine import tiny_qwen2

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128}


def hf_model(cfg, seed: int = 1):
    """A small HF model from `cfg`, seeded as the presets are, in eval mode."""
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    _seeded_init_(model, seed)
    return model


def fused_equals_hf(model, n: int = 21, seed: int = 5) -> bool:
    """The fused prefill's cache and logits are the HF forward's, byte for byte (CPU)."""
    ids = random_prompt(model.config.vocab_size, n, seed=seed)
    cache, logits = prefill(model, ids)
    hf_cache, hf_logits = prefill(model, ids, fused=False)
    return same_bytes(logits, hf_logits) and caches_equal(cache_layers(cache), cache_layers(hf_cache))


# --- kvtransfer/geometry.py ---

def test_geometry_of_a_config_without_head_dim_or_kv_heads():
    """Caught: the fallback `or text.num_attention_heads` for a config without num_key_value_heads -> `or 1` (an MHA
    model's cache sized for one head)."""
    cfg = SimpleNamespace(num_hidden_layers=3, hidden_size=96, num_attention_heads=6)
    g = CacheGeometry.from_config(cfg, torch.float16)
    assert (g.num_layers, g.kv_heads, g.head_dim) == (3, 6, 16)
    cfg.num_key_value_heads = 2
    g = CacheGeometry.from_config(cfg, torch.float16)
    assert (g.num_layers, g.kv_heads, g.head_dim) == (3, 2, 16)


def test_geometry_reads_a_multimodal_configs_text_decoder():
    """Caught: `get_text_config(decoder=True)` skipped (`text = config`: a config whose decoder fields live in its text
    config, as a vision-language model's do, had no layers or heads to read)."""
    text = SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=32)
    outer = SimpleNamespace(get_text_config=lambda decoder=False: text if decoder else None)
    assert CacheGeometry.from_config(outer, torch.bfloat16) == CacheGeometry(2, 1, 32, torch.bfloat16)


def test_geometry_digest_changes_with_each_field_alone():
    """Caught: head_dim or kv_heads dropped from the digest string (two workers whose caches differ in one of them
    passed the handshake; the presets differ in every field at once, so the existing test could not tell)."""
    base = CacheGeometry(4, 2, 16, torch.bfloat16)
    others = [CacheGeometry(5, 2, 16, torch.bfloat16), CacheGeometry(4, 4, 16, torch.bfloat16),
              CacheGeometry(4, 2, 32, torch.bfloat16), CacheGeometry(4, 2, 16, torch.float16)]
    assert len({g.digest() for g in [base, *others]}) == 5


# --- kvtransfer/model/spec.py: a local directory's config.json and safetensors ---

def _config_dir(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_config_architectures_as_a_string_or_mixed_list(tmp_path):
    """Caught: `archs = [archs] if isinstance(archs, str) else list(archs)` -> `list(archs)` (a string split into
    letters, a causal LM refused); `any(not ...ForCausalLM)` -> `all(...)` (a list naming a non-causal head passed)."""
    _check_config_json(_config_dir(tmp_path, {"model_type": "llama", "architectures": "LlamaForCausalLM"}))
    _check_config_json(_config_dir(tmp_path, {"model_type": "llama"}))  # no architectures: the model type decides
    d = _config_dir(tmp_path, {"model_type": "llama",
                               "architectures": ["LlamaForCausalLM", "LlamaForSequenceClassification"]})
    with pytest.raises(ValueError, match="LlamaForSequenceClassification.*not supported"):
        _check_config_json(d)


def test_config_without_model_type_is_one_clear_error(tmp_path):
    """Caught: `or not cfg.get("model_type")` dropped (a KeyError traceback instead of the one-line refusal)."""
    d = _config_dir(tmp_path, {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="names no model_type"):
        _check_config_json(d)


def test_safetensors_short_by_one_byte_or_without_a_header_is_truncated(tmp_path):
    """Caught: `8 + n + end > size` -> `n + end > size` (a file short by up to 8 bytes passed the check);
    data_offsets[1] -> [0] (the last tensor's end taken as its start); `len(head) < 8` -> `< 1` (a stub of a few
    bytes reported as a header that claims some length instead of 'not even a header')."""
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3)}, str(tmp_path / "w.safetensors"))
    _check_safetensors_file(str(tmp_path), "w.safetensors")  # whole: passes
    path = tmp_path / "w.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(ValueError, match=rf"w.safetensors is truncated \({len(data) - 1:,} of {len(data):,} bytes\)"):
        _check_safetensors_file(str(tmp_path), "w.safetensors")
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"truncated \(5 bytes, not even a header\)"):
        _check_safetensors_file(str(tmp_path), "w.safetensors")


# --- kvtransfer/model/spec.py: seeded weights and the fingerprint ---

def test_seeded_weights_have_the_documented_scales(tiny_fp32):
    """Caught: fan_in `p.shape[-1]` -> `p.shape[0]` (gate/up/down drawn at their fan-out's scale); the embedding's
    1.0 -> fan_in ** -0.5; a bias's N(0, 0.02) -> N(0, 1). Random weights at the wrong scale still run, but their
    activations and logits no longer resemble a real model's."""
    for name, p in tiny_fp32.named_parameters():
        if p.dim() != 2:
            continue
        want = 1.0 if "embed" in name else p.shape[-1] ** -0.5
        assert abs(p.float().std().item() / want - 1) < 0.1, (name, p.float().std().item(), want)
    qwen = tiny_qwen2()
    biases = {n: p for n, p in qwen.named_parameters() if n.endswith(".bias")}
    assert biases and all(0.01 < p.std().item() < 0.04 for p in biases.values()), {
        n: p.std().item() for n, p in biases.items()}


def _one_weight(t: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(t, requires_grad=False)
    return m


def test_fingerprint_sees_a_swap_across_its_chunk_boundary():
    """Caught: the position weights `arange(start, start + n)` -> `arange(0, n)` (restarted in every 2**24-element
    chunk: element 0 and element 2**24 swapped went unseen; real models' embeddings span dozens of chunks)."""
    n = (1 << 24) + 8
    a = torch.zeros(n, dtype=torch.bfloat16)
    b = torch.zeros(n, dtype=torch.bfloat16)
    a[0] = 1.0
    b[1 << 24] = 1.0
    assert weights_fingerprint(_one_weight(a)) != weights_fingerprint(_one_weight(b))


def test_fingerprint_sees_the_shape():
    """Caught: the shape dropped from each tensor's entry (the same bits laid out as another shape, another model,
    fingerprinted alike)."""
    t = torch.arange(32, dtype=torch.float32)
    assert weights_fingerprint(_one_weight(t.reshape(4, 8))) != weights_fingerprint(_one_weight(t.reshape(8, 4)))


# --- kvtransfer/model/loaded.py ---

def test_load_builds_the_geometry_in_the_specs_dtype_and_switches_determinism_on_only_when_asked(monkeypatch):
    """Caught: the geometry built with float32 instead of spec.torch_dtype (a bfloat16 model's cache sized at 4
    bytes an element); `if deterministic:` inverted."""
    calls = []
    monkeypatch.setattr(loaded_mod, "enable_deterministic", lambda: calls.append(1))
    lm = loaded_mod.load(ModelSpec("tiny", "bfloat16"), torch.device("cpu"), deterministic=False)
    assert lm.geometry == CacheGeometry(4, 2, 16, torch.bfloat16) and calls == []
    assert loaded_mod.load(ModelSpec("tiny", "float32"), torch.device("cpu"), deterministic=True).geometry.dtype \
        is torch.float32
    assert calls == [1]


# --- kvtransfer/model/prefill.py and streaming.py: the HF path ---

def test_logits_digest_tells_dtypes_apart():
    """Caught: the dtype dropped from the digest (bfloat16 and float16 logits of the same bytes digested alike)."""
    x = torch.randn(16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert logits_digest(x) != logits_digest(x.view(torch.float16))
    assert logits_digest(x) == logits_digest(x.clone())


def test_random_prompt_avoids_the_special_ids():
    """Caught: `randint(3, vocab)` -> `randint(0, vocab)` (ids 0..2, often bos/eos/pad, in a benchmark prompt)."""
    ids = random_prompt(6, 600, seed=3)
    assert ids.shape == (1, 600) and int(ids.min()) == 3 and int(ids.max()) == 5


def test_hf_prefill_streams_each_layer_from_the_block_then_switches_the_callback_off(tiny_fp32, prompt):
    """Caught, on the HF path (`fused=False`; the existing tests stream through the fused path only):
    `cache.on_layer = None` in the finally dropped (the next decode step would reach the transport); the first
    update's `not layer.is_initialized` inverted (K and V not written into the one block: not adjacent, one message
    per tensor); `cache.on_layer = on_layer` -> None (no layer streamed)."""
    seen = []
    cache, logits = prefill(tiny_fp32, prompt, on_layer=lambda i, k, v: seen.append((i, k, v)), fused=False)
    assert cache.on_layer is None
    assert [i for i, _, _ in seen] == list(range(tiny_fp32.config.num_hidden_layers))
    assert cache.block is not None
    for (i, k, v), (ck, cv) in zip(seen, cache_layers(cache)):
        assert k.data_ptr() == ck.data_ptr() == cache.block[i, 0].data_ptr()
        assert v.data_ptr() == cv.data_ptr() == cache.block[i, 1].data_ptr() and kv_pair_view(k, v) is not None
    fused_cache, fused_logits = prefill(tiny_fp32, prompt)
    assert same_bytes(logits, fused_logits) and caches_equal(cache_layers(cache), cache_layers(fused_cache))


def test_hf_prefill_passes_the_cache_by_its_current_name(tiny_fp32, prompt):
    """Caught: cache_kwarg always `past_key_values` (transformers 5.25 still takes it, with a FutureWarning on every
    prefill, and drops it in 5.40)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        prefill(tiny_fp32, prompt, fused=False)
    assert not [w for w in seen if "past_key_values" in str(w.message)]


def test_a_later_chunk_streams_the_whole_cache_so_far(tiny_fp32, prompt):
    """Caught: the callback handed `key_states, value_states` (this chunk's K/V only) instead of what `update`
    returns (the whole cache so far, as prefill's docstring says and the engine's chunked landing slices)."""
    cache, _ = prefill(tiny_fp32, prompt[:, :10])
    seen = []
    cache, _ = prefill(tiny_fp32, prompt[:, 10:], on_layer=lambda i, k, v: seen.append((k, v)), cache=cache)
    assert len(seen) == tiny_fp32.config.num_hidden_layers
    for (k, v), (ck, cv) in zip(seen, cache_layers(cache)):
        assert k.shape[2] == v.shape[2] == prompt.shape[1]
        assert torch.equal(k, ck) and torch.equal(v, cv)


def test_cache_digest_covers_values_and_shapes():
    """Caught: only K digested (`for t in (k, v)` -> `(k,)`); the shape dropped (the same bytes as another
    (heads, seq) split digested alike)."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g)
    base = cache_digest([(k, v)])
    v2 = v.clone()
    v2[0, 1, 5, 3] += 1
    assert cache_digest([(k, v2)]) != base
    assert cache_digest([(k.reshape(1, 6, 2, 4), v.reshape(1, 6, 2, 4))]) != base
    assert cache_digest([(k.clone(), v.clone())]) == base


# --- kvtransfer/model/fused_prefill.py and decoder_stack.py ---

def test_a_sliding_window_model_at_its_window_runs_the_hf_forward():
    """Caught: the `type(layer) is not DynamicLayer` fallback dropped: a Mistral prompt as long as its window passes
    `supports`, and the fused path then filled sliding-window cache layers as plain ones (all n tokens, where HF
    keeps window - 1, and no cumulative length for the decode steps)."""
    model = hf_model(MistralConfig(**SMALL, sliding_window=16))
    assert fused_equals_hf(model, n=16)


def test_fused_prefill_applies_the_o_proj_bias():
    """Caught: run_layers passing `None` for w.o_bias (a Llama with attention_bias=True has a bias on o_proj too;
    the Qwen2 case only has q/k/v biases)."""
    model = hf_model(LlamaConfig(**SMALL, attention_bias=True))
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert fused_equals_hf(model)


# --- kvtransfer/model/fused.py ---

def test_check_supported_refuses_mlp_bias_and_gelu_and_honours_use_sliding_window():
    """Caught: the mlp_bias check dropped; the hidden_act check dropped; `and uses_window` dropped (a config that
    names a window it does not use refused; transformers 5 clears Qwen2's window then, older ones keep it)."""
    with pytest.raises(UnsupportedModel, match="mlp_bias"):
        check_supported(LlamaConfig(**SMALL, mlp_bias=True), 64)
    with pytest.raises(UnsupportedModel, match="gelu"):
        check_supported(LlamaConfig(**SMALL, hidden_act="gelu"), 64)
    check_supported(SimpleNamespace(model_type="qwen2", sliding_window=16, use_sliding_window=False), 64)
    with pytest.raises(UnsupportedModel, match="sliding window"):
        check_supported(SimpleNamespace(model_type="qwen2", sliding_window=16, use_sliding_window=True), 64)


def test_fusing_again_reuses_the_fused_tensors():
    """Caught: `offset += t.numel()` dropped in _adjacent (a fusion asked again, by a new runner once the cache entry
    is gone, copied every layer's weights again instead of finding them already fused)."""
    model = load_model(ModelSpec("tiny", "float32", 0))
    first = fused_layers(model)
    ptrs = [(w.qkv.data_ptr(), w.gate_up.data_ptr()) for w in first]
    del fused._FUSED[model]
    again = fused_layers(model)
    assert again is not first
    assert [(w.qkv.data_ptr(), w.gate_up.data_ptr()) for w in again] == ptrs


def test_fused_weights_follow_an_in_place_load_and_a_rebound_bias():
    """Caught: the modules' weights or biases not rebound as views of the fused tensor (`m.weight.data = ...` or
    `m.bias.data = ...` dropped: a load_state_dict then reached HF's copy only, the fused prefill kept the old
    weights); `_fuse` reusing adjacent weights without checking the biases (a bias rebound alone was lost)."""
    model = tiny_qwen2()
    assert fused_equals_hf(model)  # fused now
    other = tiny_qwen2()
    _seeded_init_(other, 11)
    model.load_state_dict(other.state_dict())  # copied in place: same storages, no new fusion
    assert fused_equals_hf(model)
    b = model.model.layers[1].self_attn.q_proj.bias
    b.data = b.data.clone() + 0.5  # rebound alone: the weights stay adjacent, the biases no longer
    assert fused_equals_hf(model)
