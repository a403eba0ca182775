"""The fused prefill (kvtransfer/model/fused_prefill.py) against the HF forward it replaces, on CPU.

Why: both servers prefill through it, so the colocated == disaggregated guarantee rests on it being
one deterministic function; on CPU its reference ops mirror HF's eager math, so it must equal
the HF forward byte for byte there (cache and logits), and hand each finished layer to the
streaming callback once, in order, as StreamingCache does. Models it cannot run fall back to HF.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from bench.measure.reference_decode import decode
from kvtransfer.model import fused_prefill as fp
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, _seeded_init_, load_model
from kvtransfer.model.streaming import cache_layers, caches_equal, same_bytes
from tests.test_engine import tiny_qwen2


def head_dim_llama():
    """A Llama whose head_dim (32) is not hidden / heads (16): the block and the views must take the config's."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    _seeded_init_(model, 1)
    return model


def models():
    yield "tiny", load_model(ModelSpec("tiny", "float32", 0))
    yield "smollm2-135m", load_model(ModelSpec("smollm2-135m", "float32", 0))
    yield "qwen2-biases", tiny_qwen2()
    yield "llama-head-dim-32", head_dim_llama()


@pytest.mark.parametrize("name,model", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_fused_prefill_is_bit_identical_to_hf_on_cpu(name, model):
    ids = random_prompt(model.config.vocab_size, 45, seed=4)
    seen = []
    cache, logits = prefill(model, ids, on_layer=lambda i, k, v: seen.append((i, k, v)))
    hf_cache, hf_logits = prefill(model, ids, fused=False)
    assert fp.supports(model, 45)
    assert same_bytes(logits, hf_logits), name
    assert caches_equal(cache_layers(cache), cache_layers(hf_cache)), name
    assert [i for i, _, _ in seen] == list(range(model.config.num_hidden_layers))
    assert all(k is lk and v is lv for (_, k, v), (lk, lv) in zip(seen, cache_layers(cache)))
    # and the cache decodes on as the HF one does (a proper DynamicCache)
    assert decode(model, cache, logits, 4).tokens == decode(model, hf_cache, hf_logits, 4).tokens


def test_a_sliding_window_shorter_than_the_prompt_runs_the_hf_forward():
    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, sliding_window=16)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    _seeded_init_(model, 1)
    assert fp.supports(model, 16) and not fp.supports(model, 17)
    ids = random_prompt(cfg.vocab_size, 30, seed=2)
    cache, logits = prefill(model, ids)
    hf_cache, hf_logits = prefill(model, ids, fused=False)
    assert same_bytes(logits, hf_logits) and caches_equal(cache_layers(cache), cache_layers(hf_cache))


def test_short_prompts_never_take_cudnn_attention_long_ones_keep_sdpas_choice():
    """cuDNN builds a graph per new length (~0.1 s on an H200): short prompts skip it, long ones amortize it."""
    from torch.nn.attention import SDPBackend

    from kvtransfer.model.fused_prefill import CUDNN_MIN_TOKENS, sdpa_backends

    short = sdpa_backends(1024)
    assert short and SDPBackend.CUDNN_ATTENTION not in short and SDPBackend.FLASH_ATTENTION == short[0]
    assert sdpa_backends(CUDNN_MIN_TOKENS - 1) == short and sdpa_backends(CUDNN_MIN_TOKENS) is None


def test_fused_layers_are_kept_per_model_until_its_weights_are_rebound():
    from kvtransfer.model.fused import fused_layers

    model = load_model(ModelSpec("tiny", "float32", 0))
    layers = fused_layers(model)
    assert fused_layers(model) is layers  # kept: a prefill does not walk the layers again
    q = model.model.layers[0].self_attn.q_proj.weight
    q.data = q.data.clone() + 1  # rebound (as a move to another device would): fused again, on the new weights
    again = fused_layers(model)
    assert again is not layers and torch.equal(again[0].qkv[: q.shape[0]], q)
    assert q.data_ptr() == again[0].qkv.data_ptr()
    last = model.model.layers[-1]
    last.mlp.down_proj = torch.nn.Linear(last.mlp.down_proj.in_features, last.mlp.down_proj.out_features, bias=False)
    assert fused_layers(model)[-1].down is last.mlp.down_proj.weight  # a module swapped in a later layer: seen too
    k = model.model.layers[-1].self_attn.k_proj.weight
    k.data = k.data.clone()  # a later layer's k rebound: fused again, k a view of the new qkv
    qkv = fused_layers(model)[-1].qkv
    assert k.data_ptr() == qkv.data_ptr() + q.shape[0] * q.shape[1] * q.element_size()


@pytest.mark.parametrize("name,model", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_chunk_by_chunk_on_the_fused_ops_is_bit_identical_to_hf_chunks(name, model):
    """The engine's chunked prefill on the fused ops (chunk_cache, then prefill per piece) against the HF forward
    over the same pieces: after a reused prefix (the past copied into the block), full chunks, and a last chunk
    padded after its last real token (engine.pad_chunk). Every piece's logits and the cache are the same bytes on
    CPU; the layer hook sees the K/V so far (pads included), and the cache's length ends at the prompt."""
    from kvtransfer.engine.engine import pad_chunk, past_cache

    n, chunk, start = 150, 32, 20  # a 20-token prefix, then 32 x 4 and 2 real tokens padded to 32
    ids = random_prompt(model.config.vocab_size, n, seed=7)
    past = cache_layers(prefill(model, ids[:, :start])[0])
    fused, hf = fp.chunk_cache(model, n + chunk, past), past_cache(model.config, past)
    assert fused is not None and fused.fused and fused.get_seq_length() == start
    at, seen = start, []
    while at < n:
        end = min(n, at + chunk)
        piece, row = pad_chunk(ids[:, at:end], chunk)
        fused, logits = prefill(model, piece, on_layer=lambda i, k, v: seen.append((i, k.shape[-2])), cache=fused,
                                row=row)
        hf, hf_logits = prefill(model, piece, cache=hf, row=row)
        assert same_bytes(logits, hf_logits), (name, at)
        assert seen == [(i, at + chunk) for i in range(model.config.num_hidden_layers)], (name, at)
        seen.clear()
        at = end
    assert fused.get_seq_length() == n
    assert caches_equal(cache_layers(fused), [(k[:, :, :n], v[:, :, :n]) for k, v in cache_layers(hf)]), name


def test_a_model_the_fused_ops_cannot_run_gets_no_chunk_cache():
    """A sliding-window model (its cache layers count positions apart from their keys; the window here never binds)
    and a window shorter than the prompt: chunk_cache declines, and the engine chunks on the HF forward."""
    for window, positions in ((1024, 100), (16, 17)):
        cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, sliding_window=window)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
        assert fp.chunk_cache(model, positions) is None


def test_a_cache_layer_is_initialized_once_per_prompt_not_per_chunk(monkeypatch):
    """DynamicLayer.lazy_initialization builds two empty device tensors from Python lists (host work); the fused path
    ran it for every layer of every piece. Now once per layer: at the block's creation (chunk_cache) or at a whole
    prompt's layer, then the layer is pointed at new views."""
    from transformers.cache_utils import DynamicLayer

    model = load_model(ModelSpec("tiny", "float32", 0))
    layers = model.config.num_hidden_layers
    inits = []
    real = DynamicLayer.lazy_initialization
    monkeypatch.setattr(DynamicLayer, "lazy_initialization", lambda self, k, v: inits.append(1) or real(self, k, v))
    ids = random_prompt(model.config.vocab_size, 100, seed=3)
    fp.fused_prefill(model, ids)
    assert len(inits) == layers
    inits.clear()
    cache = fp.chunk_cache(model, 100 + 32 - 1)
    for start in range(0, 100, 32):
        piece = ids[:, start:start + 32]
        fp.fused_chunk(model, piece, cache)
        length = min(100, start + 32)
        assert cache.get_seq_length() == length and cache.layers[0].keys.shape[-2] == length
    assert len(inits) == layers
