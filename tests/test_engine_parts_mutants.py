"""Gaps in the engine parts' tests found by planting one-line bugs (a mutation pass over sampler.py, preempt.py,
prefix_index.py, sequence.py, reload_rule.py and prompt_queue.py), each closed here by a unit test on CPU (no model,
no server, no timing: a fake clock where a time is read).

Why: test_sampler.py checks draws against the kept set's definition on random rows, where a mass lands exactly on
top_p x Z with probability zero, and never with a seed past 2**63 (what a negative OpenAI seed becomes);
test_preempt.py runs make_room through the engine, where an over-eager pass ends in a two-minute hang rather than a
failure, or not at all; the prefix index and the reload rule were tested through the prefix cache, whose scenarios
never re-file a slot, corrupt a last block, tie two entries or time anything. Of 57 planted bugs, 27 survived these
modules' CPU tests (their server tests included), one more was caught only by a two-minute hang and one only by a
30-second server run; each test's docstring names the bug it kills ("kills ..."). Seven survivors are left: they
change nothing reachable (a greedy row's unused position, a threshold applied at top_p 1, a tie or a fallback of the
reference draw that needs a uniform exactly on a running sum, a check that only skips work, a budget of 0 that
Step.prompt_budget never returns, the growth order of rows whose victims are chosen by rid anyway). sequence.py's
mutants were all caught already (test_scheduler_mutants.py); kernels/reference.py holds no sampling code (the
reference draw is sampler.sample_ref).

What is claimed (and tested here):
- a request without top_p keeps the whole vocabulary; the nucleus is the largest value whose mass at and above it
  reaches top_p x Z, also when it reaches it exactly; a seed anywhere in 0 .. 2**64 - 1 draws;
- make_room never grows nor preempts for a row whose last token is queued; a row preempted for its own block is
  neither grown afterwards nor a reason to preempt an older one; a victim preempted once is never taken again in
  the same pass; a preempted context is swapped only when the break-even rule says a reload pays, and never
  without tokens kept;
- a tie between reload and recompute recomputes; the break-even link speed is bytes per token over seconds per
  token; a measurement is the median of its timed runs after one untimed warm-up; a probe longer than the host
  tier counts only the pages copied;
- the prefix index forgets what a re-filed slot held, drops a key once no entry holds it, never uses an entry
  whose last matched block contradicts its key, and ranks matches by verified length, then most recently used;
- the prompt queue sizes a step by the tokens still to hand out, restarts a prompt's clock at its first chunk, and
  hands back every prompt, in progress or waiting, when the engine stops.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtransfer.engine import preempt, reload_rule
from kvtransfer.engine.host_tier import HostTier
from kvtransfer.engine.mixed import MixedPrefill
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.prefix_index import PrefixIndex
from kvtransfer.engine.prompt_queue import PromptQueue
from kvtransfer.engine.reload_rule import Speeds
from kvtransfer.engine.sampler import Draws, SamplingParams, first_token, sample, sampling_params
from kvtransfer.engine.sequence import EndCause, Sequence
from kvtransfer.geometry import CacheGeometry

# --- sampler.py ---


def test_a_request_without_top_p_keeps_the_whole_vocabulary():
    """kills sampling_params' default top_p changed (0.9 for 1.0): every request that did not set top_p (the
    OpenAI default) drew from a nucleus it never asked for."""
    p = sampling_params(0.7, None, 0, 5)
    assert p == SamplingParams(0.7, 1.0, 0, 5)
    assert sampling_params(0.7, 0.25, 3, 5) == SamplingParams(0.7, 0.25, 3, 5)
    assert sampling_params(0, 0.25, 3, 5) is None  # temperature 0: greedy


def test_the_nucleus_ends_at_the_first_value_whose_mass_reaches_top_p_exactly():
    """kills the nucleus's rank counting masses equal to top_p x Z as short of it (`cum <= top_p * Z`): with weights
    [1, 0.5, 0.5] (Z = 2, exactly) and top_p 0.5, the max alone holds 0.5 of the mass, so it alone is kept; the
    mutant kept the two 0.5s too and drew them half the time."""
    row = torch.tensor([[0.0, -math.log(2), -math.log(2)]])  # float32 exp(-ln 2) == 0.5 exactly
    assert ((row - row.max()).exp() == torch.tensor([1.0, 0.5, 0.5])).all()
    n = 200
    logits = row.expand(n, 3).contiguous()

    def draws(top_p: float) -> set[int]:
        t = torch.ones(n)
        return set(sample(logits, t, torch.full((n,), top_p), torch.zeros(n, dtype=torch.long),
                          torch.full((n,), 9, dtype=torch.long), torch.arange(n), use_triton=False).tolist())
    assert draws(0.5) == {0}
    assert draws(0.5 + 2**-20) == {0, 1, 2}  # just past it: the tie group of 0.5s joins, whole


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1])
def test_a_seed_past_2_63_draws_as_its_int64_bits(seed):
    """kills Draws.tensors passing the seed unsigned (`p.seed` for `_signed(p.seed)`): a seed of 2**63 or more (the
    proto's uint64, what api_server/params.py makes of a negative OpenAI seed) overflowed int64 and failed the
    request (its first token) or the whole decode step it rode in."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(1.0, 1.0, 0, seed), None, SamplingParams(1.0, 1.0, 0, 3)]
    floats, ints = Draws(params, [7, 8, 9]).tensors()
    assert ints[0, 1].item() == seed - 2**64  # the same 64 bits
    got = sample(logits, floats[:, 0], floats[:, 1], ints[:, 0], ints[:, 1], ints[:, 2], use_triton=False)
    want = sample(logits[:1], torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                  torch.tensor([seed - 2**64]), torch.tensor([7]), use_triton=False)
    assert int(got[0]) == int(want[0]) == int(first_token(logits[0], params[0], 7))


# --- preempt.py: make_room on a small paged pool, and _to_swap ---

PAGE = 4


def paged(slots: int, blocks: int) -> KVPool:
    return KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=slots, max_seq=16, page=PAGE,
                  blocks=blocks)


def ender(ended: list):
    def end(s, item):
        s.lease.release()
        ended.append((s.rid, item.cause))
    return end


def test_a_row_whose_last_token_is_queued_is_not_grown_and_preempts_nobody():
    """kills make_room growing rows with nothing left to make (the `s.remaining > 0` filter dropped): the oldest row
    here crosses into a new block, but its last token is already in the step in flight, so it writes nothing more;
    grown, it found the pool full and preempted a newer request for a block it would never use."""
    pool = paged(2, 4)
    done, newer = pool.try_lease(8), pool.try_lease(8)  # 2 blocks each: the pool is full
    ended = []
    running = [Sequence(1, done, 8, 0, 0, print), Sequence(2, newer, 6, 0, 5, print)]
    assert preempt.make_room(running, ender(ended)) == 0
    assert ended == [] and len(done.blocks) == 2 and len(newer.blocks) == 2 and pool.free_blocks() == 0


def test_a_row_preempted_for_its_own_block_is_not_grown_after_and_preempts_nobody_older():
    """kills make_room going on with a row it just preempted (`if victim is s: break` dropped): the newest row needs
    a block and is itself the victim; the pass went on growing its freed row, found the pool still short and
    preempted the oldest request too, then gave the blocks of both to a row on the free list (leaked until that
    row's next lease). In the engine this was a two-minute hang, here a wrong count."""
    pool = paged(2, 4)
    old, new = pool.try_lease(8), pool.try_lease(8)  # 2 blocks each: the pool is full
    ended = []
    running = [Sequence(1, old, 5, 0, 5, print), Sequence(2, new, 8, 0, 5, print)]  # only rid 2 crosses
    assert preempt.make_room(running, ender(ended)) == 1
    assert ended == [(2, EndCause.PREEMPTED)] and not running[0].over and len(old.blocks) == 2
    assert pool.row_blocks(new.slot) == [] and pool.free_blocks() == 2
    old.release()
    assert pool.used() == 0 and pool.free_blocks() == 4


def test_a_victim_preempted_once_is_never_taken_again_in_the_same_pass():
    """kills the victim's choice ignoring rows already preempted in this pass (`not v.over` dropped): two rows cross
    into a new block and the newest request (one block) is preempted for the first; for the second, the same
    victim was taken again and preempt_locked raised, failing the whole step. The second crosser is then the
    newest left, so it is preempted itself."""
    pool = paged(3, 5)
    a, b, c = pool.try_lease(8), pool.try_lease(8), pool.try_lease(4)  # 2 + 2 + 1 blocks: the pool is full
    ended = []
    running = [Sequence(1, a, 8, 0, 5, print), Sequence(2, b, 8, 0, 5, print), Sequence(3, c, 3, 0, 5, print)]
    assert preempt.make_room(running, ender(ended)) == 2
    assert ended == [(3, EndCause.PREEMPTED), (2, EndCause.PREEMPTED)]
    assert len(a.blocks) == 3 and pool.free_blocks() == 2


def swap_pool(speeds: Speeds | None, host=True):
    return SimpleNamespace(keeper=SimpleNamespace(host=object() if host else None, speeds=speeds))


def test_a_preempted_context_is_swapped_only_where_a_reload_pays_and_tokens_were_kept():
    """kills _to_swap's break-even rule inverted (`reload_pays` for `not reload_pays`): over a fast link every
    preempted context was recomputed and over a slow one reloaded; and kills its check for a sequence that kept
    no tokens dropped (`len(None)` raised on the scheduler thread)."""
    bpt = 1000
    fast = Speeds(bpt, reload_bytes_per_s=bpt * 1e5, prefill_s_per_token=1e-4)  # reload 10 us/token, prefill 100
    slow = Speeds(bpt, reload_bytes_per_s=bpt * 1e3, prefill_s_per_token=1e-4)  # reload 1 ms/token
    s = SimpleNamespace(tokens=list(range(10, 30)))  # 20 ids: the KV of the first 19 is written
    got = preempt._to_swap(swap_pool(fast), s)
    assert got is not None and got.dtype == np.int64 and got.tolist() == list(range(10, 29))
    assert preempt._to_swap(swap_pool(None), s).tolist() == list(range(10, 29))  # no rule: every context swaps
    assert preempt._to_swap(swap_pool(slow), s) is None
    assert preempt._to_swap(swap_pool(fast, host=False), s) is None
    assert preempt._to_swap(swap_pool(fast), SimpleNamespace(tokens=None)) is None


# --- reload_rule.py ---


def test_a_tie_between_reload_and_recompute_recomputes():
    """kills the rule's strict `<` made `<=`: at equal cost the module's rule (reload iff strictly cheaper) keeps
    the link free and recomputes."""
    s = Speeds(2, reload_bytes_per_s=4.0, prefill_s_per_token=0.5)  # both 0.5 s a token, exactly
    assert all(s.reload_s(n) == s.recompute_s(n) for n in (1, 16, 1000))
    assert not any(s.reload_pays(n) for n in (1, 16, 1000))


def test_the_break_even_link_speed_is_bytes_per_token_over_seconds_per_token():
    """kills break_even_bytes_per_s inverted (`prefill_s_per_token / bytes_per_token`): the start-up log line that
    says which link speed a reload needs read about 1e-24 GB/s; a reload pays exactly above it."""
    s = Speeds(1000, reload_bytes_per_s=3e9, prefill_s_per_token=1e-6)
    assert s.break_even_bytes_per_s == pytest.approx(1e9)
    assert "break-even link 1.00 GB/s" in s.describe() and s.describe().endswith("reloads")
    for link in (0.5e9, 0.99e9, 1.01e9, 2e9):
        assert Speeds(1000, link, 1e-6).reload_pays(1) == (link > s.break_even_bytes_per_s)


def test_a_measurement_is_the_median_of_its_timed_runs_after_an_untimed_warm_up(monkeypatch):
    """kills median_s's warm-up dropped (the first run, with its allocations and compiles, timed as one of five) and
    its median made a minimum (one lucky run set the speed): a fake clock advanced by each run itself."""
    clock = [0.0]
    monkeypatch.setattr(reload_rule, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    durations = iter([100.0, 4.0, 1.0, 9.0, 3.0, 7.0, 50.0])
    calls = []

    def fn():
        calls.append(1)
        clock[0] += next(durations)
    assert reload_rule.median_s(fn, torch.device("cpu"), runs=5) == 4.0  # median of 4, 1, 9, 3, 7
    assert len(calls) == 6


def test_a_probe_longer_than_the_host_tier_counts_only_the_pages_copied(monkeypatch):
    """kills measure()'s page count not capped at the tier (`min(..., tier.pages)` dropped): a probe of 100 tokens
    over a tier of 32 copied 32 tokens' pages but counted 104 tokens' bytes, the link measured 3x too fast and
    host-tier hits reloaded where recompute was cheaper."""
    geo = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
    tier = HostTier(geo, torch.device("cpu"), 4 * 8 * geo.bytes_per_token / 2**30, None, page_tokens=8)
    times = iter([0.5, 2.0])  # the copy's median, then the prefill's
    monkeypatch.setattr(reload_rule, "median_s", lambda fn, device, runs=5: (fn(), next(times))[1])
    s = reload_rule.measure(tier, lambda n: None, geo.bytes_per_token, probe_tokens=100)
    assert s.reload_bytes_per_s == 32 * geo.bytes_per_token / 0.5
    assert s.prefill_s_per_token == 2.0 / 100


# --- prefix_index.py ---

B = 4


def ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, n).astype(np.int64)


def test_a_refiled_slot_is_matched_only_by_what_it_holds_now():
    """kills add() not removing what `where` held before (`self.remove(where)` dropped): a slot cached again with
    another turn kept the keys of its old context, so a prompt of the old context matched the slot at full length
    and reused KV the slot no longer held (the entry verified against its stale copy of the old tokens)."""
    idx = PrefixIndex(B)
    old = ids(16, 1)
    new = np.concatenate([old[:6], ids(10, 2)])  # the same opening, then another turn
    idx.add("slot", old)
    e = idx.add("slot", new)
    m = idx.match(old)
    assert [(x.entry, x.length) for x in m] == [(e, 6)]
    idx.remove("slot")
    assert idx.match(old) == [] and len(idx) == 0


def test_a_key_no_entry_holds_is_dropped():
    """kills remove() keeping a key's holder dict once empty: every block key of every context ever cached stayed
    in the index for the server's lifetime (memory growing with traffic, not with the cache)."""
    idx = PrefixIndex(B)
    opening = ids(8, 3)
    for w in range(4):
        idx.add(w, np.concatenate([opening, ids(9, 10 + w)]))
    assert len(idx._by_key) == 2 + 4 * 2  # the opening's 2 keys shared, 2 of each tail
    for w in range(4):
        idx.remove(w)
    assert idx._by_key == {}


def test_an_entry_whose_last_matched_block_contradicts_its_key_is_never_used():
    """kills the poison check spared for the last matched block (`(blocks - 1) * block`, or `blocks` stuck at 1):
    an entry corrupted at token 13 of 16 (its fourth block) matched a prompt of its original tokens, and the
    prompt reused 13 positions of KV from another context."""
    idx = PrefixIndex(B)
    good = ids(16, 5)
    e = idx.add("bad", good)
    e.tokens[13] += 1
    assert idx.match(good) == []
    assert idx.poisoned == 1 and "bad" not in idx


def test_matches_rank_by_verified_length_then_most_recently_used():
    """kills the ranking's tie broken least recently used first (`order` for `-order`) and the ranking by verified
    length dropped: two entries sharing the same whole blocks with the prompt rank by how many tokens each really
    shares (9 vs 11, past the last block), and at equal length the one used last comes first."""
    idx = PrefixIndex(B)
    base = ids(12, 6)
    idx.add("long", base[:11])  # 2 whole blocks, shares 11 with the prompt
    idx.add("short", base[:9])  # 2 whole blocks, shares 9; added last: the most recently used
    prompt = np.concatenate([base[:11], ids(5, 7)])
    assert [(m.entry.where, m.length) for m in idx.match(prompt)] == [("long", 11), ("short", 9)]
    idx.add("twin", base[:11])
    assert [m.entry.where for m in idx.match(prompt)] == ["twin", "long", "short"]
    idx.touch("long")
    assert [m.entry.where for m in idx.match(prompt)] == ["long", "twin", "short"]


# --- prompt_queue.py ---


class BudgetStep:
    """Step.prompt_budget's stand-in: a fixed budget, recording what it was asked."""

    def __init__(self, budget: int):
        self.budget, self.asked = budget, []

    def prompt_budget(self, n: int, waiting: int) -> int:
        self.asked.append((n, waiting))
        return self.budget


def prompt(n: int) -> MixedPrefill:
    return MixedPrefill(torch.arange(n), SimpleNamespace(slot=0), False, future=Future())


def test_a_step_is_sized_by_the_prompt_tokens_still_to_hand_out():
    """kills the waiting count taking each prompt's whole length (`ids.shape[0]` for `left`): a prompt with 2 of its
    12 tokens left still asked for a step of 12 prompt rows, so every last chunk ran in a step sized for the
    whole prompt, padded."""
    q = PromptQueue(threading.Condition())
    a, b = prompt(12), prompt(5)
    q.waiting.extend([a, b])
    step = BudgetStep(10)
    assert [(c.start, c.ids.shape[0]) for _, c in q.pieces(step, 1)] == [(0, 10)]
    assert [(c.start, c.ids.shape[0]) for _, c in q.pieces(step, 1)] == [(10, 2), (0, 5)]
    assert step.asked == [(1, 17), (1, 7)]


def test_a_prompts_clock_starts_at_its_first_chunk():
    """kills the reset of a prompt's t0 when its first chunk goes dropped: its prefill_ms counted the time it
    waited behind other prompts, so the mixed path's prefill time read as the queue's."""
    q = PromptQueue(threading.Condition())
    a = prompt(4)
    a.t0 = -1.0
    q.waiting.append(a)
    q.pieces(BudgetStep(8), 1)
    assert a.t0 > 0


def test_take_all_hands_back_prompts_in_progress_and_waiting():
    """kills take_all dropping the prompts in progress: when the engine died or stopped, a prompt with chunks
    already handed out was never failed, and its request waited on its future for ever."""
    q = PromptQueue(threading.Condition())
    a, b = prompt(12), prompt(5)
    q.waiting.extend([a, b])
    q.pieces(BudgetStep(4), 1)  # a in progress
    assert [id(t) for t in q.active] == [id(a)]
    got = q.take_all()
    assert [id(t) for t in got] == [id(a), id(b)]
    assert not q and q.pieces(BudgetStep(4), 1) == []
