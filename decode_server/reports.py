"""What the decode server says about itself: Info (the model and the limits a request must keep), Load (how
busy it is now) and the Prometheus gauges read live from the same state.

Why apart from the servicer: all are read by other programs (the OpenAI front asks Info once; a router polls Load
to place requests; Prometheus scrapes the gauges), so their fields are a contract of their own, built here from
the engine's state.
"""

from __future__ import annotations

import os

from proto import kvtransfer_pb2 as pb


def info_response(engine, config, vocab: int) -> pb.InfoResponse:
    m = engine.m
    return pb.InfoResponse(model=os.path.basename(os.path.normpath(m.spec.name)), vocab_size=vocab,
                           context_length=m.model.config.max_position_embeddings,
                           max_seq_len=engine.pool.max_seq, max_new_tokens=config.max_new_tokens,
                           max_prompt_tokens=config.max_prompt_tokens, eos_token_ids=sorted(engine.eos),
                           prefix_block_tokens=engine.cache.block if engine.cache is not None else 0,
                           max_waiting=config.max_waiting, kv_block_tokens=engine.pool.page,
                           kv_blocks=engine.pool.blocks, max_batch=engine.pool.slots)


def load_response(requests, engine, serving: bool, queued: int, preemptions: int = 0) -> pb.LoadResponse:
    """`requests`: the server's running requests (kvtransfer.rpc.lifecycle.Request): decoding ones count their
    context and the tokens left to make, admitted ones not decoding yet their prompt (a preempted one waiting to be
    readmitted too); `queued` of those are in the admission queue (decode_server/admission.py), waiting for KV
    memory; `preemptions`: since start."""
    out = pb.LoadResponse(serving=serving, queued_requests=queued, preemptions=preemptions)
    for r in list(requests):
        seq = r.seq
        if seq is not None and not seq.over:
            out.running_requests += 1
            out.running_tokens += seq.length  # (tokens) the KV it holds
            out.remaining_tokens += max(seq.remaining, 0)
        elif r.prompt_tokens:
            out.waiting_requests += 1
            out.waiting_tokens += r.prompt_tokens
    pool, cache = engine.pool, engine.cache
    out.free_slots = pool.slots - pool.used()  # cached slots count: they are taken back on demand
    out.cached_slots = cache.cached_slots() if cache is not None else 0
    out.cached_blocks = cache.cached_blocks() if cache is not None else 0
    out.free_blocks = pool.free_blocks()
    out.shared_blocks = pool.shared_blocks()
    return out


def watch_gauges(metrics, engine, peers, inflight, waiting) -> None:
    """The gauges that read their value when scraped: requests in the server (`inflight()`) and of those waiting
    for KV memory (`waiting()`), pool slots used, free and shared blocks, cached slots and host-tier bytes (with the prefix cache),
    sequences running, and with prefill peers the data plane's buffers, expected frames and receivers."""
    metrics.inflight.set_function(inflight)
    metrics.waiting.set_function(waiting)
    metrics.pool_slots.set_function(engine.pool.used)
    metrics.free_blocks.set_function(engine.pool.free_blocks)
    metrics.shared_blocks.set_function(engine.pool.shared_blocks)
    if engine.cache is not None:
        metrics.cached_slots.set_function(engine.cache.cached_slots)
        metrics.host_cache_bytes.set_function(engine.cache.host_bytes)
    metrics.running.set_function(engine.scheduler.active)
    metrics.prompts_queued.set_function(engine.scheduler.prompts_queued)
    if peers is not None:
        metrics.buffer_bytes.set_function(peers.buffer_bytes)
        metrics.expected.set_function(peers.pending)
        metrics.receivers.set_function(peers.receivers)
        metrics.receive_loops.set_function(peers.receive_loops)
