"""The batched decode engine on CPU: agreement with the HF forward, batch vs alone, slots and the scheduler.

What is claimed (and tested here):
- the engine's step agrees with the plain HF forward, teacher-forced, within ENGINE_VS_HF (fp32) for every
  architecture it runs (Llama: tiny, smollm2-135m; Qwen2 with q/k/v biases; a local HF directory);
- a request's logits inside a batch differ from the same request alone by at most BATCH_TOL (fp32, CPU): GEMM
  kernels are picked by shape, so this is a measured tolerance, not bit-identity; tokens are equal wherever the
  top-2 logit margin exceeds it;
- a request alone is bit-identical run to run (the same schedule gives the same bytes).
"""

from __future__ import annotations

import queue

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.engine.pool import KVPool, PoolFull
from kvtransfer.engine.runner import StepRunner, UnsupportedModel, check_supported
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, _seeded_init_, load_model

ENGINE_VS_HF = 1e-3  # fp32, max |logit diff| vs the HF forward, teacher-forced (measured: 2e-6 tiny, 1.3e-4 smollm2-135m)
BATCH_TOL = 1e-4  # fp32, max |logit diff| of a row in a batch vs the same request alone


def tiny_qwen2():
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, rope_theta=1e6,
                      tie_word_embeddings=False, use_sliding_window=False)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    _seeded_init_(m, 3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norm weights of their own, spread wider than the presets' 1 + N(0, 0.02)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return m


def teacher_forced_gap(model, prompt_len: int = 37, steps: int = 6) -> float:
    """Max |engine step logits - HF full-forward logits| over `steps` greedy tokens after a prompt."""
    g = CacheGeometry.from_config(model.config, torch.float32)
    pool = KVPool(g, torch.device("cpu"), slots=3, max_seq=prompt_len + steps + 1)
    runner = StepRunner(model, pool)
    ids = random_prompt(model.config.vocab_size, prompt_len, seed=prompt_len)
    cache, logits = prefill(model, ids)
    for (dk, dv), layer in zip(pool.views(1, prompt_len), cache.layers):
        dk.copy_(layer.keys)
        dv.copy_(layer.values)
    toks, rows = [int(logits.argmax())], []
    for i in range(steps):
        out = runner.forward(torch.tensor([toks[-1]]), torch.tensor([prompt_len + i]), torch.tensor([1]))
        rows.append(out[0])
        toks.append(int(out[0].argmax()))
    with torch.no_grad():
        ref = model(torch.tensor([ids[0].tolist() + toks[:-1]])).logits[0, prompt_len:]
    return (torch.stack(rows) - ref).abs().max().item()


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m"])
def test_engine_matches_hf_forward_presets(name):
    assert teacher_forced_gap(load_model(ModelSpec(name, "float32", 0))) <= ENGINE_VS_HF


def test_engine_matches_hf_forward_qwen2_with_biases():
    assert teacher_forced_gap(tiny_qwen2()) <= ENGINE_VS_HF


def test_engine_matches_hf_forward_local_directory(tmp_path):
    load_model(ModelSpec("tiny", "float32", 0)).save_pretrained(tmp_path)
    assert teacher_forced_gap(load_model(ModelSpec(str(tmp_path), "float32", 0))) <= ENGINE_VS_HF


def test_unsupported_architectures_are_refused_with_the_reason():
    cfg = Qwen2Config(use_sliding_window=True, sliding_window=128)
    with pytest.raises(UnsupportedModel, match="sliding window"):
        check_supported(cfg, max_seq=4096)
    cfg.model_type = "gpt2"
    with pytest.raises(UnsupportedModel, match="gpt2"):
        check_supported(cfg, max_seq=4096)


@pytest.fixture(scope="module")
def engine():
    lm = LoadedModel(ModelSpec("tiny", "float32", 0), load_model(ModelSpec("tiny", "float32", 0)), None,
                     torch.device("cpu"))
    lm.geometry = CacheGeometry.from_config(lm.model.config, torch.float32)
    e = DecodeEngine(lm, EngineOptions(max_batch=4, max_seq_len=256))
    yield e
    e.close()


def generate(engine, prompts, steps=8, want_digest=True):
    """Prefill each prompt into a slot, decode them together; per prompt (tokens, logits digests)."""
    runs = []
    for p in prompts:
        lease = engine.pool.try_lease()
        r = engine.prefill(p, lease, True).result(timeout=30)
        q = queue.Queue()
        runs.append((r.first, q, Sequence(1, lease, len(p), r.first, steps, q.put, want_digest)))
    for _, _, s in runs:
        engine.scheduler.add(s)
    out = []
    for first, q, _ in runs:
        toks, digs = [first], []
        while True:
            t = q.get(timeout=30)
            assert not isinstance(t, Ended), t
            toks.append(t.token_id)
            digs.append(t.logits_digest)
            if t.last:
                break
        out.append((toks, digs))
    return out


PROMPTS = [random_prompt(512, n, seed=n)[0].tolist() for n in (30, 77, 5, 120)]


def test_alone_is_bit_identical_run_to_run(engine):
    assert generate(engine, PROMPTS[:1]) == generate(engine, PROMPTS[:1])
    assert engine.pool.used() == 0


def test_batch_vs_alone_within_the_stated_tolerance(engine):
    """Each row's logits in a batch of 4 against the same request alone (HF forward over the tokens it made)."""
    together = generate(engine, PROMPTS)
    alone = [generate(engine, [p])[0] for p in PROMPTS]
    for (tb, _), (ta, _) in zip(together, alone):
        assert tb == ta  # tiny fp32: margins here are far above BATCH_TOL
    # the measured gap itself, logits against logits
    lease = [engine.pool.try_lease() for _ in PROMPTS]
    firsts = [engine.prefill(p, le, False).result(timeout=30).first for p, le in zip(PROMPTS, lease)]
    pos = torch.tensor([len(p) for p in PROMPTS])
    slots = torch.tensor([le.slot for le in lease])
    batch = engine.scheduler.call(engine.step, torch.tensor(firsts), pos, slots).result(timeout=30).clone()
    for j in range(len(PROMPTS)):  # the same positions again, one row at a time (the write is idempotent)
        one = engine.scheduler.call(engine.step, torch.tensor(firsts[j:j + 1]), pos[j:j + 1], slots[j:j + 1])
        assert (one.result(timeout=30)[0] - batch[j]).abs().max().item() <= BATCH_TOL
    for le in lease:
        le.release()
    assert engine.pool.used() == 0


def test_stop_drops_the_sequence_and_frees_its_slot(engine):
    lease = engine.pool.try_lease()
    r = engine.prefill(PROMPTS[0], lease, False).result(timeout=30)
    q = queue.Queue()
    s = Sequence(9, lease, len(PROMPTS[0]), r.first, 10_000, q.put)
    engine.scheduler.add(s)
    q.get(timeout=30)  # it runs
    s.stop("client cancelled")
    while not isinstance(item := q.get(timeout=30), Ended):
        pass
    assert item.reason == "client cancelled" and engine.pool.used() == 0


def test_pool_full_and_leases_held_twice():
    g = CacheGeometry(2, 1, 4, torch.float32)
    pool = KVPool(g, torch.device("cpu"), slots=2, max_seq=8)
    a, b = pool.try_lease(), pool.try_lease()
    with pytest.raises(PoolFull):
        pool.try_lease()
    a.hold()  # e.g. the receive loop while a frame lands
    a.release()
    assert pool.used() == 2
    a.release()
    assert pool.used() == 1 and pool.try_lease().slot == a.slot
    b.release()
    views = pool.views(1, 3)
    assert views[0][0].shape == (1, 1, 3, 4) and views[0][0].data_ptr() == pool.kv[0, 0, 1].data_ptr()
    with pytest.raises(ValueError, match="--max-seq-len"):
        pool.views(0, 9)


def test_eos_ends_the_sequence_when_asked(engine):
    tokens, _ = generate(engine, PROMPTS[:1], steps=8, want_digest=False)[0]
    stop_at = tokens[3]  # token index 3: the third decode step makes it
    lease = engine.pool.try_lease()
    r = engine.prefill(PROMPTS[0], lease, False).result(timeout=30)
    q = queue.Queue()
    engine.scheduler.add(Sequence(2, lease, len(PROMPTS[0]), r.first, 8, q.put, eos=frozenset([stop_at])))
    got = []
    while not (t := q.get(timeout=30)).last:
        got.append(t.token_id)
    got.append(t.token_id)
    assert got == tokens[1:tokens.index(stop_at) + 1] and engine.pool.used() == 0


def test_token_stream_stops_a_sequence_whose_client_does_not_read():
    import asyncio

    from decode_server.streams import Mailbox, TokenStream
    from kvtransfer.engine.sequence import EndCause, Token

    async def scenario():
        stream = TokenStream(Mailbox(asyncio.get_running_loop()), limit=3)
        pool = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=1, max_seq=4)
        stream.seq = Sequence(1, pool.try_lease(), 1, 0, 100, stream.sink)
        for i in range(3):
            stream.sink(Token(i + 1, 0, "", 0.0, False))
        assert not stream.seq.stopped
        await stream.next(deadline=1e18)  # one read: 2 unread
        stream.sink(Token(4, 0, "", 0.0, False))
        stream.sink(Token(5, 0, "", 0.0, False))  # 4 unread > 3
        assert stream.seq.stopped and stream.seq.stop_cause is EndCause.SLOW_READER
        assert "--stream-buffer-tokens" in stream.seq.stop_reason
    asyncio.run(scenario())


def test_mailbox_wakes_the_loop_once_per_burst_and_keeps_order():
    """Tokens posted from the scheduler thread reach each stream's queue in order, with one loop wake-up per burst."""
    import asyncio
    import threading

    from decode_server.streams import Mailbox

    async def scenario():
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        queues = [asyncio.Queue() for _ in range(3)]
        wakeups = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            wakeups.append(cb)
            return real(cb, *args)
        loop.call_soon_threadsafe = counting
        try:
            t = threading.Thread(target=lambda: [box.post(q, (i, j)) for i in range(4) for j, q in enumerate(queues)])
            t.start()
            t.join()
            got = [[await asyncio.wait_for(q.get(), 5) for _ in range(4)] for q in queues]
        finally:
            loop.call_soon_threadsafe = real
        assert got == [[(i, j) for i in range(4)] for j in range(3)]
        assert len(wakeups) == 1  # 12 posts before the loop ran: one drain
    asyncio.run(scenario())


def test_the_servicer_keeps_one_mailbox_per_loop():
    """Every stream of a server shares its loop's mailbox (one wake-up a step for all of them); a new loop (a server
    started again in the same process) gets a new one."""
    import asyncio
    import types

    from decode_server.request_path import RequestPath

    service = types.SimpleNamespace(_mailbox=None)

    async def boxes():
        return RequestPath._box(service), RequestPath._box(service)
    first, again = asyncio.run(boxes())
    assert first is again
    other, _ = asyncio.run(boxes())
    assert other is not first and other.loop is not first.loop
