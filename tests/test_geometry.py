"""Cache geometry: bytes per token for the published models, layer/cache sizes, digests."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.geometry import CODE_DTYPES, DTYPE_CODES, CacheGeometry
from kvtransfer.model.prefill import prefill
from kvtransfer.model.spec import load_config
from kvtransfer.model.streaming import cache_layers


def geom(name: str, dtype: torch.dtype = torch.bfloat16) -> CacheGeometry:
    return CacheGeometry.from_config(load_config(name), dtype)


def test_smollm2_bytes_per_token_bf16():
    g = geom("smollm2-135m")
    assert (g.num_layers, g.kv_heads, g.head_dim, g.elem_size) == (30, 3, 64, 2)
    assert g.bytes_per_token == 23_040


def test_qwen_bytes_per_token_bf16():
    g = geom("qwen2.5-7b")
    assert (g.num_layers, g.kv_heads, g.head_dim, g.elem_size) == (28, 4, 128, 2)
    assert g.bytes_per_token == 57_344


def test_qwen_32k_cache_is_exactly_1_75_gib():
    g = geom("qwen2.5-7b")
    assert 32768 * 57344 == 1.75 * 2**30
    assert g.cache_bytes(32768) == 32768 * 57344 == 7 * 2**28


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "qwen2.5-7b"])
@pytest.mark.parametrize("seq", [1, 7, 1024, 4096, 32768])
def test_layer_bytes_times_layers_is_cache_bytes(name, seq):
    g = geom(name)
    assert g.layer_bytes(seq) * g.num_layers == g.cache_bytes(seq)
    # one layer's K plus V, from its shape
    b, h, s, d = g.layer_shape(seq)
    assert (b, h, s, d) == (1, g.kv_heads, seq, g.head_dim)
    assert g.layer_bytes(seq) == 2 * b * h * s * d * g.elem_size


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "qwen2.5-7b"])
def test_float32_doubles_bf16(name):
    bf, f32 = geom(name, torch.bfloat16), geom(name, torch.float32)
    assert f32.elem_size == 4 and bf.elem_size == 2
    assert f32.bytes_per_token == 2 * bf.bytes_per_token
    assert f32.layer_bytes(1000) == 2 * bf.layer_bytes(1000)
    assert f32.cache_bytes(32768) == 2 * bf.cache_bytes(32768)
    assert geom(name, torch.float16).bytes_per_token == bf.bytes_per_token


def test_layer_shape_with_batch():
    assert geom("qwen2.5-7b").layer_shape(16, batch=3) == (3, 4, 16, 128)


def test_digest_distinguishes_geometries():
    digests = {geom(n, dt).digest() for n in ("tiny", "smollm2-135m", "qwen2.5-7b")
               for dt in (torch.bfloat16, torch.float32, torch.float16)}
    assert len(digests) == 9
    assert geom("qwen2.5-7b").digest() == geom("qwen2.5-7b").digest()


def test_dtype_codes_roundtrip():
    assert set(DTYPE_CODES) == {torch.float32, torch.bfloat16, torch.float16}
    assert all(CODE_DTYPES[c] is dt for dt, c in DTYPE_CODES.items())


def test_geometry_matches_the_real_tiny_cache(tiny_model, prompt):
    """The geometry predicts the shapes and byte counts a real prefill produces."""
    g = CacheGeometry.from_config(tiny_model.config, tiny_model.dtype)
    cache, _ = prefill(tiny_model, prompt)
    layers = cache_layers(cache)
    seq = prompt.shape[1]
    assert len(layers) == g.num_layers
    for k, v in layers:
        assert tuple(k.shape) == tuple(v.shape) == g.layer_shape(seq)
        assert k.dtype == v.dtype == g.dtype
        assert k.nbytes + v.nbytes == g.layer_bytes(seq)
    assert sum(k.nbytes + v.nbytes for k, v in layers) == g.cache_bytes(seq)
