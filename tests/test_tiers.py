"""Host tiers: every tier this machine offers returns the cache byte for byte.

Why: the tiers are the offload baseline and the oracle other transports are checked
against, so a tier that loses or reorders a byte must fail here, not in a bench table.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.measure.pagecache import drop_page_cache, resident_pages
from bench.measure.tiers import TIER_KINDS, DiskTier, contiguous_span, make_tiers
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from kvtransfer.model.streaming import cache_layers, caches_equal


@pytest.fixture(scope="module")
def layers():
    model = load_model(ModelSpec("tiny", "float32"))
    cache, _ = prefill(model, random_prompt(model.config.vocab_size, 48))
    return cache_layers(cache)  # 4 x (K, V): (1, 2, 48, 16)


def round_trip(tier, layers):
    tier.prepare(layers)
    try:
        tier.offload(layers)
        tier.sync()
        tier.out.fill_(0xFF)  # a reload that copies nothing must fail the check
        report = tier.before_reload()
        out = tier.reload()
        tier.sync()
        return caches_equal(out, layers), [(k.clone(), v.clone()) for k, v in out], report
    finally:
        tier.close()


@pytest.mark.parametrize("kind", TIER_KINDS)
def test_round_trip_byte_equal(kind, layers, tmp_path):
    (tier,) = make_tiers("cpu", str(tmp_path), kinds=[kind])
    if not tier.available:
        assert kind == "pinned" and "CUDA" in tier.skip_reason
        pytest.skip(tier.skip_reason)
    equal, out, _ = round_trip(tier, layers)
    assert equal
    assert [tuple(k.shape) for k, _ in out] == [tuple(k.shape) for k, _ in layers]
    assert not os.listdir(tmp_path), "close() must remove the tier's file"


def test_pinned_skipped_with_reason_without_cuda(tmp_path):
    (tier,) = make_tiers("cpu", str(tmp_path), kinds=["pinned"])
    assert not tier.available and "CUDA" in tier.skip_reason
    with pytest.raises(RuntimeError, match="unavailable"):
        tier.prepare([])


def test_scattered_layers_round_trip(layers, tmp_path):
    """Layers not in one block (clones) take the per-tensor copy path."""
    scattered = [(k.clone(), v.clone()) for k, v in layers]
    assert contiguous_span(layers) is not None and contiguous_span(scattered) is None
    for tier in make_tiers("cpu", str(tmp_path), kinds=["gpu", "disk"]):
        assert round_trip(tier, scattered)[0]


@pytest.mark.parametrize("fsync", [False, True])
def test_disk_page_cache_report(fsync, layers, tmp_path):
    tier = DiskTier("cpu", str(tmp_path), fsync=fsync)
    assert tier.kind == ("disk-fsync" if fsync else "disk")
    equal, _, report = round_trip(tier, layers)
    assert equal
    for key in ("fadvise", "drop_caches_tried", "drop_caches", "cold"):
        assert isinstance(report[key], bool), key
    assert report["total_pages"] >= 1 and 0 <= report["resident_pages"] <= report["total_pages"]
    assert report["cold"] == (report["resident_pages"] == 0)


def test_mincore_sees_a_read(tmp_path):
    """Residency is measured: reading a file makes its pages resident."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 16))
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_page_cache(fd, 1 << 16)
        os.pread(fd, 1 << 16, 0)
        resident, total = resident_pages(fd, 1 << 16)
        assert resident == total == (1 << 16) // os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)


def test_offload_rejects_other_shapes(layers, tmp_path):
    (tier,) = make_tiers("cpu", str(tmp_path), kinds=["pageable"])
    tier.prepare(layers)
    try:
        with pytest.raises(ValueError, match="shapes"):
            tier.offload(layers[:-1])
    finally:
        tier.close()


def test_unknown_tier(tmp_path):
    with pytest.raises(ValueError, match="unknown tier"):
        make_tiers("cpu", str(tmp_path), kinds=["nvme"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_round_trip_every_tier(tmp_path):
    model = load_model(ModelSpec("tiny", "bfloat16"), "cuda")
    cache, _ = prefill(model, random_prompt(model.config.vocab_size, 256, device="cuda"))
    cuda_layers = cache_layers(cache)
    for tier in make_tiers("cuda", str(tmp_path)):
        assert tier.available, tier.skip_reason
        assert round_trip(tier, cuda_layers)[0], tier.kind
