"""Cases a mutation pass over code no earlier pass covered found untested: the decode engine's chunked local
prefill (kvtransfer/engine/engine.py: prefill_job's block for a chunked prompt, its pieces and gaps, pad_chunk,
warm_local_prefill, to_device), the fused ops' chunk path (kvtransfer/model/fused_prefill.py: chunk_cache,
fused_chunk), the HF path's chunk attention (kvtransfer/engine/chunk_attention.py), the kernels' table arguments
(kvtransfer/kernels/triton_paging.py: table_args), and the decode server's admission queue (decode_server/
admission.py); its sizing and prefix-reuse half is tests/test_sizing_reuse_mutants.py. Each test failed on a
one-line change of that code that the chunked prefill, fused prefill, engine, mixed, paged, prefix, kernel (the
interpreter's too), admission, defaults, validation and server tests let through; its docstring names the change
it kills ("kills ..."), and each was seen failing with that change planted and passing on the clean code.

Of 108 planted changes (54 in the chunk path: engine.py 28, fused_prefill.py 17, chunk_attention.py 9; admission.py
15, sizing.py 17, reuse.py 15, table_args 7), 66 were caught already (5 of the 7 in table_args by the interpreter
and compile-key tests), 22 only by these two files, and 17 are equivalent: a one-chunk prompt through chunk_cache
(the same forward as the whole prefill), `m >= chunk` in pad_chunk (m never exceeds it), pads of the first token
instead of the last (no real row nor the pool sees a pad), the warm-up's whole prompt of max_seq tokens (nothing
reaches the pool), int32 ids (the embedding takes either), a lower-right mask at position 0 (the causal one), in
chunk_attention `>=` for `>`, is_causal off without a past and `.contiguous()` dropped (it always runs after a past,
and HF reshapes its output), scale None (every model the engine serves has head_dim ** -0.5), enable_gqa always on,
the mask function unregistered (transformers gives an unknown attention no mask), the queue's wake scheduled with
nobody waiting, `left <= 0` as `< 0`, a suffix limit of 0 tried (no prefix leaves 0 tokens to prefill), a block
table's row stride as its width (every caller passes the pool's whole contiguous table) and the slot layout's unread
stride. Three are left: the warm-up of --prefill-chunk 1 skipping the chunk path, a pool of exactly free - WORKSPACE
bytes refused, and plan_pool's `max(1, ..)` slots (see the pass's report: with --max-seq-len over what the budget
holds, the clean code makes one slot of --max-seq-len anyway). reuse.py's changes were run against
test_prefix_servers.py and test_preempt_servers.py.

Why in process: the engine's HF chunk path is reached only by a model the fused ops cannot run (a Mistral-style
model whose sliding window never binds), which the chunked prefill tests prefill only after a reused prefix; a
suffix of exactly one chunk, the gaps a job leaves, the head's re-check and a refusal's wording are each one call
here, with a small model or a real pool on CPU: the file runs in about a second on 2 cores, the same way every
time. The only wait is the admission re-check's (10 ms, bounded by GUARD_S); nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

import kvtransfer.engine.chunk_attention as chunk_attention_mod
import kvtransfer.engine.engine as engine_mod
from decode_server import admission
from decode_server.admission import AdmissionQueue
from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.engine.pool import KVPool, PoolFull
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model

CHUNK_TOL = 1e-4  # as tests/test_chunked_prefill.py: fp32 max |diff| of chunked against whole logits
GUARD_S = 10  # turns an admission that never comes into a failure; no passing run comes near it


def _engine(model, chunk: int) -> DecodeEngine:
    lm = LoadedModel(ModelSpec("tiny", "float32"), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    return DecodeEngine(lm, EngineOptions(max_batch=2, max_seq_len=512, cuda_graphs=False, prefill_chunk=chunk))


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0))


def _mistral():
    """A model the fused ops cannot run (its cache layers are sliding-window ones), whose window (1024) never binds
    in a slot of 512: the engine chunks it on the HF forward, later pieces through chunk_attention.py."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                            max_position_embeddings=4096, sliding_window=1024)).eval()


# --- the chunked local prefill (kvtransfer/engine/engine.py, chunk_attention.py) ---


def test_an_hf_only_models_long_prompt_is_chunked_from_position_0_through_the_chunk_attention(monkeypatch):
    """kills prefill_job's `or not start` dropped from `cache if cache is not None or not start else past_cache(..)`
    (a model the fused ops cannot run, given a prompt over one chunk with no reused prefix, built a past from no
    layers: every such prompt failed with --prefill-chunk); `if start and not cache.fused` made `if start and
    cache.fused` (its later pieces ran HF's sdpa path, which materializes a mask and leaves the flash kernel);
    chunk_attention_on's `finally` no longer restoring the model's attention; and chunk_attention's
    prompt_attention(kv_len) made prompt_attention(q_len) (the cuDNN choice follows the keys attended over).
    The second piece is 36 tokens padded to 64 after 64: 128 keys."""
    model = _mistral()
    impls, logits, kv_lens = [], [], []

    def recording(m, ids, *a, real=engine_mod.prefill, **k):
        impls.append(m.config._attn_implementation)
        cache, out = real(m, ids, *a, **k)
        logits.append(out.clone())
        return cache, out
    monkeypatch.setattr(engine_mod, "prefill", recording)
    real_attention = chunk_attention_mod.prompt_attention
    monkeypatch.setattr(chunk_attention_mod, "prompt_attention", lambda n: (kv_lens.append(n), real_attention(n))[1])
    e = _engine(model, 64)
    try:
        ids = random_prompt(512, 100, seed=6)[0].tolist()
        lease = e.pool.try_lease()
        e.prefill(ids, lease, False).result(timeout=60)
        lease.release()
    finally:
        e.close()
    before = model.config._attn_implementation
    assert impls == [before, chunk_attention_mod.NAME] and before != chunk_attention_mod.NAME
    assert kv_lens and set(kv_lens) == {128}, kv_lens
    whole = model(torch.tensor([ids])).logits[0, -1]
    assert (logits[-1] - whole).abs().max() <= CHUNK_TOL


def test_a_suffix_of_exactly_one_chunk_gets_a_block_of_the_prompt_alone(monkeypatch, tiny):
    """kills prefill_job's `n - start > chunk` made `>=` (a reused prefix's suffix of exactly --prefill-chunk tokens
    runs one piece, unpadded, yet its block took the last piece's pads too: chunk - 1 positions of every layer for
    nothing; tests/test_chunked_prefill.py tries suffixes shorter and longer than a chunk only)."""
    asked = []
    monkeypatch.setattr(engine_mod, "chunk_cache", lambda model, positions, *a, real=engine_mod.chunk_cache, **k: (
        asked.append(positions), real(model, positions, *a, **k))[1])
    e = _engine(tiny, 64)
    try:
        ids = random_prompt(512, 200, seed=9)[0].tolist()
        lease = e.pool.try_lease()
        e.prefill(ids[:136], lease, False).result(timeout=60)  # 64 + 72 padded to 64: asks 136 + 63
        asked.clear()
        e.prefill(ids, lease, False, start=136).result(timeout=60)  # 64 tokens after the prefix: one piece
        assert asked == [200]
        lease.release()
    finally:
        e.close()


def test_a_chunked_job_leaves_one_gap_between_pieces_and_one_before_its_first_token(tiny):
    """kills the chunk loop's `if start < n: yield` made `if start <= n` (a gap after the last piece as well as the
    one before the first token's read: every chunked prompt's first token one decode step later). 200 tokens in
    chunks of 64: four pieces, three gaps between them, one before the read."""
    e = _engine(tiny, 64)
    gaps = []

    def counting(job):
        while True:
            try:
                next(job)
            except StopIteration as done:
                return done.value
            gaps.append(1)
            yield
    try:
        lease = e.pool.try_lease()
        first = e.scheduler.submit(counting(e.prefill_job(random_prompt(512, 200, seed=3)[0].tolist(), lease, False)))
        assert first.result(timeout=60).first >= 0 and len(gaps) == 4
        lease.release()
    finally:
        e.close()


# --- the admission queue (decode_server/admission.py) ---


def _paged_pool() -> KVPool:
    """4 rows of up to 40 tokens, 10 blocks of 4 tokens."""
    return KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), 4, 40, 4, 10)


def test_the_head_tries_again_unwoken_so_memory_freed_without_the_pools_callback_is_taken(monkeypatch):
    """kills the head's wait `min(left, ADMISSION_RECHECK_S) if head else left` made `left` (the head never polled:
    memory freed without the pool's callback, which the re-check is there for, left it waiting to its deadline, an
    hour here). The take succeeds at its third try, with no release ever signalled; the re-check is 10 ms."""
    monkeypatch.setattr(admission, "ADMISSION_RECHECK_S", 0.01)
    pool, tries = _paged_pool(), []

    def take():
        tries.append(1)
        if len(tries) < 3:
            raise PoolFull()
        return pool.try_lease(4)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        lease = await asyncio.wait_for(q.acquire(time.perf_counter() + 3600, take), GUARD_S)
        lease.release()
        q.close()
    asyncio.run(scenario())
    assert len(tries) == 3


def test_a_refusal_on_a_paged_pool_counts_the_free_rows():
    """kills _busy's `pool.slots - pool.used()` made `pool.used()` (a refusal on a paged pool said "1 of 4 rows"
    free with 3 free: the user is told rows are short when blocks are). One row of four holds 9 blocks of 10; the
    request needs 2, and --max-waiting 0 refuses it at once."""
    pool = _paged_pool()
    held = pool.try_lease(36)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=0)
        try:
            with pytest.raises(admission.RequestError) as refused:
                await asyncio.wait_for(q.acquire(time.perf_counter() + 3600, lambda: pool.try_lease(8)), GUARD_S)
            return refused.value
        finally:
            q.close()
    err = asyncio.run(scenario())
    held.release()
    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(1 of 10 blocks of 4 tokens free, 3 of 4 rows (--max-batch))" in err.message, err.message
