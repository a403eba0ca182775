"""The batched engine on a GPU (bf16, Triton kernels, CUDA graphs): what holds, measured and checked.

- graph replay == the eager step, bit for bit, at every bucket (same kernels, same shapes);
- engine vs the plain HF forward, teacher-forced: within GPU_VS_HF (relative to the logits' scale), for the
  presets smollm2-135m and qwen2.5-7b;
- a row inside a batch vs the same request alone: within GPU_BATCH_TOL; tokens equal where the top-2 margin
  exceeds it (bf16 GEMMs pick kernels by batch size, so this is a tolerance, not bit-identity).
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.engine.graphs import Step
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_VS_HF = 0.05  # max |diff| / max |logit|, bf16, teacher-forced over 8 steps
GPU_BATCH_TOL = 0.05  # same measure, a row in a batch of 8 vs alone


def build(name: str, slots: int = 8, max_seq: int = 1024):
    model = load_model(ModelSpec(name, "bfloat16", 0), "cuda")
    pool = KVPool(CacheGeometry.from_config(model.config, torch.bfloat16), torch.device("cuda"), slots, max_seq)
    runner = StepRunner(model, pool)
    return model, pool, runner


def fill(model, pool, slot: int, ids: torch.Tensor) -> int:
    cache, logits = prefill(model, ids)
    for (dk, dv), layer in zip(pool.views(slot, ids.shape[1]), cache.layers):
        dk.copy_(layer.keys)
        dv.copy_(layer.values)
    return int(logits.argmax())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-7b"])
def test_engine_vs_hf_forward_teacher_forced(name):
    model, pool, runner = build(name)
    assert runner.use_triton
    ids = random_prompt(model.config.vocab_size, 300, seed=5, device="cuda")
    toks, rows = [fill(model, pool, 0, ids)], []
    slot = torch.tensor([0], device="cuda")
    for i in range(8):
        out = runner.forward(torch.tensor([toks[-1]], device="cuda"), torch.tensor([300 + i], device="cuda"), slot)
        rows.append(out[0])
        toks.append(int(out[0].argmax()))
    with torch.no_grad():
        ref = model(torch.cat([ids, torch.tensor([toks[:-1]], device="cuda")], dim=1)).logits[0, 300:]
    gap = rel(torch.stack(rows), ref)
    print(f"{name}: engine vs HF forward, max |diff| / max |logit| = {gap:.4f}")
    assert gap <= GPU_VS_HF


def test_graph_replay_equals_eager_and_batch_within_tolerance():
    model, pool, runner = build("smollm2-135m", slots=8)
    step = Step(runner, max_batch=8, cuda_graphs=True)
    assert step.graphs
    lengths = [17, 300, 64, 5, 250, 129, 90, 33]
    firsts = [fill(model, pool, s, random_prompt(model.config.vocab_size, n, seed=n, device="cuda"))
              for s, n in enumerate(lengths)]
    tok = torch.tensor(firsts, device="cuda")
    pos = torch.tensor(lengths, device="cuda")
    slots = torch.arange(8, device="cuda")
    for n in (1, 3, 8):  # buckets 1, 4 (padded), 8
        graphed = step(tok[:n], pos[:n], slots[:n]).clone()
        eager = runner.forward(tok[:n], pos[:n], slots[:n])
        assert torch.equal(graphed, eager), n
    batch = step(tok, pos, slots).clone()
    for j in range(8):
        alone = step(tok[j:j + 1], pos[j:j + 1], slots[j:j + 1])[0]
        gap = rel(batch[j], alone)
        print(f"row {j}: batch vs alone {gap:.5f}")
        assert gap <= GPU_BATCH_TOL
        top2 = alone.float().topk(2).values
        if (top2[0] - top2[1]) > GPU_BATCH_TOL * alone.float().abs().max():
            assert int(batch[j].argmax()) == int(alone.argmax())


def test_mixed_graph_matches_the_eager_mixed_step_and_the_whole_prefill():
    """A prompt chunk riding in a graphed step (graphs.py, --mixed-prefill): the decode rows within GPU_BATCH_TOL of
    the plain step, the chunk's last row and the prompt's cache within it of a whole prefill, and the graph within
    it of the eager mixed forward (padding changes the GEMM shapes, so not bit for bit)."""
    from kvtransfer.engine.mixed import Chunk, mixed_forward

    model, pool, runner = build("smollm2-135m", slots=8)
    step = Step(runner, max_batch=8, cuda_graphs=True, chunk=68, max_rows=136)  # 68 rows: 65 beside 3 decode rows
    assert set(step.mixed_graphs) == {(c, b) for c in (68, 136) for b in step.graphs}
    lengths = [40, 300, 77]
    firsts = [fill(model, pool, s, random_prompt(model.config.vocab_size, n, seed=n, device="cuda"))
              for s, n in enumerate(lengths)]
    tok, pos = torch.tensor(firsts, device="cuda"), torch.tensor(lengths, device="cuda")
    slots = torch.arange(3, device="cuda")
    plain = step(tok, pos, slots).clone()
    prompt = random_prompt(model.config.vocab_size, 150, seed=9, device="cuda")
    other = random_prompt(model.config.vocab_size, 40, seed=10, device="cuda")  # shares the last step's budget
    assert step.prompt_budget(3, 0) == 65  # bucket 4: its fourth row takes a prompt token (mixed.lay_out)
    for start in range(0, 150, 64):  # chunks of 64, 64, then 22 + the 40 of `other` (padded): each chunk's first
        # token in the bucket's free row, attending as a decode row
        chunks = [Chunk(prompt[0, start:start + 64], 5, start, start + 64 >= 150)]
        if start + 64 >= 150:
            chunks.append(Chunk(other[0], 6, 0, True))
        dec, lasts = step.mixed(tok, pos, slots, chunks)
        dec, lasts = dec.clone(), lasts.clone()
        e_dec, e_lasts = mixed_forward(runner, tok, pos, slots, chunks)
        gaps = rel(dec, plain), rel(dec, e_dec), rel(lasts, e_lasts)
        print(f"chunk at {start}: vs plain step {gaps[0]:.5f}, graph vs eager {gaps[1]:.5f} / {gaps[2]:.5f}")
        assert max(gaps) <= GPU_BATCH_TOL
    for ids, slot, last in ((prompt, 5, lasts[0]), (other, 6, lasts[1])):
        whole_cache, whole_logits = prefill(model, ids)
        gap = rel(last, whole_logits)
        print(f"mixed chunks vs whole prefill ({ids.shape[1]} tokens): last logits {gap:.5f}")
        assert gap <= GPU_BATCH_TOL
        top2 = whole_logits.float().topk(2).values
        if (top2[0] - top2[1]) > GPU_BATCH_TOL * whole_logits.float().abs().max():
            assert int(last.argmax()) == int(whole_logits.argmax())
        for (k, v), layer in zip(pool.views(slot, ids.shape[1]), whole_cache.layers):
            assert rel(k, layer.keys) <= GPU_BATCH_TOL and rel(v, layer.values) <= GPU_BATCH_TOL
    big = [Chunk(random_prompt(model.config.vocab_size, 120, seed=11, device="cuda")[0], 5, 0, True)]
    assert step.rows_for(3, 120) == 136  # the larger graph
    dec, lasts = step.mixed(tok, pos, slots, big)
    assert dec.data_ptr() == step.mixed_graphs[136, 4][1].data_ptr()  # its output buffer: replayed, not eager
    dec, lasts = dec.clone(), lasts.clone()
    e_dec, e_lasts = mixed_forward(runner, tok, pos, slots, big)
    gaps = rel(dec, plain), rel(dec, e_dec), rel(lasts, e_lasts)
    print(f"136-row step: vs plain step {gaps[0]:.5f}, graph vs eager {gaps[1]:.5f} / {gaps[2]:.5f}")
    assert max(gaps) <= GPU_BATCH_TOL
    assert (pool.kv[:, :, [3, 4, 7]] == 0).all()  # padding rows wrote only the scratch slot


def test_the_ladder_of_mixed_steps_replays_the_smallest_graph_that_holds_the_prompt_rows():
    """--prefill-chunk 512: graphs at 128, 256 and 512 rows, only where at most half the rows decode (graphs.py);
    a prompt chunk of 100 tokens beside 3 decode rows replays the 128-row graph, 200 the 256-row one, and each
    equals the eager mixed forward within GPU_BATCH_TOL (padding changes the GEMM shapes)."""
    from kvtransfer.engine.mixed import Chunk, mixed_forward

    model, pool, runner = build("smollm2-135m", slots=8)
    step = Step(runner, max_batch=8, cuda_graphs=True, chunk=512)
    assert step.sizes == [128, 256, 512]
    assert set(step.mixed_graphs) == {(c, b) for c in (128, 256, 512) for b in step.graphs}
    lengths = [40, 300, 77]
    firsts = [fill(model, pool, s, random_prompt(model.config.vocab_size, n, seed=n, device="cuda"))
              for s, n in enumerate(lengths)]
    tok, pos = torch.tensor(firsts, device="cuda"), torch.tensor(lengths, device="cuda")
    slots = torch.arange(3, device="cuda")
    for n, rows, slot in ((100, 128, 5), (200, 256, 6), (500, 512, 7)):
        chunks = [Chunk(random_prompt(model.config.vocab_size, n, seed=n, device="cuda")[0], slot, 0, True)]
        assert step.rows_for(3, n) == rows
        dec, lasts = step.mixed(tok, pos, slots, chunks)
        assert dec.data_ptr() == step.mixed_graphs[rows, 4][1].data_ptr()  # replayed, not eager
        dec, lasts = dec.clone(), lasts.clone()
        e_dec, e_lasts = mixed_forward(runner, tok, pos, slots, chunks)
        gaps = rel(dec, e_dec), rel(lasts, e_lasts)
        print(f"{n} prompt rows in the {rows}-row graph: graph vs eager {gaps[0]:.5f} / {gaps[1]:.5f}")
        assert max(gaps) <= GPU_BATCH_TOL


def test_chunked_prefill_on_the_fused_ops_agrees_with_hf_chunks_and_the_whole_prefill():
    """The engine's chunk loop on the fused ops (fused_prefill.chunk_cache, a last chunk padded) against the same
    pieces on the HF forward (chunk_attention) and against the whole prefill, bf16 on CUDA: Triton's norm/RoPE and
    the fused GEMMs round otherwise than HF's ops, so within GPU_BATCH_TOL (logits and cache, relative to their
    scale), the same greedy first token where the top-2 margin exceeds it; and the fused pieces repeat their bits."""
    from contextlib import nullcontext

    from kvtransfer.engine.chunk_attention import chunk_attention_on
    from kvtransfer.engine.engine import pad_chunk
    from kvtransfer.model import fused_prefill as fp

    model = load_model(ModelSpec("smollm2-135m", "bfloat16", 0), "cuda")
    n, chunk = 1000, 256  # 256 x 3, then 232 padded
    ids = random_prompt(model.config.vocab_size, n, seed=12, device="cuda")

    def chunked(fused: bool):
        cache, at = fp.chunk_cache(model, n + chunk) if fused else None, 0
        assert (cache is not None) == fused
        while at < n:
            end = min(n, at + chunk)
            piece, row = pad_chunk(ids[:, at:end], chunk) if at else (ids[:, at:end], -1)
            with chunk_attention_on(model) if at and not fused else nullcontext():
                cache, logits = prefill(model, piece, cache=cache, row=row)
            at = end
        return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers], logits

    (fused, f_logits), (again, a_logits), (hf, h_logits) = chunked(True), chunked(True), chunked(False)
    whole_cache, whole = prefill(model, ids)
    assert torch.equal(f_logits, a_logits) and all(torch.equal(k, k2) and torch.equal(v, v2)
                                                    for (k, v), (k2, v2) in zip(fused, again))
    gaps = rel(f_logits, h_logits), rel(f_logits, whole)
    print(f"fused chunks vs HF chunks {gaps[0]:.5f}, vs the whole prefill {gaps[1]:.5f}")
    assert max(gaps) <= GPU_BATCH_TOL
    top2 = whole.float().topk(2).values
    if (top2[0] - top2[1]) > GPU_BATCH_TOL * whole.float().abs().max():
        assert int(f_logits.argmax()) == int(whole.argmax())
    for (k, v), (hk, hv), layer in zip(fused, hf, whole_cache.layers):
        assert max(rel(k, hk), rel(v, hv), rel(k, layer.keys), rel(v, layer.values)) <= GPU_BATCH_TOL


def test_each_graphed_steps_staging_is_a_part_of_its_device_time():
    """The scheduler's StepStats on CUDA graphs (#39: the served step's device time split at its graph's replay):
    every step, plain and mixed, reports staging_s < device_s and some > 0, so the metric reads the replay's own
    event."""
    from kvtransfer.engine.engine import DecodeEngine, EngineOptions
    from kvtransfer.engine.queued import StepStats
    from kvtransfer.geometry import CacheGeometry as Geometry
    from kvtransfer.model.loaded import LoadedModel
    from support.enginekit import decode_prompts

    spec = ModelSpec("smollm2-135m", "bfloat16", 0)
    model = load_model(spec, "cuda")
    cuda0 = torch.device("cuda", 0)  # with its index: the scheduler thread's torch.cuda.set_device refuses "cuda"
    lm = LoadedModel(spec, model, Geometry.from_config(model.config, torch.bfloat16), cuda0)
    stats: list[StepStats] = []
    e = DecodeEngine(lm, EngineOptions(max_batch=4, max_seq_len=512, prefill_chunk=64, mixed_prefill=True),
                     on_step=stats.append)
    try:  # the 150-token prompt rides in the first one's decode steps
        decode_prompts(e, model.config.vocab_size, [(61, 200), (150, 6)], timeout=120)
    finally:
        e.close()
    graphed = [s for s in stats if s.rows and (s.step_rows or not s.prompt_rows)]
    assert graphed and any(s.prompt_rows for s in graphed), [(s.rows, s.prompt_rows, s.step_rows) for s in stats]
    assert any(s.staging_s > 0 for s in graphed), graphed
    for s in graphed:
        assert 0 <= s.staging_s < s.device_s, s
