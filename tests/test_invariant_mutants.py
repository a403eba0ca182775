"""Gaps found by planting one-line bugs in the `--batch-invariant` code (a mutation pass), closed on CPU without
servers. Each test names the bug it catches; the servers' tests (test_batch_invariant*.py) compare a request's bits
with itself, so a bug that changes the bits the same way everywhere, or only on a GPU, passes them.
"""

from __future__ import annotations


import pytest
import torch

from bench.runs import invariance
from bench.runs.serve_config import ServeConfig
from kvtransfer.engine import invariant_prefill
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import PROJECTIONS, StepRunner
from kvtransfer.kernels import backend, ops, projections
from kvtransfer.model.loaded import load
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec

PROMPT = random_prompt(512, 150, seed=40)  # (1, 150)


@pytest.fixture(scope="module")
def loaded():
    return load(ModelSpec("tiny", "float32"), torch.device("cpu"), False)


def test_the_invariant_runner_never_picks_the_gemv(loaded):
    """Caught: runner.py's `or invariant` dropped (a timed or pinned GEMV pick in the mode: on a GPU, two workers
    could run other kernels for batch-1 rows than for the same rows in a batch)."""
    pool = KVPool(loaded.geometry, torch.device("cpu"), slots=2, max_seq=32)
    r = StepRunner(loaded.model, pool, use_triton=True, gemv="on", invariant=True)
    assert r.gemv_rows == dict.fromkeys(PROJECTIONS, 0)


def test_the_invariant_runner_attends_with_the_fixed_split(loaded, monkeypatch):
    """Caught: runner.py's `**kernels.INVARIANT_ATTENTION` dropped (on CPU the unsplit reference is as invariant;
    on a GPU the split count follows the batch)."""
    calls = []
    real = ops.decode_attention
    monkeypatch.setattr(ops, "decode_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    pre = invariant_prefill.InvariantPrefill(loaded, 64)
    pre.run(PROMPT[:, :20])
    assert calls and all(kw.get("split_size") == ops.INVARIANT_ATTENTION["split_size"] for kw in calls)


def test_the_invariant_prefill_in_pieces_is_the_models_prompt(loaded, monkeypatch):
    """Caught: a later piece's positions counted from 0, the last piece's kept row not its last, the projections'
    bias dropped (the servers' tests compare the mode with itself; this compares it with HF's forward, and pieces of
    64 rows with one piece of the whole prompt, bit for bit)."""
    whole = invariant_prefill.InvariantPrefill(loaded, 150)
    layers1, logits1 = whole.run(PROMPT)
    layers1 = [(k.clone(), v.clone()) for k, v in layers1]
    monkeypatch.setattr(invariant_prefill, "ROWS_PER_FORWARD", 64)
    layers3, logits3 = whole.run(PROMPT)  # pieces of 64, 64, 22
    assert torch.equal(logits1, logits3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(layers1, layers3))
    with torch.no_grad():
        hf = loaded.model(PROMPT).logits[0, -1]
    torch.testing.assert_close(logits3, hf, atol=1e-4, rtol=1e-4)


def test_the_invariant_prefill_takes_a_prompt_of_exactly_its_limit(loaded):
    """Caught: `n > max_seq` written `>=` (a prompt of --max-prompt-tokens refused)."""
    pre = invariant_prefill.InvariantPrefill(loaded, 40)
    pre.run(PROMPT[:, :40])
    with pytest.raises(ValueError, match="41 prompt tokens"):
        pre.run(PROMPT[:, :41])


def test_pick_triton_honours_an_explicit_choice_on_cuda(monkeypatch):
    """Caught: `if use_triton is None` written `if not use_triton` (use_triton=False ignored where Triton runs)."""
    monkeypatch.setattr(backend, "_triton_importable", lambda: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert backend.pick_triton(None, cuda) and not backend.pick_triton(None, cpu)
    assert not backend.pick_triton(False, cuda)
    assert backend.pick_triton(True, cpu)


def test_the_gemv_takes_at_most_gemv_max_rows(monkeypatch):
    """Caught: `x.shape[0] > rows` written `>=` (batch 1 never on the GEMV), and max_rows not capped by
    GEMV_MAX_ROWS (the GEMV above the rows it was measured for)."""
    monkeypatch.setattr(projections, "_use_triton", lambda use_triton, device: True)
    w = torch.zeros(8, 16)
    x = lambda rows: torch.zeros(rows, 16)  # noqa: E731
    top = projections.GEMV_MAX_ROWS
    assert projections._gemv_ok(x(top), w, True, None) and projections._gemv_ok(x(1), w, True, 4)
    assert not projections._gemv_ok(x(top + 1), w, True, None)
    assert not projections._gemv_ok(x(top + 1), w, True, top + 4)
    assert not projections._gemv_ok(x(1), w, True, 0)
    assert not projections._gemv_ok(x(1), w.t(), True, None)  # a transposed weight stays on torch


def test_the_invariance_bench_seeds_exactly_its_first_n_requests():
    """Caught: `i < seeded` written `<=` (one greedy request sampled, counted as greedy)."""
    cfg = ServeConfig(num_prompts=6, input_len=10, output_len=2, vocab_size=100)
    reqs = invariance.requests(cfg, 2, 0.7, 0.9, False)
    assert [r.HasField("sampling") for r in reqs] == [True, True, False, False, False, False]
    assert [r.sampling.seed for r in reqs[:2]] == [invariance.SEED_BASE, invariance.SEED_BASE + 1]
    assert all(r.return_logits_digest for r in reqs)


def test_the_invariance_bench_sends_its_second_pass_in_the_order_it_reports(monkeypatch):
    """Caught: pass 2 in pass 1's order (the bench compares a request with itself beside the same neighbours)."""
    sent = []

    async def one_pass(addr, reqs, order, concurrency, timeout, step, name):
        sent.append(list(order))
        return [{"tokens": [1], "digests": ["d"], "code": None, "timing": None} for _ in reqs], 1.0

    monkeypatch.setattr(invariance, "one_pass", one_pass)
    cfg = ServeConfig(num_prompts=20, input_len=10, output_len=1, vocab_size=100)
    r = invariance.run_invariance(cfg, 0, 1.0, 1.0, False)
    assert sent[0] == list(range(20)) and sorted(sent[1]) == sent[0] and sent[1] != sent[0]
    assert r["second_order_head"] == sent[1][:16]


def test_the_invariance_bench_counts_a_request_that_failed_in_one_pass():
    """Caught: a request counted failed only when it failed in both passes (a failure read as a record)."""
    ok = {"tokens": [1, 2], "digests": ["a", "b"], "code": None, "timing": None}
    bad = {"tokens": [], "digests": [], "code": "UNAVAILABLE", "timing": None}
    cfg = ServeConfig(num_prompts=2, vocab_size=100)
    r = invariance.summarize(cfg, 0, [([ok, ok], 1.0), ([ok, bad], 1.0)], [1, 0])
    assert r["failed"] == 1 and not r["ok"] and r["kinds"]["greedy"]["compared"] == 1


def test_the_invariant_runner_adds_the_projections_bias():
    """Caught: runner.py's invariant projection without its bias (tiny has none: a Qwen2 of tiny shapes, whose qkv
    has one, against HF's forward)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kvtransfer.geometry import CacheGeometry
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # HF initialises biases to 0
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_()
    pool = KVPool(CacheGeometry.from_config(cfg, torch.float32), torch.device("cpu"), slots=1, max_seq=64)
    runner = StepRunner(model, pool, use_triton=False, invariant=True)
    ids = torch.randint(0, 128, (12,))
    n = ids.shape[0]
    logits = runner.forward(ids, torch.arange(n), torch.zeros(n, dtype=torch.long))
    with torch.no_grad():
        hf = model(ids[None]).logits[0]
    torch.testing.assert_close(logits, hf, atol=1e-4, rtol=1e-4)


def test_the_handshake_refuses_a_peer_that_disagrees_on_the_mode():
    """Caught fast: "batch_invariant" dropped from compat.mismatch's fields (test_batch_invariant's pair test
    catches it only when its 120 s wait for the refused decode worker runs out)."""
    from kvtransfer.rpc.compat import mismatch
    from proto import kvtransfer_pb2 as pb
    on, off = pb.Compat(batch_invariant=True), pb.Compat(batch_invariant=False)
    assert mismatch(on, on) is None and mismatch(off, off) is None
    assert "batch_invariant: here True, peer False" in mismatch(on, off)
    assert "--batch-invariant on both or neither" in mismatch(off, on)
