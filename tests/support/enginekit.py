"""The in-process oracle for server tests: one request decoded alone by the same engine the decode server runs.

Why the engine and not the HF decode loop: the decode server decodes with its batched step, whose logits agree
with the HF forward only within a tolerance (tests/test_engine.py); a request alone is bit-identical between this
oracle and a server (same code, same shapes), which is what the pair-vs-colocated tests check byte for byte.
"""

from __future__ import annotations

import queue

import torch

from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.spec import ModelSpec

_ENGINES: dict[int, DecodeEngine] = {}


def cpu_engine(model, **options) -> DecodeEngine:
    """A fresh engine over a float32 `model` on CPU with these EngineOptions (the caller closes it)."""
    lm = LoadedModel(ModelSpec("tiny"), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    return DecodeEngine(lm, EngineOptions(**options))


def _engine(model) -> DecodeEngine:
    if id(model) not in _ENGINES:
        dtype = next(model.parameters()).dtype
        lm = LoadedModel(ModelSpec("tiny"), model, CacheGeometry.from_config(model.config, dtype), torch.device("cpu"))
        _ENGINES[id(model)] = DecodeEngine(lm, EngineOptions(max_batch=1, max_seq_len=4096, cuda_graphs=False))
    return _ENGINES[id(model)]


def engine_generate(model, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[str]]:
    """(tokens, logits digests) of greedy decoding `ids` alone, as the decode server does it."""
    e = _engine(model)
    lease = e.pool.try_lease()
    first = e.prefill(list(ids), lease, True).result(timeout=60)
    tokens, digests = [first.first], [first.digest]
    if max_new_tokens > 1:
        q: queue.Queue = queue.Queue()
        e.scheduler.add(Sequence(0, lease, len(ids), first.first, max_new_tokens - 1, q.put, True))
        while True:
            t = q.get(timeout=60)
            if isinstance(t, Ended):
                raise RuntimeError(t.reason)
            tokens.append(t.token_id)
            digests.append(t.logits_digest)
            if t.last:
                break
    else:
        lease.release()
    return tokens, digests


def serve_turn(e: DecodeEngine, prompt: list[int], new: int, reuse: bool = True, timeout: float = 120.0):
    """One request as the decode server runs it with its prefix cache: lease (taking a cached prefix), wait for the
    slot's copies, prefill the rest, decode `new` tokens greedily, keep the slot's context for later prompts.
    Returns (tokens, the Reuse taken or None, the slot's cache of the prompt as prefilled: per layer (k, v))."""
    import numpy as np
    lease = e.cache.acquire(prompt, reuse)
    if lease.ready is not None:
        lease.ready.synchronize()
    start = lease.reuse.length if lease.reuse else 0
    first = e.prefill(prompt, lease, False, None, start).result(timeout=timeout).first
    cache = [(k.clone(), v.clone()) for k, v in e.pool.views(lease.slot, len(prompt))]
    q: queue.Queue = queue.Queue()
    lease.hold()
    e.scheduler.add(Sequence(0, lease, len(prompt), first, new - 1, q.put))
    toks = [first]
    while True:
        t = q.get(timeout=timeout)
        assert not isinstance(t, Ended), t
        toks.append(t.token_id)
        if t.last:
            break
    lease.keep = np.asarray(prompt + toks[:-1])
    lease.release()
    return toks, lease.reuse, cache



def decode_prompts(e: DecodeEngine, vocab: int, plan: list[tuple[int, int]], timeout: float = 60.0) -> None:
    """For each (n, steps) of `plan` in order: a random n-token prompt (seed n) prefilled, then decoded for `steps`
    more tokens; a later prompt's prefill rides in the earlier ones' decode steps (--mixed-prefill). Returns once
    every stream ended with its last token; an Ended fails."""
    from kvtransfer.model.prefill import random_prompt

    q: queue.Queue = queue.Queue()
    for n, steps in plan:
        prompt = random_prompt(vocab, n, seed=n)[0].tolist()
        lease = e.pool.try_lease()
        first = e.prefill(prompt, lease, False).result(timeout=timeout).first
        e.scheduler.add(Sequence(n, lease, n, first, steps, q.put))
    done = 0
    while done < len(plan):
        item = q.get(timeout=timeout)
        assert not isinstance(item, Ended), item
        done += item.last
