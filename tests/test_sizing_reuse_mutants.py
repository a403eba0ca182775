"""The sizing and prefix-reuse half of the mutation pass whose engine and admission half is
tests/test_chunk_admission_mutants.py (its docstring gives the pass's counts): decode_server/sizing.py (the pool's
plan and the start line) and decode_server/reuse.py (which cached prefix a request may take, what its lease
reserves, what a reuse counts). Each test here failed on a one-line change of that code that the defaults,
validation, prefix cache and server tests (test_prefix_servers.py, test_preempt_servers.py, test_paged_servers.py)
let through; its docstring names the change it kills ("kills ..."), and each was seen failing with that change
planted and passing on the clean code.

Why without servers: the servers' prefix tests run one scenario per decision (a pair's auto turn under the suffix
limit, a host-tier reload, a pool of a few blocks), where a colocated server holding auto requests to the suffix
limit, a preempted request's reserve or a count by hits instead of tokens does not show. Here each is one call,
with a fake prefix cache and fake metrics, or a memory figure stood in for a device: the file runs in about a
second on 2 cores, the same way every time.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from decode_server import sizing
from decode_server.config import DecodeConfig
from decode_server.reuse import count_reuse, resume_taker, slot_taker
from decode_server.sizing import GIB, Memory, plan_blocks, plan_engine, plan_pool
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.spec import ModelSpec
from proto import kvtransfer_pb2 as pb


# --- the KV pool's size (decode_server/sizing.py) ---


def test_a_slot_pool_that_cannot_hold_one_max_seq_len_slot_is_refused_naming_the_flag():
    """A bug this pass found (mutant S10's clean behaviour): --kv-block-tokens 0 with --max-seq-len and no --max-batch
    on a budget under one slot of it returned one slot anyway, a pool over the budget asked for (--kv-pool-gib 0.01
    gave a 32,768-token slot, 3.2x over). Refused now, naming --max-seq-len; a budget of exactly one slot holds one."""
    bpt = 1000
    budget_gib = 10_000 * bpt / GIB  # 10,000 tokens
    try:
        plan_pool(bpt, 32768, 0, 32768, budget_gib, 0.9, None, 0, 128)
    except ValueError as e:
        assert "--max-seq-len 32768" in str(e) and "10000 tokens" in str(e), e
    else:
        raise AssertionError("a pool over its budget was planned")
    assert plan_pool(bpt, 32768, 0, 10_000, budget_gib, 0.9, None, 0, 128).slots == 1


def test_a_paged_pool_on_the_gpu_is_cut_to_max_batch_rows_of_max_seq_len():
    """kills plan_blocks' `max_batch x (max_seq_len or context)` made `max_batch x context` (--max-batch 2
    --max-seq-len 1024 on a 4096-token model took blocks for 2 x 4096 tokens: four times what its rows can fill, out
    of a GPU another server may share; tests/test_validation_mutants.py sizes one with --max-seq-len 0 only)."""
    bpt = 28 * 2 * 4 * 128 * 2  # Qwen2.5-7B in bf16
    plan = plan_blocks(bpt, 4096, 64, 2, 1024, 100 << 30, "0.9 of 80.0 GiB", 128)
    assert (plan.blocks, plan.slots, plan.max_seq) == (2 * 1024 // 64, 2, 1024)


def test_a_pool_short_of_one_context_makes_one_slot_of_what_it_holds():
    """kills plan_pool's `min(context, tokens)` made `context` (a 32k-context model on a budget of 10,000 tokens got
    one slot of 32,768: a pool over three times --gpu-memory-utilization's share, allocated anyway)."""
    plan = plan_pool(1000, 32768, 0, 0, 10000 * 1000 / GIB, 0.9, None, 0, 128)
    assert (plan.slots, plan.max_seq) == (1, 10000)


def test_the_decode_partials_are_kept_for_max_batch_rows_above_the_auto_cap(monkeypatch, tiny_fp32):
    """kills plan_engine's partials for `max(--max-batch, cap)` rows made `cap` (--max-batch 512 kept the decode
    attention's partials of 256 rows out of the pool: the other 256 rows' came out of the memory the pool was
    sized to leave free)."""
    rows = []
    monkeypatch.setattr(sizing, "device_memory", lambda device: Memory(total=80 * GIB, free=70 * GIB, ours=GIB))
    monkeypatch.setattr(sizing, "attention_partials_bytes", lambda config, n, max_seq: rows.append(n) or 0)
    cuda = LoadedModel(ModelSpec("tiny", "float32"), tiny_fp32,
                       CacheGeometry.from_config(tiny_fp32.config, torch.float32), torch.device("cuda", 0))
    options, _ = plan_engine(DecodeConfig(colocated=True, exact=True, max_batch=512), cuda, 0)
    assert rows == [512] and options.max_batch == 512


def test_the_start_line_sizes_a_paged_pool_by_its_blocks(tiny_fp32):
    """kills plan_engine's logged pool size `blocks x page` made `slots x max_seq` for a paged pool (the start line
    said 0.02 GiB for a CPU pool of 1024 blocks of 64 float32 tokens of 1 KiB: 0.06 GiB)."""
    cpu = LoadedModel(ModelSpec("tiny", "float32"), tiny_fp32,
                      CacheGeometry.from_config(tiny_fp32.config, torch.float32), torch.device("cpu"))
    _, line = plan_engine(DecodeConfig(colocated=True, kv_block_tokens=64, max_seq_len=1024), cpu, 0)
    assert "KV pool 1024 blocks of 64 tokens, 16 rows x 1024 B/token = 0.06 GiB" in line, line


# --- which prefix a request may take, and what it reserves (decode_server/reuse.py) ---


class _Counter:
    """A metric that adds up what each label was counted."""

    def __init__(self):
        self.by = {}

    def labels(self, label):
        return SimpleNamespace(inc=lambda n=1: self.by.__setitem__(label, self.by.get(label, 0) + n))

    def inc(self, n=1):
        self.labels("").inc(n)


class _Cache:
    """A prefix cache that records what acquire was asked (tokens, reuse, max_suffix, need)."""

    def __init__(self, declines: int = 0):
        self.asked, self.stats, self.declines = [], SimpleNamespace(host_recomputed=0), declines

    def acquire(self, tokens, reuse, max_suffix, need):
        self.asked.append((len(tokens), reuse, max_suffix, need))
        self.stats.host_recomputed += self.declines  # host hits the break-even rule sent to recompute
        return "lease"


POOL = SimpleNamespace(page=16, try_lease=lambda need=None: ("lease", need))


def _request(mode=pb.MODE_AUTO, skip=False, n=40, max_new=100):
    return SimpleNamespace(token_ids=list(range(n)), mode=mode, skip_prefix_cache=skip, max_new_tokens=max_new)


def test_the_prefix_a_request_may_take_follows_where_it_is_prefilled():
    """kills slot_taker's `config.colocated or` dropped (a --colocated server held a request of mode auto to
    --local-suffix-max-tokens, which only a disaggregated pair's prefill worker needs), `or request.mode ==
    MODE_COLOCATED` dropped (a colocated request to a pair, prefilled here whatever the suffix, was held to it too),
    and `limit = None if here else ..` made `limit = ..` (every request held to it). The reserve is the prompt and
    one block of the answer (16 positions), under max_new_tokens."""
    def asked(colocated, mode, skip=False):
        cache = _Cache()
        config = SimpleNamespace(colocated=colocated, local_suffix_max_tokens=8)
        slot_taker(cache, config, _request(mode, skip), _Counter(), POOL)()
        return cache.asked
    assert asked(True, pb.MODE_AUTO) == [(40, True, None, 56)]
    assert asked(False, pb.MODE_COLOCATED) == [(40, True, None, 56)]
    assert asked(False, pb.MODE_AUTO) == [(40, True, 8, 56)]
    assert asked(True, pb.MODE_AUTO, skip=True) == [(40, False, None, 56)]
    assert slot_taker(None, None, _request(max_new=5), None, POOL)() == ("lease", 45)


def test_a_resumed_request_reserves_what_it_has_left_and_keeps_its_skip():
    """kills resume_taker's reserve of `left` made request.max_new_tokens (a preempted request 3 tokens from its
    end reserved a whole block again, and could wait for memory it will never use), its context's length made one
    short, and `not request.skip_prefix_cache` made True (a request that skips the prefix cache took a cached
    prefix once preempted). Context: a 40-token prompt and 10 tokens made."""
    cache = _Cache()
    taken = resume_taker(cache, _request(skip=True), list(range(50)), 3, _Counter(), POOL)()
    assert taken == "lease" and cache.asked == [(50, False, None, 53)]
    assert resume_taker(None, _request(), list(range(50)), 30, None, POOL)() == ("lease", 66)


def test_a_reuse_counts_its_tokens_and_a_host_reload_its_bytes():
    """kills count_reuse's prefix_tokens `.inc(reuse.length)` made `.inc()` (kvt_prefix_reused_tokens counted hits,
    not tokens: one per request whatever it reused)."""
    metrics = SimpleNamespace(**{name: _Counter() for name in
                                 ("prefix_hits", "prefix_tokens", "reload_bytes", "host_decisions")})
    timing = pb.Timing()
    count_reuse(SimpleNamespace(tier="host", length=48, bytes=4096, how="reloaded"), timing, metrics)
    assert (timing.reused_tokens, timing.reuse_tier, timing.reload_bytes) == (48, pb.CACHE_TIER_HOST, 4096)
    assert metrics.prefix_tokens.by == {"host": 48} and metrics.prefix_hits.by == {"host": 1}
    assert metrics.reload_bytes.by == {"": 4096} and metrics.host_decisions.by == {"reload": 1}


def test_every_host_hit_one_take_sends_to_recompute_is_counted():
    """kills _through's `.inc(host_recomputed - declined)` made `.inc()` (one acquire may decline several host-tier
    matches, one per cached conversation sharing the prompt's opening: kvt_prefix_host_decisions_total counted one)."""
    metrics = SimpleNamespace(host_decisions=_Counter())
    config = SimpleNamespace(colocated=True, local_suffix_max_tokens=0)
    slot_taker(_Cache(declines=2), config, _request(), metrics, POOL)()
    slot_taker(_Cache(), config, _request(), metrics, POOL)()
    assert metrics.host_decisions.by == {"recompute": 2}
