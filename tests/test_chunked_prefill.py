"""Chunked local prefill (--prefill-chunk): what equals the whole prefill, and within what tolerance.

Claim: a prompt no longer than one chunk runs exactly the whole prefill (bit-identical first token logits and
cache). A longer prompt, prefilled chunk by chunk, attends over the same keys in other kernel shapes: its first
token's logits and its cache agree with the whole prefill within CHUNK_TOL (fp32, CPU), and its greedy tokens
are equal (tiny's top-2 margins are far above that).
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model

CHUNK_TOL = 1e-4  # fp32 max |diff| of first-token logits and of cache values (measured ~1e-6 on tiny)


def engine(chunk: int) -> DecodeEngine:
    model = load_model(ModelSpec("tiny", "float32", 0))
    lm = LoadedModel(ModelSpec("tiny", "float32"), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    return DecodeEngine(lm, EngineOptions(max_batch=2, max_seq_len=512, cuda_graphs=False, prefill_chunk=chunk))


def prefilled(e: DecodeEngine, ids: list[int]):
    lease = e.pool.try_lease()
    r = e.prefill(ids, lease, True).result(timeout=60)
    cache = [(k.clone(), v.clone()) for k, v in e.pool.views(lease.slot, len(ids))]
    lease.release()
    return r, cache


def running(e: DecodeEngine):
    """A sequence decoding in `e` (400 tokens to make), its first token already out: the stream a prefill runs
    beside. Returns its token queue."""
    import queue

    from kvtransfer.engine.sequence import Sequence

    lease = e.pool.try_lease()
    r = e.prefill([1, 2, 3], lease, False).result(timeout=60)
    q: queue.Queue = queue.Queue()
    e.scheduler.add(Sequence(1, lease, 3, r.first, 400, q.put))
    q.get(timeout=30)
    return q


def test_chunked_prefill_agrees_with_whole_prefill():
    whole, chunked = engine(0), engine(64)
    try:
        short = random_prompt(512, 40, seed=2)[0].tolist()
        a, ca = prefilled(whole, short)
        b, cb = prefilled(chunked, short)
        assert (a.first, a.digest) == (b.first, b.digest)  # one chunk: the very same forward
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(ca, cb))
        ids = random_prompt(512, 300, seed=3)[0].tolist()  # 5 chunks of 64 (the last one short)
        a, ca = prefilled(whole, ids)
        b, cb = prefilled(chunked, ids)
        assert a.first == b.first
        for (ka, va), (kb, vb) in zip(ca, cb):
            assert (ka - kb).abs().max() <= CHUNK_TOL and (va - vb).abs().max() <= CHUNK_TOL
    finally:
        whole.close()
        chunked.close()


def test_decode_steps_run_between_chunks():
    """A running sequence advances while a long prompt is prefilled in chunks (the point of chunking)."""


    e = engine(32)
    try:
        running(e)
        before = e.scheduler.steps
        other = e.pool.try_lease()
        e.prefill(random_prompt(512, 320, seed=4)[0].tolist(), other, False).result(timeout=60)
        assert e.scheduler.steps - before >= 9  # 10 chunks: at least one step between each two
        other.release()
    finally:
        e.close()


def test_no_gap_between_two_tokens_waits_for_two_chunks(monkeypatch):
    """The order of device work around a chunked prefill's end, as a GPU would run it.

    The scheduler queues step k+1 before it waits for step k's tokens (scheduler.py), so in the middle of a
    prefill each gap between two tokens of a running stream waits for one chunk and one step. A read of the
    device on the scheduler thread (`.item()`, `int()`, `.cpu()`, a synchronize) waits for all work queued so
    far: the prefill job read its first token in the gap that queued its last chunk, so the step queued before
    that chunk handed out its tokens only after it, two chunks in one gap (one H100, 32 streams and a 32k prompt
    in 512-token chunks: one 105-109 ms gap after ~53 ms ones, bench/results/fused-h100-2026-12-07 call 6).
    On CPU every op runs at once, so the log models the stream: each launch (step, chunk) in order, a step's
    delivery waits for that step, any other read on the scheduler thread for every launch so far. Between two
    deliveries at most one chunk may be waited for (an order, not a time). And the job waits for nothing before its
    first piece: a synchronize there held the host until the step in flight was done, so the piece's launches could
    not overlap it."""
    import threading
    import time

    import kvtransfer.determinism as determinism
    import kvtransfer.engine.engine as engine_mod
    import kvtransfer.engine.scheduler as scheduler_mod

    e = engine(16)
    try:
        running(e)
        events, launched, inside = [], [0], set()  # ("chunk", i) | ("deliver", i) | ("read", i): i = launches so far

        def on_thread():
            return threading.current_thread() is e.scheduler._thread

        def queue_step(*a, real=scheduler_mod.queue_step, **k):
            launched[0] += 1
            inside.add("step")  # the CPU reference attention reads lengths on the host; on CUDA a kernel does
            try:
                out = real(*a, **k)
            finally:
                inside.discard("step")
            out.launch = launched[0]
            return out

        def deliver(self, done, newer, real=scheduler_mod.Scheduler._deliver):
            if hasattr(done, "launch"):
                events.append(("deliver", done.launch))
            inside.add("deliver")  # its reads wait for its step's event only
            try:
                return real(self, done, newer)
            finally:
                inside.discard("deliver")

        def chunk(*a, real=engine_mod.prefill, **k):
            launched[0] += 1
            events.append(("chunk", launched[0]))
            return real(*a, **k)

        def read(name):
            real = getattr(torch.Tensor, name)

            def wrapped(self, *a, **k):
                if on_thread() and not inside:
                    events.append(("read", launched[0]))
                return real(self, *a, **k)
            return wrapped
        for name in ("__int__", "item", "tolist", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, read(name))

        def sync(*a, **k):  # determinism.sync, torch.cuda.synchronize: a wait for every launch so far (no-ops here)
            if on_thread() and not inside:
                events.append(("read", launched[0]))
        monkeypatch.setattr(engine_mod, "sync", sync, raising=False)  # the engine has none (a wait on the device)
        monkeypatch.setattr(determinism, "sync", sync)
        monkeypatch.setattr(torch.cuda, "synchronize", sync)
        monkeypatch.setattr(engine_mod, "prefill", chunk)
        monkeypatch.setattr(scheduler_mod.Scheduler, "_deliver", deliver)
        monkeypatch.setattr(scheduler_mod, "queue_step", queue_step)
        end = time.monotonic() + 30  # a step queued and delivered under the patches: the log is whole from here
        while not any(kind == "deliver" for kind, _ in list(events)):
            assert time.monotonic() < end, events
            time.sleep(0.01)
        other = e.pool.try_lease()
        events.append(("submit", launched[0]))
        e.prefill(random_prompt(512, 200, seed=4)[0].tolist(), other, True).result(timeout=60)  # 13 chunks
        end = time.monotonic() + 30  # two more steps delivered after the last chunk: the stream saw it through
        while sum(kind == "deliver" and i > max(c for k, c in events if k == "chunk") for kind, i in list(events)) < 2:
            assert time.monotonic() < end, events
            time.sleep(0.01)
        monkeypatch.undo()
        submit = events.index(next(x for x in events if x[0] == "submit"))
        before = events[submit:events.index(next(x for x in events if x[0] == "chunk"))]
        assert not [x for x in before if x[0] == "read"], before  # the job launches its first piece behind the step
        # in flight: no wait for the device first (a synchronize held the host until that step was done)
        events = [x for x in events if x[0] != "submit"]
        chunks = [i for kind, i in events if kind == "chunk"]
        waited, last, per_gap = 0, 0, []  # chunks waited for between each two deliveries
        for kind, i in events:
            if kind != "chunk":
                waited = max(waited, i)
            if kind == "deliver":
                per_gap.append(sum(last < c <= waited for c in chunks))
                last = waited
        assert len(chunks) == 13 and sum(per_gap) == 13, (chunks, per_gap)
        assert max(per_gap) == 1, per_gap  # at the end of the prefill as in its middle
        other.release()
    finally:
        e.close()


@pytest.mark.parametrize("n,start,sizes", [(300, 0, [64] * 5), (256, 0, [64] * 4), (200, 30, [64] * 3),
                                            (60, 30, [30])])
def test_every_later_chunk_is_padded_to_the_chunk(monkeypatch, n, start, sizes):
    """Every forward after a job's first runs --prefill-chunk rows: a short last chunk is padded after its last real
    token (engine.pad_chunk); a job's first piece keeps its size (a reused prefix's short suffix: 30 rows, not 64).
    Its first-token logits (the last real row's, not a pad's) and the cache agree with the whole prefill within
    CHUNK_TOL, no pad reaches the pool (the slot's positions after the prompt stay as they were, zero), and no
    pad's position passes the prompt's last (RoPE's range).
    Unpadded, the short last chunk was a row count the server had not run, and its first use of kernels for that
    shape stalled the running streams (bench/results/stall-h100-2026-12-07)."""
    import kvtransfer.engine.engine as engine_mod

    seen = []

    def recording(model, ids, *a, real=engine_mod.prefill, **k):
        cache, logits = real(model, ids, *a, **k)
        seen.append((ids.shape[1], logits.clone()))
        return cache, logits
    monkeypatch.setattr(engine_mod, "prefill", recording)
    whole, chunked = engine(0), engine(64)
    rope, positions = chunked.m.model.model.rotary_emb, []
    monkeypatch.setattr(rope, "forward", lambda x, position_ids, real=rope.forward: (
        positions.append(int(position_ids.max())), real(x, position_ids))[1])
    try:
        ids = random_prompt(512, n, seed=5)[0].tolist()
        a, ca = prefilled(whole, ids)
        want = seen[-1][1]
        lease = chunked.pool.try_lease()
        if start:  # a reused prefix already in the slot
            chunked.prefill(ids[:start], lease, False).result(timeout=60)
        seen.clear()
        b = chunked.prefill(ids, lease, False, start=start).result(timeout=60)
        assert [m for m, _ in seen] == sizes
        assert max(positions) == n - 1  # a pad sits at the last real token's position, never past the prompt
        assert b.first == a.first and (seen[-1][1] - want).abs().max() <= CHUNK_TOL
        for (ka, va), (kb, vb) in zip(ca, chunked.pool.views(lease.slot, n)):
            assert (ka - kb).abs().max() <= CHUNK_TOL and (va - vb).abs().max() <= CHUNK_TOL
        for k, v in chunked.pool.views(lease.slot, 512):
            assert not k[:, :, n:].any() and not v[:, :, n:].any()  # no pad's K/V in the pool
        lease.release()
    finally:
        whole.close()
        chunked.close()


def test_every_piece_of_a_chunked_prefill_runs_on_the_fused_ops(monkeypatch):
    """A chunked prompt, and a prompt after a reused prefix, never run the HF forward: its pieces go into one block on
    the fused ops (fused_prefill.chunk_cache). On the HF forward each later chunk launched ~4x the kernels and copied
    the cache so far per layer (bench/results/stall-h100-2026-12-07: the chunk path was launch-bound)."""
    e = engine(64)
    hf = []
    monkeypatch.setattr(type(e.m.model), "forward", lambda *a, **k: hf.append(1) or pytest.fail("the HF forward ran"))
    try:
        ids = random_prompt(512, 200, seed=8)[0].tolist()
        lease = e.pool.try_lease()
        whole = e.prefill(ids, lease, False).result(timeout=60)  # 64 x 3 + 8 padded
        again = e.prefill(ids, lease, False, start=150).result(timeout=60)  # the last 50 after a reused prefix
        assert hf == [] and whole.first == again.first
        lease.release()
    finally:
        e.close()


@pytest.mark.parametrize("chunk,n,start,room", [(64, 200, 0, 263), (64, 200, 150, 200), (0, 400, 390, 400),
                                                (64, 200, 100, 263)])
def test_the_prompts_block_holds_the_prompt_and_only_the_pads_it_needs(monkeypatch, chunk, n, start, room):
    """chunk_cache's block: the prompt and the last piece's pads (n + chunk - 1) when the job runs several pieces,
    the prompt alone when it runs one (a reused prefix's suffix, --prefill-chunk 0): a 32k prompt's block is ~1.9 GB
    for Qwen2.5-7B, so twice that was a waste (the review found n + chunk for an unchunked suffix: 2n)."""
    import kvtransfer.engine.engine as engine_mod

    asked = []
    monkeypatch.setattr(engine_mod, "chunk_cache", lambda model, positions, *a, real=engine_mod.chunk_cache, **k: (
        asked.append(positions), real(model, positions, *a, **k))[1])
    e = engine(chunk)
    try:
        ids = random_prompt(512, n, seed=9)[0].tolist()
        lease = e.pool.try_lease()
        if start:
            e.prefill(ids[:start], lease, False).result(timeout=60)
        asked.clear()
        e.prefill(ids, lease, False, start=start).result(timeout=60)
        assert asked == [room]
        lease.release()
    finally:
        e.close()


def test_a_reused_prefix_continues_at_its_positions_in_a_sliding_window_model(monkeypatch):
    """A Mistral-style model (a sliding window no shorter than the slot, so it never binds) prefilling after a reused
    prefix: the past comes from the pool (engine.past_cache), and its sliding-window layers count positions apart
    from their keys. Left at 0, that count put the suffix's RoPE at position 0: logits off by ~3e-3."""
    from transformers import MistralConfig, MistralForCausalLM

    import kvtransfer.engine.engine as engine_mod

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                             max_position_embeddings=4096, sliding_window=1024)).eval()
    logits = []

    def recording(*a, real=engine_mod.prefill, **k):
        cache, out = real(*a, **k)
        logits.append(out.clone())
        return cache, out
    monkeypatch.setattr(engine_mod, "prefill", recording)
    lm = LoadedModel(ModelSpec("tiny", "float32"), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    e = DecodeEngine(lm, EngineOptions(max_batch=2, max_seq_len=512, cuda_graphs=False, prefill_chunk=64))
    try:
        ids = random_prompt(512, 100, seed=6)[0].tolist()
        whole = model(torch.tensor([ids])).logits[0, -1]
        lease = e.pool.try_lease()
        e.prefill(ids[:30], lease, False).result(timeout=60)
        e.prefill(ids, lease, False, start=30).result(timeout=60)  # 64 rows after the prefix, then 6 padded
        assert (logits[-1] - whole).abs().max() <= CHUNK_TOL
        lease.release()
    finally:
        e.close()


def test_a_job_in_hand_at_close_is_closed_and_told():
    """A prefill between two of its pieces when the server stops (every prefill is, since the first token is read
    one gap after its last forward): the scheduler closes the generator (its `finally` releases the lease) and fails
    its future, so the caller learns at once instead of at its deadline."""
    import threading

    e = engine(16)
    started, finished = threading.Event(), threading.Event()

    def job():
        try:
            started.set()
            while True:
                yield
        finally:
            finished.set()
    try:
        held = job()  # held here too, so only an explicit close (not the last reference dropped) runs its finally
        fut = e.scheduler.submit(held)
        assert started.wait(30)
    finally:
        e.close()
    assert finished.wait(30)
    with pytest.raises(RuntimeError, match="stopping"):
        fut.result(timeout=30)


@pytest.mark.parametrize("chunk,max_seq,pieces", [(0, 512, []), (64, 512, [(64, True, -1), (64, True, 31)]),
                                                  (64, 80, [(64, True, -1), (64, True, 14)]), (64, 65, [])])
def test_the_warm_up_runs_each_local_prefill_path_once_and_leaves_the_pool_alone(monkeypatch, chunk, max_seq, pieces):
    """warm_local_prefill, which a CUDA engine runs at start (a kernel's first use there costs its module's load,
    cuBLAS's setup and Triton's compile; the first padded chunk held running streams ~26 ms over its device time):
    a whole prompt, then with a chunk a first piece and a padded piece on the fused ops, as prefill_job runs them."""
    import kvtransfer.engine.engine as E

    e = engine(64)
    try:
        before = e.pool.kv.clone()  # every layer, block and position, the scratch block included
        calls = []
        real = E.prefill

        def spy(model, ids, on_layer=None, cache=None, fused=True, row=-1):
            calls.append((ids.shape[1], None if cache is None else cache.fused, row))
            return real(model, ids, on_layer, cache, fused, row)

        monkeypatch.setattr(E, "prefill", spy)
        E.warm_local_prefill(e.m.model, e.m.device, chunk, max_seq)  # 1.5 chunks, at most max_seq - 1 tokens
        assert calls == [(16, None, -1)] + pieces
        assert torch.equal(e.pool.kv, before)
    finally:
        e.close()
