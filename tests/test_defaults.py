"""Defaults that fit the device: --device resolved to an indexed device, --dtype auto, the KV pool sized from
memory, the fastest prefill on CUDA with --exact to restore bit-identity.

Why pure functions here: the sizing rule is arithmetic over the device's memory, so it is tested with the
memory of an H200 written in; the GPU start with no flags is in tests/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from decode_server.config import DecodeConfig
from decode_server.sizing import (
    CPU_SEQ,
    CPU_SLOTS,
    GIB,
    MAX_AUTO_BATCH,
    WORKSPACE,
    Memory,
    attention_partials_bytes,
    plan_engine,
    plan_pool,
    workspace_bytes,
)
from kvtransfer.model.loaded import load, pick_device, resolve_dtype
from kvtransfer.model.spec import preset_config

QWEN_BPT, QWEN_CONTEXT = 57344, 32768
H200 = Memory(total=int(139.8 * GIB), free=int(125.4 * GIB), ours=int(14.4 * GIB))  # after the weights


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("float16", torch.device("cuda", 0)) == "float16"
    assert DecodeConfig().dtype == "auto" and DecodeConfig().spec(torch.device("cpu")).dtype == "float32"


def test_the_decode_attentions_partials_are_kept_out_of_the_pool():
    # The per-split cap (triton_attention.LONG_CHUNK) makes cdiv(max_seq, 1,024) splits a row whatever the lengths:
    # at 256 rows of 32k that is 32 splits of (D + 1) fp32 per query head, held at the graphs' peak.
    pytest.importorskip("triton")
    from kvtransfer.kernels import triton_attention as TA

    qwen = preset_config("qwen2.5-7b")
    assert attention_partials_bytes(qwen, 256, 32768) == 256 * 28 * 32 * 129 * 4
    assert attention_partials_bytes(qwen, 1, 100) == 28 * 129 * 4
    with pytest.MonkeyPatch.context() as m:
        m.setattr(TA, "LONG_CHUNK", 0)
        assert attention_partials_bytes(qwen, 256, 32768) == 256 * 28 * 129 * 4


def test_the_pool_fills_what_the_utilization_leaves_with_slots_of_the_models_context():
    ws = workspace_bytes(preset_config("qwen2.5-7b"), QWEN_BPT, 32768, 2, 0)
    plan = plan_pool(QWEN_BPT, QWEN_CONTEXT, 0, 0, 0, 0.9, H200, ws, MAX_AUTO_BATCH)
    budget = 0.9 * H200.total - H200.ours - ws
    assert plan.max_seq == QWEN_CONTEXT
    assert plan.slots == int(budget // QWEN_BPT) // QWEN_CONTEXT  # as many whole slots as fit
    assert plan.slots * plan.max_seq * QWEN_BPT <= budget
    assert "--gpu-memory-utilization" in plan.why
    half = plan_pool(QWEN_BPT, QWEN_CONTEXT, 0, 0, 0, 0.45, H200, ws, MAX_AUTO_BATCH)  # two servers on one GPU
    assert 0 < half.slots < plan.slots // 2 + 1


def test_the_pool_never_takes_more_than_is_free_now():
    busy = Memory(total=H200.total, free=int(40 * GIB), ours=H200.ours)  # another process holds the rest
    plan = plan_pool(QWEN_BPT, QWEN_CONTEXT, 0, 0, 0, 0.9, busy, WORKSPACE, MAX_AUTO_BATCH)
    assert plan.slots * plan.max_seq * QWEN_BPT <= 40 * GIB - WORKSPACE and "free now" in plan.why


def test_given_flags_are_kept_and_the_rest_follows():
    assert plan_pool(QWEN_BPT, QWEN_CONTEXT, 8, 0, 0, 0.9, H200, WORKSPACE, 128).slots == 8
    assert plan_pool(QWEN_BPT, QWEN_CONTEXT, 8, 0, 0, 0.9, H200, WORKSPACE, 128).max_seq == QWEN_CONTEXT
    short = plan_pool(QWEN_BPT, QWEN_CONTEXT, 0, 2048, 0, 0.9, H200, WORKSPACE, 128)
    assert (short.slots, short.max_seq) == (128, 2048)  # the cap: more slots than a step can hold are no use
    gib = plan_pool(QWEN_BPT, QWEN_CONTEXT, 0, 4096, 2.0, 0.9, H200, WORKSPACE, 128)
    assert (gib.slots, gib.max_seq) == (2 * GIB // (4096 * QWEN_BPT), 4096) and "--kv-pool-gib" in gib.why
    assert plan_pool(QWEN_BPT, QWEN_CONTEXT, 64, 2048, 0, 0.9, H200, WORKSPACE, 128).slots == 64


def test_a_pool_that_cannot_fit_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match=r"--max-batch 512 x --max-seq-len 32768 .* GiB of the device is free"):
        plan_pool(QWEN_BPT, QWEN_CONTEXT, 512, 32768, 0, 0.9, H200, WORKSPACE, 128)
    tiny_gpu = Memory(total=16 * GIB, free=2 * GIB, ours=15 * GIB)
    with pytest.raises(ValueError, match="--gpu-memory-utilization, pass --kv-pool-gib"):
        plan_pool(QWEN_BPT, QWEN_CONTEXT, 0, 0, 0, 0.9, tiny_gpu, WORKSPACE, 128)


def test_cpu_keeps_a_small_fixed_pool():
    assert (plan_pool(512, 4096, 0, 0, 0, 0.9, None, 0, 128).slots, plan_pool(512, 8192, 0, 0, 0, 0.9, None, 0,
                                                                              128).max_seq) == (CPU_SLOTS, CPU_SEQ)
    assert plan_pool(512, 1024, 0, 0, 0, 0.9, None, 0, 128).max_seq == 1024  # the model's context when shorter


def test_the_engine_plan_on_cpu_prefills_whole_prompts(tiny_loaded):
    options, line = plan_engine(DecodeConfig(colocated=True), tiny_loaded, 0)
    assert (options.max_batch, options.max_seq_len, options.prefill_chunk, options.mixed_prefill) == (16, 4096, 0,
                                                                                                        False)
    assert "whole prompts" in line and "dtype float32 (auto)" in line
    # paged by default: the memory of 16 slots of 4,096 tokens in 64-token blocks, 16 rows (docs/paging.md)
    assert (options.kv_block_tokens, options.kv_blocks) == (64, 16 * 4096 // 64)
    assert "1024 blocks of 64 tokens, 16 rows" in line
    slots, line = plan_engine(DecodeConfig(colocated=True, kv_block_tokens=0), tiny_loaded, 0)
    assert (slots.max_batch, slots.max_seq_len, slots.kv_block_tokens) == (16, 4096, 0) and "16 x 4096" in line
    short, _ = plan_engine(DecodeConfig(colocated=True, max_seq_len=40), tiny_loaded, 0)
    assert (short.max_seq_len, short.kv_block_tokens) == (40, 40)  # a block never outgrows the context
    mixed, _ = plan_engine(DecodeConfig(colocated=True, mixed_prefill=True), tiny_loaded, 0)
    assert (mixed.prefill_chunk, mixed.mixed_prefill) == (512, True)


def test_the_engine_plan_in_the_batch_invariant_mode_prefills_in_mixed_steps(tiny_loaded):
    """The mode's prompts ride in the decode steps on any device, in steps of --prefill-chunk rows (0 or unset: 512;
    a mutation pass found 0 unguarded: read as 0 rows)."""
    for chunk, rows in ((-1, 512), (0, 512), (32, 32)):
        options, line = plan_engine(DecodeConfig(colocated=True, batch_invariant=True, prefill_chunk=chunk),
                                    tiny_loaded, 0)
        assert (options.prefill_chunk, options.mixed_prefill, options.batch_invariant) == (rows, True, True)
        assert f"up to {rows} rows each" in line and "--batch-invariant" in line

def test_the_engine_plan_on_cuda_is_the_fastest_measured_and_exact_restores_whole_prompts(tiny_loaded, monkeypatch):
    """On CUDA (its memory stood in), no flags: mixed steps of up to 512 rows and at most 256 rows decoding (2 step
    rows per decode row); --exact: whole prompts. --exact beside a chunk flag is refused."""
    import decode_server.sizing as sizing
    monkeypatch.setattr(sizing, "device_memory", lambda device: H200)
    cuda = type(tiny_loaded)(tiny_loaded.spec, tiny_loaded.model, tiny_loaded.geometry, torch.device("cuda", 0))
    fast, line = plan_engine(DecodeConfig(colocated=True), cuda, 0)
    assert (fast.prefill_chunk, fast.mixed_prefill, fast.max_batch) == (512, True, 256)
    assert "mixed steps of up to 512 rows (the CUDA default; --exact" in line
    chunked, line = plan_engine(DecodeConfig(colocated=True, prefill_chunk=1024), cuda, 0)
    assert not chunked.mixed_prefill and "--mixed-prefill makes them steps of up to 1024 rows" in line
    exact, line = plan_engine(DecodeConfig(colocated=True, exact=True), cuda, 0)
    assert (exact.prefill_chunk, exact.mixed_prefill) == (0, False) and "whole prompts (--exact)" in line
    with pytest.raises(ValueError, match="--exact prefills whole prompts"):
        DecodeConfig(exact=True, mixed_prefill=True)
    with pytest.raises(ValueError, match="give at most two"):  # the slot layout: each follows from the other two
        DecodeConfig(kv_pool_gib=1, max_batch=2, max_seq_len=64, kv_block_tokens=0)
    paged, line = plan_engine(DecodeConfig(colocated=True, kv_pool_gib=1, max_batch=2, max_seq_len=64), cuda, 0)
    assert (paged.max_batch, paged.max_seq_len, paged.kv_blocks) == (2, 64, (1 << 30) // (64 * 1024))  # paged: apart
    assert (fast.kv_block_tokens, fast.max_seq_len) == (64, tiny_loaded.model.config.max_position_embeddings)
    # --max-batch alone: the pool holds no more than those rows can fill (as the fixed slots did: the ttft bench's
    # decode worker with --max-batch 2 shares one GPU with its prefill worker), whatever the utilization leaves
    context = tiny_loaded.model.config.max_position_embeddings
    two, line = plan_engine(DecodeConfig(colocated=True, max_batch=2), cuda, 0)
    assert (two.max_batch, two.kv_blocks * two.kv_block_tokens) == (2, 2 * context) and "at most --max-batch 2" in line
    assert fast.kv_blocks * fast.kv_block_tokens > 2 * context  # without it, the pool is what memory leaves


@pytest.fixture(scope="module")
def tiny_loaded():
    from kvtransfer.model.spec import ModelSpec
    return load(ModelSpec("tiny", "float32"), torch.device("cpu"), False)


class _FakeCuda:
    def __init__(self, count: int):
        self.count, self.current = count, 0
        self.set = []


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCuda(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: fake.set.append(d))
    return fake


def test_every_device_value_resolves_to_an_indexed_device(fake_cuda):
    """auto and cuda become cuda:N (torch.cuda.set_device refuses an index-less `cuda`: the scheduler thread died
    of it at start); cuda:N that does not exist is refused naming the flag."""
    assert pick_device("auto") == torch.device("cuda", 0)
    assert pick_device("cuda") == torch.device("cuda", 0)
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    assert all(d.index is not None for d in fake_cuda.set)
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0..cuda:1"):
        pick_device("cuda:2")
    assert pick_device("cpu") == torch.device("cpu")


def test_without_cuda_auto_is_cpu_and_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda: no CUDA device here"):
        pick_device("cuda")


def test_peer_flags_beside_colocated_are_named_for_the_start_warning():
    # --colocated has no prefill peer: a --transport or --prefill-addr given beside it does nothing, and the server
    # says so at start (decode_server/__main__.py) rather than silently running colocated.
    assert DecodeConfig(colocated=True, transport="grpc", prefill_addr="10.0.0.2:50061",
                        on_failure="recompute").unused_when_colocated() == [
        "--prefill-addr", "--transport", "--on-failure"]
    assert DecodeConfig(colocated=True).unused_when_colocated() == []
    assert DecodeConfig(transport="grpc").unused_when_colocated() == []  # disaggregated: they are used
