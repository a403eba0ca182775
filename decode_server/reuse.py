"""How a Generate request meets the prefix cache: which cached prefix it may take, and what it reports.

Why apart from the servicer: the choice has a policy of its own (docs/prefix-cache.md): colocated, any cached prefix;
disaggregated, only one that leaves at most --local-suffix-max-tokens to prefill here (a longer rest goes to the
prefill worker whole); none for a request that skips the cache. What was reused goes to the request's Timing and
the metrics in one place.
"""

from __future__ import annotations

from proto import kvtransfer_pb2 as pb

TIERS = {"device": pb.CACHE_TIER_DEVICE, "host": pb.CACHE_TIER_HOST}


def reserved(pool, tokens: int, max_new_tokens: int) -> int:
    """The positions a lease takes at admission: the context's and a reserve of one block of the answer (at most
    max_new_tokens). The rest of the answer's blocks are taken as it decodes, and a request is preempted when none
    is left (kvtransfer/engine/preempt.py); the slot layout holds a whole context whatever this says."""
    return tokens + min(max_new_tokens, pool.page)


def slot_taker(cache, config, request, metrics, pool):
    """`take()` for decode_server.admission's queue: a lease for the request's prompt, with room for the prompt and
    a reserve (`reserved`), through the prefix cache when there is one. Host-tier hits the break-even rule sends to
    recompute are counted."""
    need = reserved(pool, len(request.token_ids), request.max_new_tokens)
    if cache is None:
        return lambda: pool.try_lease(need)
    here = config.colocated or request.mode == pb.MODE_COLOCATED
    limit = None if here else config.local_suffix_max_tokens
    reuse = not request.skip_prefix_cache and (here or limit > 0)
    return _through(cache, metrics, request.token_ids, reuse, limit, need)


def resume_taker(cache, request, tokens, left: int, metrics, pool):
    """`take()` for a preempted request coming back: a lease for its context `tokens` (the prompt and the tokens
    it made; the last one's KV is made by the next step) and a reserve of the `left` tokens still to make; through
    the prefix cache (colocated or not: a preempted request is recomputed here) unless the request skips it."""
    need = reserved(pool, len(tokens), left)
    if cache is None:
        return lambda: pool.try_lease(need)
    return _through(cache, metrics, tokens, not request.skip_prefix_cache, None, need)


def _through(cache, metrics, tokens, reuse: bool, limit, need: int):
    def take():
        declined = cache.stats.host_recomputed
        lease = cache.acquire(tokens, reuse, limit, need)
        if cache.stats.host_recomputed > declined:
            metrics.host_decisions.labels("recompute").inc(cache.stats.host_recomputed - declined)
        return lease
    return take


def count_reuse(reuse, timing: pb.Timing, metrics) -> None:
    """A taken prefix (kvtransfer.engine.prefix_cache.Reuse) into the request's Timing and the metrics."""
    timing.reused_tokens, timing.reuse_tier = reuse.length, TIERS[reuse.tier]
    metrics.prefix_hits.labels(reuse.tier).inc()
    metrics.prefix_tokens.labels(reuse.tier).inc(reuse.length)
    if reuse.tier == "host":
        timing.reload_bytes = reuse.bytes
        metrics.reload_bytes.inc(reuse.bytes)
        metrics.host_decisions.labels("reload").inc()
