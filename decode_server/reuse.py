"""How a Generate request meets the prefix cache: which cached prefix it may take, and what it reports.

Why apart from the servicer: the choice has a policy of its own (docs/prefix-cache.md): colocated, any cached prefix;
disaggregated, only one that leaves at most --local-suffix-max-tokens to prefill here (a longer rest goes to the
prefill worker whole); none for a request that skips the cache. What was reused goes to the request's Timing and
the metrics in one place.
"""

from __future__ import annotations

from proto import kvtransfer_pb2 as pb

TIERS = {"device": pb.CACHE_TIER_DEVICE, "host": pb.CACHE_TIER_HOST}


def slot_taker(cache, config, request, metrics, pool):
    """`take()` for decode_server.admission's queue: a lease for the request's prompt, with room for the prompt and
    its answer limit (paged: those blocks, reserved up front), through the prefix cache when there is one.
    Host-tier hits the break-even rule sends to recompute are counted."""
    need = len(request.token_ids) + request.max_new_tokens
    if cache is None:
        return lambda: pool.try_lease(need)
    here = config.colocated or request.mode == pb.MODE_COLOCATED
    limit = None if here else config.local_suffix_max_tokens
    reuse = not request.skip_prefix_cache and (here or limit > 0)

    def take():
        declined = cache.stats.host_recomputed
        lease = cache.acquire(request.token_ids, reuse, limit, need)
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
