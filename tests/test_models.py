"""Model loading: preset shapes, seeded weights, fingerprints, local HF directories, errors."""

from __future__ import annotations

import os

import pytest
import torch

from kvtransfer.model.spec import (
    PRESETS,
    ModelNotFoundError,
    ModelSpec,
    load_config,
    load_model,
    weights_fingerprint,
)
from support.generate import colocated_generate

# ---------------------------------------------------------------- preset configs

# config.json of HuggingFaceTB/SmolLM2-135M and Qwen/Qwen2.5-7B (configs only: never instantiated here).
PUBLISHED = {
    "smollm2-135m": dict(model_type="llama", num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, hidden_size=576, vocab_size=49152,
                         intermediate_size=1536, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, hidden_size=3584, vocab_size=152064,
                       intermediate_size=18944, head_dim=128, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_config_has_published_shapes(name):
    config = load_config(name)
    for attr, want in PUBLISHED[name].items():
        assert getattr(config, attr) == want, f"{name}.{attr}"


def test_qwen_preset_uses_full_attention_on_every_layer():
    config = load_config("qwen2.5-7b")
    assert not config.use_sliding_window
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        assert layer_types == ["full_attention"] * 28


def test_presets_are_known_and_specs_do_not_instantiate():
    assert {"tiny", "smollm2-135m", "qwen2.5-7b"} <= set(PRESETS)
    # constructing a spec for a big preset only validates the name; nothing is built
    spec = ModelSpec("qwen2.5-7b")
    assert spec.torch_dtype is torch.bfloat16 and spec.seed == 0


# ---------------------------------------------------------------- tiny preset, seeded weights

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_loads_in_eval_mode_with_requested_dtype(dtype):
    model = load_model(ModelSpec("tiny", dtype=dtype))
    assert not model.training
    params = list(model.parameters())
    assert params and all(p.dtype == ModelSpec("tiny", dtype=dtype).torch_dtype for p in params)
    assert all(not p.requires_grad for p in params)
    assert model.config.num_hidden_layers == 4
    assert model.config.num_key_value_heads == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_seed_same_weights_other_seed_differs(dtype):
    a = load_model(ModelSpec("tiny", dtype=dtype, seed=0))
    b = load_model(ModelSpec("tiny", dtype=dtype, seed=0))
    c = load_model(ModelSpec("tiny", dtype=dtype, seed=1))
    fa, fb, fc = weights_fingerprint(a), weights_fingerprint(b), weights_fingerprint(c)
    assert fa == fb
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert fc != fa
    # every weight, the norms' included, actually depends on the seed
    assert all(not torch.equal(sa[k], sc[k]) for k in sa)


def test_norm_weights_are_seeded_near_one_and_differ_per_norm():
    """1 + N(0, 0.02), not HF's 1.0: with every norm weight 1, a test against the HF forward could not tell
    input_layernorm's weight from post_attention_layernorm's."""
    model = load_model(ModelSpec("tiny", "float32"))
    norms = {k: v for k, v in model.state_dict().items() if k.endswith("norm.weight")}
    assert len(norms) == 2 * model.config.num_hidden_layers + 1  # ln1 and ln2 of each layer, the final norm
    values = torch.cat(list(norms.values()))
    assert (values != 1.0).all() and (values - 1.0).abs().max() < 0.1
    assert abs(values.std().item() - 0.02) < 0.005
    for layer in model.model.layers:
        assert not torch.equal(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    # drawn on the CPU in float64: these bits on every machine and device (seen the same on an H200's CUDA build)
    assert model.model.layers[0].input_layernorm.weight[:3].tolist() == [1.0095640420913696, 0.9773878455162048,
                                                                         1.021064043045044]


def test_fingerprint_differs_between_dtypes(tiny_fp32, tiny_bf16):
    assert weights_fingerprint(tiny_fp32) != weights_fingerprint(tiny_bf16)


def test_fingerprint_is_stable_across_calls(tiny_fp32):
    assert weights_fingerprint(tiny_fp32) == weights_fingerprint(tiny_fp32)


@pytest.mark.parametrize("dtype,int_dtype", [("float32", torch.int32), ("bfloat16", torch.int16)])
@pytest.mark.parametrize("which", ["first", "last"])
def test_flipping_one_weight_bit_changes_fingerprint(dtype, int_dtype, which):
    model = load_model(ModelSpec("tiny", dtype=dtype))
    before = weights_fingerprint(model)
    p = model.model.layers[2].self_attn.k_proj.weight
    idx = 0 if which == "first" else p.numel() - 1
    with torch.no_grad():
        bits = p.data.view(-1).view(int_dtype)
        bits[idx] ^= 1  # lowest mantissa bit of one element
    assert weights_fingerprint(model) != before
    with torch.no_grad():
        bits[idx] ^= 1
    assert weights_fingerprint(model) == before


def test_swapping_two_weight_elements_changes_fingerprint():
    model = load_model(ModelSpec("tiny", dtype="float32"))
    before = weights_fingerprint(model)
    w = model.lm_head.weight.data.view(-1)
    assert w[3] != w[7]
    with torch.no_grad():
        w[3], w[7] = w[7].clone(), w[3].clone()
    assert weights_fingerprint(model) != before


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-7B", "HuggingFaceTB/SmolLM2-135M", "no-such-preset"])
def test_hub_id_raises_model_not_found_without_download(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # make sure no relative directory of that name exists
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="never downloads") as e:
        ModelSpec(name)
    assert name in str(e.value)
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        load_config(name)
    assert os.listdir(tmp_path) == []  # nothing was written (no hub cache, no partial files)


def test_model_not_found_is_a_value_error():
    assert issubclass(ModelNotFoundError, ValueError)


@pytest.mark.parametrize("dtype", ["int8", "float64", "bf", "", "torch.bfloat16"])
def test_bad_dtype_raises_value_error(dtype):
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec("tiny", dtype=dtype)


def test_dtype_aliases():
    assert ModelSpec("tiny", dtype="bf16").torch_dtype is torch.bfloat16
    assert ModelSpec("tiny", dtype="fp32").torch_dtype is torch.float32
    assert ModelSpec("tiny", dtype="fp16").torch_dtype is torch.float16


# ---------------------------------------------------------------- local HF directory

@pytest.fixture
def local_dir(tiny_fp32, tmp_path):
    tiny_fp32.save_pretrained(tmp_path)
    return tmp_path


def test_local_hf_directory_roundtrip(tiny_fp32, prompt, local_dir):
    files = os.listdir(local_dir)
    assert "config.json" in files
    assert any(f.endswith(".safetensors") for f in files)
    assert not any(f.endswith(".bin") for f in files)

    spec = ModelSpec(str(local_dir), dtype="float32")
    config = load_config(spec.name)
    for attr in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "hidden_size", "vocab_size"):
        assert getattr(config, attr) == getattr(tiny_fp32.config, attr), attr

    loaded = load_model(spec)
    assert not loaded.training
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert weights_fingerprint(loaded) == weights_fingerprint(tiny_fp32)
    sa, sb = tiny_fp32.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)

    ref, _ = colocated_generate(tiny_fp32, prompt, 6)
    got, _ = colocated_generate(loaded, prompt, 6)
    assert got.tokens == ref.tokens
    assert got.logits.dtype == ref.logits.dtype == torch.float32
    assert torch.equal(got.logits, ref.logits)


def test_local_hf_directory_logits_bit_identical_as_loaded(tiny_fp32, prompt, local_dir):
    loaded = load_model(ModelSpec(str(local_dir), dtype="float32"))
    ref, _ = colocated_generate(tiny_fp32, prompt, 6)
    got, _ = colocated_generate(loaded, prompt, 6)
    assert torch.equal(got.logits, ref.logits)


def test_local_hf_directory_weights_are_aligned(local_dir):
    """CPU GEMM results depend on 16-byte alignment; safetensors mmaps are only 8-byte aligned."""
    loaded = load_model(ModelSpec(str(local_dir), dtype="float32"))
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())
