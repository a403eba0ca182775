"""Cases a mutation pass over the router (router/: placement, affinity, health, retries, Load) and the prefix cache
with its host tier (kvtransfer/engine/prefix_cache.py, prefix_index.py, host_tier.py, reload_rule.py, and the pool's
trim and reference counts under them) found untested: each test here fails on a one-line change of that code that
the rest of the CPU suite let through, or caught only by accident in a server run of tens of seconds (a preempted
run's bits, a host-tier server test): its docstring names the change ("kills ..."). One test is a bug this pass found
(fixed with it: PrefixCache._store checks a context fits the host tier before dropping anything for room).

Why in process, with stand-ins: the router's decisions are reads of its own books (tickets, reports, affinity keys)
and its reaction to one worker's answer, so a WorkerSet whose workers answer from a script (`Script`) shows each
decision exactly, in milliseconds, with no process, port or poll timing; test_router.py's real processes show the
same paths under load but cannot pin which of two equal workers, or which of three failing ones, a request met.
The prefix cache's cases run on a small CPU pool, as test_prefix_cache.py's do (no model).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from kvtransfer.engine import reload_rule
from kvtransfer.engine.host_tier import HostTier
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.prefix_cache import DEVICE, HOST, PrefixCache
from kvtransfer.engine.reload_rule import Speeds
from kvtransfer.geometry import CacheGeometry
from proto import kvtransfer_pb2 as pb
from router.affinity import Affinity
from router.metrics import RouterMetrics
from router.placement import Placement
from router.server import WORKER_KEY, RouterService
from router.workers import WorkerSet

S = grpc.StatusCode
BLOCK = 16  # the workers' prefix block (Info.prefix_block_tokens) in the router's cases


# --- the router, in process: workers that answer from a script ---


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Call:
    """One Generate call on a scripted worker: its tokens, then EOF, or an error before the first token."""

    def __init__(self, tokens: list[int], error: grpc.StatusCode | None):
        self._msgs = [pb.GenerateResponse(token_id=t) for t in tokens]
        self._error, self.cancelled = error, False

    async def read(self):
        if self._error is not None:
            raise rpc_error(self._error, "scripted")
        return self._msgs.pop(0) if self._msgs else grpc.aio.EOF

    def done(self) -> bool:
        return not self._msgs

    def cancel(self) -> None:
        self.cancelled = True


class Script:
    """A worker's Decode stub: Load answers `load`, Info answers `info` (counting the questions), Generate answers
    `tokens` or fails with `error` (counting the calls)."""

    def __init__(self, load: pb.LoadResponse | None = None, block: int = BLOCK, tokens=(7, 8, 9),
                 error: grpc.StatusCode | None = None):
        self.load = load if load is not None else pb.LoadResponse(serving=True)
        self.info = pb.InfoResponse(model="tiny", prefix_block_tokens=block)
        self.tokens, self.error = list(tokens), error
        self.generated = self.infos = 0

    async def Load(self, request, timeout=None, metadata=None):
        return self.load

    async def Info(self, request, timeout=None, metadata=None):
        self.infos += 1
        return self.info

    def Generate(self, request, timeout=None, metadata=None):
        self.generated += 1
        return Call(self.tokens, self.error)


NO_SECURITY = SimpleNamespace(metadata=lambda: ())


def fleet(*scripts: Script, policy: str = "least_loaded", affinity: Affinity | None = None, slack: int = 4096
          ) -> tuple[WorkerSet, Placement, RouterService]:
    """Workers w0, w1, ... answering from `scripts`, each polled once (so healthy where its Load says serving)."""
    ws = WorkerSet(tuple(f"w{i}" for i in range(len(scripts))), NO_SECURITY, 1 << 20, 1.0, 1.0, RouterMetrics())
    for w, s in zip(ws.workers, scripts, strict=True):
        w.decode = s
    for w in ws.workers:
        asyncio.run(ws.poll(w))
    placement = Placement(ws, policy, ws.metrics, affinity, slack)
    return ws, placement, RouterService(ws, placement, ws.metrics, NO_SECURITY, 30.0)


class Aborted(Exception):
    def __init__(self, code, message, trailing):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.trailing = code, message, dict(trailing)


class Context:
    """The caller's side of one Generate through the router: what it was sent, and how it ended."""

    def __init__(self):
        self.initial, self.trailing, self.status = {}, {}, None

    def time_remaining(self):
        return 30.0

    def done(self):
        return False

    def cancelled(self):
        return False

    def code(self):
        return self.status

    async def abort(self, code, message, trailing_metadata=()):
        self.status = code
        raise Aborted(code, message, trailing_metadata)

    async def send_initial_metadata(self, md):
        self.initial = dict(md)

    def set_trailing_metadata(self, md):
        self.trailing = dict(md)


def generate(service: RouterService, ids: list[int], new: int = 3) -> tuple[list[int], Context]:
    """Generate through the router's servicer: (tokens, the caller's context); raises Aborted on an error status."""
    ctx = Context()

    async def run():
        return [m.token_id async for m in service.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=new),
                                                           ctx)]
    return asyncio.run(run()), ctx


def counter(metrics: RouterMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_equal_workers_take_requests_in_turn_the_least_recently_chosen_first():
    """kills the tie going to the worker chosen most recently (`-w.last_chosen` in _least_loaded's key): every
    request of a fleet whose loads tie (requests that end at once, before any report counts them) went to one
    worker while the other idled."""
    _, placement, _ = fleet(Script(), Script())
    went = []
    for _ in range(6):
        c = placement.choose(pb.GenerateRequest(token_ids=[1, 2, 3], max_new_tokens=4))
        went.append(c.worker.addr)
        placement.release(c)
    assert went == ["w0", "w1"] * 3, went


def test_a_request_that_ended_no_longer_counts_on_its_worker():
    """kills `release` keeping the ticket (the request's prompt + max_new_tokens charged to its worker forever):
    after a few requests the worker that served them looked loaded for good and lost every tie, idle or not."""
    ws, placement, _ = fleet(Script(), Script())
    c = placement.choose(pb.GenerateRequest(token_ids=list(range(1, 101)), max_new_tokens=50))
    assert c.worker.load_tokens() == 150
    placement.release(c)
    assert [w.load_tokens() for w in ws.workers] == [0, 0]
    assert counter(ws.metrics, "kvt_router_worker_placed_tokens", worker=c.worker.addr) == 0


def test_a_request_that_started_counts_as_running_in_what_the_next_report_includes():
    """kills `started` leaving the ticket waiting (first stays False): a report asked after the first token counts
    the request by prompt + max_new_tokens, the router subtracted only its prompt, so every running request of its
    own was counted twice over its max_new_tokens and placement avoided the workers it had just loaded."""
    ws, placement, _ = fleet(Script(), Script())
    c = placement.choose(pb.GenerateRequest(token_ids=list(range(1, 101)), max_new_tokens=50))
    placement.started(c)
    w = c.worker
    w.decode.load = pb.LoadResponse(serving=True, running_tokens=100, remaining_tokens=50)  # the worker runs it
    asyncio.run(ws.poll(w))
    assert w.own_reported == 150 and w.load_tokens() == 150  # itself once: no other client's load there


def test_the_load_a_report_already_counts_of_this_routers_requests_is_not_counted_again():
    """kills load_tokens adding the router's requests in flight to a report that already holds them (the report
    not reduced by own_reported): each worker looked twice as loaded as it was by this router's own requests, so a
    worker running one long request of this router's lost to one holding more of another client's load."""
    ws, placement, _ = fleet(Script(), Script())
    mine = placement.choose(pb.GenerateRequest(token_ids=list(range(1, 1001)), max_new_tokens=1000))
    placement.started(mine)
    busy, other = mine.worker, next(w for w in ws.workers if w is not mine.worker)
    busy.decode.load = pb.LoadResponse(serving=True, running_tokens=1000, remaining_tokens=1000)  # only ours
    other.decode.load = pb.LoadResponse(serving=True, running_tokens=1500, remaining_tokens=1000)  # another's
    for w in ws.workers:
        asyncio.run(ws.poll(w))
    assert busy.load_tokens() == 2000 and other.load_tokens() == 2500
    c = placement.choose(pb.GenerateRequest(token_ids=[1, 2, 3], max_new_tokens=3))
    assert c.worker is busy, c.worker.addr


def test_a_worker_whose_load_says_not_serving_takes_no_request():
    """kills the poll marking a worker healthy whatever its Load's `serving` says: a draining (SIGTERM) or failed
    decode worker kept getting requests, each refused UNAVAILABLE and retried, and with one worker left, failed."""
    ws, placement, _ = fleet(Script(), Script(load=pb.LoadResponse(serving=False)))
    draining = ws.workers[1]
    assert not draining.healthy and "not serving" in draining.why
    assert counter(ws.metrics, "kvt_router_worker_up", worker="w1") == 0
    for _ in range(4):
        c = placement.choose(pb.GenerateRequest(token_ids=[1, 2, 3], max_new_tokens=3))
        assert c.worker.addr == "w0"
        placement.release(c)
    draining.decode.load = pb.LoadResponse(serving=True)  # drained and back (restarted): it rejoins
    asyncio.run(ws.poll(draining))
    assert draining.healthy


def test_a_worker_that_rejoins_is_asked_its_info_again():
    """kills the poll asking Info only the first time (`w.info is None`, not also when the worker was down): a
    decode worker restarted on its address with another --kv-block-tokens or prefix cache kept its old block size
    in the router, whose affinity keys then never matched what the worker holds."""
    ws, _, _ = fleet(Script(block=16))
    w = ws.workers[0]
    assert w.block == 16 and w.decode.infos == 1
    w.decode.load = pb.LoadResponse(serving=False)
    asyncio.run(ws.poll(w))
    assert not w.healthy
    w.decode.load, w.decode.info = pb.LoadResponse(serving=True), pb.InfoResponse(prefix_block_tokens=32)
    asyncio.run(ws.poll(w))
    assert w.healthy and w.block == 32 and w.decode.infos == 2
    asyncio.run(ws.poll(w))  # healthy already: not asked again
    assert w.decode.infos == 2


def test_a_worker_that_failed_unavailable_is_out_of_placement_before_the_next_poll():
    """kills `_failed` not marking an UNAVAILABLE worker down: until the next Load poll, up to --load-poll-s (or
    --load-timeout-s when the worker hangs) later, every new request was placed first on the dead worker and
    retried, and the router's status and kvt_router_worker_up still showed it up."""
    ws, _, service = fleet(Script(error=S.UNAVAILABLE), Script(tokens=[4, 5]))
    dead, alive = ws.workers
    tokens, ctx = generate(service, [1, 2, 3])
    assert tokens == [4, 5] and ctx.initial[WORKER_KEY] == ctx.trailing[WORKER_KEY] == "w1"
    assert not dead.healthy and "UNAVAILABLE" in dead.why
    assert counter(ws.metrics, "kvt_router_worker_up", worker="w0") == 0
    for _ in range(3):  # no poll since: the next requests go straight to the live worker
        assert generate(service, [1, 2, 3])[0] == [4, 5]
    assert dead.decode.generated == 1 and alive.decode.generated == 4
    assert counter(ws.metrics, "kvt_router_retried_total", worker="w0") == 1


def test_a_draining_router_says_not_serving_in_its_load():
    """kills Load's `serving` ignoring the router's own drain: a router told to stop (SIGTERM, in its grace) still
    answered Load serving=True, so a router or client above it that places by Load kept sending it requests that
    it refuses."""
    _, _, service = fleet(Script(load=pb.LoadResponse(serving=True, running_requests=2)))
    assert asyncio.run(service.Load(pb.LoadRequest(), None)).serving
    service.running.draining = True
    got = asyncio.run(service.Load(pb.LoadRequest(), None))
    assert not got.serving and got.running_requests == 2


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 1000, n).tolist()


def test_a_finished_request_files_its_prompt_and_every_generated_token_but_the_last():
    """kills the keys filed over the wrong span when a request ends OK: with the last generated token (whose KV no
    step wrote) a context one short of a block boundary was filed a block deeper than the worker holds; with the
    prompt alone, a conversation's answer was never filed, so a next turn's match stopped at the prompt's blocks
    and lost to a worker holding a longer context of another branch (the worker holds prompt + answer but the
    last token: docs/router.md, "Affinity")."""
    affinity = Affinity(1000)
    _, _, service = fleet(Script(tokens=[501, 502, 503]), affinity=affinity)
    short, long = ids(13, 1), ids(30, 2)
    for prompt in (short, long):
        assert generate(service, prompt)[0] == [501, 502, 503]
    candidates = {"w0": BLOCK}
    assert affinity.lookup(short + [501, 502, 503, 9], candidates) is None  # 15 tokens held: no whole block
    assert affinity.lookup(long + [501, 502, 503, 9], candidates) == ("w0", 32)  # 32 held: two blocks


def test_a_prompt_goes_to_the_worker_holding_its_deepest_known_block():
    """kills the affinity lookup walking a prompt's blocks from the first (the shallowest known block wins): a
    conversation whose opening (a shared system prompt) another worker also served was sent there, where only
    the opening is cached, instead of back to the worker holding the whole conversation."""
    affinity = Affinity(1000)
    opening, conversation, other = ids(BLOCK, 3), ids(BLOCK, 4), ids(BLOCK, 5)
    affinity.file(opening + conversation, BLOCK, "w0")
    affinity.file(opening + other, BLOCK, "w1")  # the opening's key now names w1
    assert affinity.lookup(opening + conversation + [7, 7], {"w0": BLOCK, "w1": BLOCK}) == ("w0", 2 * BLOCK)
    assert affinity.lookup(opening + [7] * BLOCK, {"w0": BLOCK, "w1": BLOCK}) == ("w1", BLOCK)


def test_affinity_forgets_its_least_recently_used_keys_first():
    """kills the bound on --affinity-max-keys dropping the newest key (`popitem(last=True)`): once full, every
    context just served was forgotten at once, so no next turn ever found its worker again."""
    affinity = Affinity(2)
    a, b, c = ids(BLOCK, 6), ids(BLOCK, 7), ids(BLOCK, 8)
    affinity.file(a, BLOCK, "w0")
    affinity.file(b, BLOCK, "w1")
    affinity.file(c, BLOCK, "w0")
    candidates = {"w0": BLOCK, "w1": BLOCK}
    assert len(affinity) == 2 and affinity.lookup(a + [1], candidates) is None
    assert affinity.lookup(c + [1], candidates) == ("w0", BLOCK) and affinity.lookup(b + [1], candidates) == ("w1",
                                                                                                          BLOCK)


# --- the prefix cache and its host tier, on a small CPU pool ---

GEO = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
B = 4  # the prefix index's block in these cases, and the paged pool's page
HOST_PAGE = 8  # tokens per host-tier page


def paged(slots: int, blocks: int, max_seq: int = 32) -> PrefixCache:
    return PrefixCache(KVPool(GEO, torch.device("cpu"), slots, max_seq, page=B, blocks=blocks), 0.0, block=B)


def with_host(slots: int, host_pages: int) -> PrefixCache:
    """The slot layout (one block of 64 a row) over a host tier of `host_pages` pages of HOST_PAGE tokens."""
    cache = PrefixCache(KVPool(GEO, torch.device("cpu"), slots, 64), 0.0, block=B)
    cache.host = HostTier(GEO, cache.pool.device, host_pages * HOST_PAGE * GEO.bytes_per_token / 2**30, None,
                          page_tokens=HOST_PAGE)
    return cache


def tokens(n: int, seed: int) -> np.ndarray:
    return np.asarray(ids(n, seed), dtype=np.int64)


def kv_of(n: int, salt: float) -> torch.Tensor:
    """Distinct KV for n positions, (n, layers, 2, heads, dim) as KVPool.write takes it."""
    shape = (n, GEO.num_layers, 2, GEO.kv_heads, GEO.head_dim)
    return torch.arange(np.prod(shape), dtype=torch.float32).view(shape) + salt


def served(cache: PrefixCache, context: np.ndarray, need: int | None = None, salt: float = 0.0,
           reuse: bool = True) -> torch.Tensor:
    """A request that wrote `context`'s KV into its row and ended: the row is cached. Returns the KV written."""
    lease = cache.acquire(context, reuse, need=need)
    data = kv_of(len(context), salt)
    cache.pool.write(lease.slot, 0, data)
    lease.keep = context
    lease.release()
    return data


def test_a_cached_row_keeps_the_block_of_its_last_positions_when_trimmed():
    """kills the trim keeping one block too few (`blocks_for(tokens - 1)`): a context of 9 tokens on blocks of 4
    kept blocks 0-1 only, and the block holding position 8 went back to the pool while the entry still claimed 9
    tokens; the next lease wrote into it, and the next turn reused position 8's KV from another request."""
    cache = paged(slots=2, blocks=8)
    context = tokens(9, 11)
    data = served(cache, context, need=16, salt=0.5)
    assert cache.cached_blocks() == 3 and cache.pool.free_blocks() == 5
    other = cache.acquire(tokens(20, 12), need=20)  # every free block
    cache.pool.write(other.slot, 0, kv_of(20, 1000.0))
    turn = cache.acquire(np.concatenate([context, [5, 5]]), need=12)
    assert turn.reuse.how == "claimed" and turn.reuse.length == 9
    assert torch.equal(cache.pool.read(turn.slot, 0, 9), data), "the cached context's KV was overwritten"


def test_a_host_hit_sent_to_recompute_leaves_the_next_match_to_be_taken():
    """kills the break-even rule's recompute ending the search (`return None` for `continue`): a prompt whose
    longest match was on the host tier, over a link too slow to reload it, got no prefix at all, though the pool
    held a context sharing almost as much with it (12 of 14 tokens here), which costs no link at all."""
    cache = with_host(slots=1, host_pages=8)
    opening = tokens(12, 15)
    prompt = np.concatenate([opening, [41, 42], tokens(6, 16)])
    served(cache, np.concatenate([opening, [41, 42], tokens(4, 17)]), salt=1.0)  # shares 14 with the prompt
    # shares 12 with it: takes the one row back (the 14-sharing context goes to the host tier), and is cached there
    near = served(cache, np.concatenate([opening, tokens(6, 20)]), salt=2.0, reuse=False)
    assert sorted(e.where[0] for e in cache.index.entries() if e.length == 18) == [DEVICE, HOST]
    bpt = GEO.bytes_per_token
    cache.speeds = Speeds(bpt, reload_bytes_per_s=bpt * 1e3, prefill_s_per_token=1e-4)  # reload 10x dearer
    lease = cache.acquire(prompt)
    assert cache.stats.host_recomputed == 1
    assert lease.reuse is not None and lease.reuse.tier == DEVICE and lease.reuse.length == 12, lease.reuse
    assert torch.equal(cache.pool.read(lease.slot, 0, 12), near[:12])


def test_the_break_even_rule_compares_per_token_costs_whatever_the_length():
    """kills recompute_s not scaling with the tokens (`return self.prefill_s_per_token`): a reload 2x cheaper per
    token than a prefill was judged dearer than recomputing the whole prefix once the prefix passed a few
    tokens, so every long host-tier hit, where a reload saves the most, was recomputed."""
    bpt = 1000
    s = Speeds(bpt, reload_bytes_per_s=bpt * 2e4, prefill_s_per_token=1e-4)  # reload 50 us/token, prefill 100
    assert s.recompute_s(1000) == pytest.approx(0.1) and s.reload_s(1000) == pytest.approx(0.05)
    assert all(s.reload_pays(n) for n in (1, 16, 1000, 100_000))
    slow = Speeds(bpt, reload_bytes_per_s=bpt * 5e3, prefill_s_per_token=1e-4)  # reload 200 us/token
    assert not any(slow.reload_pays(n) for n in (1, 16, 1000, 100_000))


def test_the_measured_reload_speed_counts_the_bytes_of_every_token_copied(monkeypatch):
    """kills measure() dividing the pages' count, not their tokens', bytes by the copy time: the link measured
    page_tokens (256) times too slow, so the break-even rule sent every host-tier hit to recompute."""
    tier = HostTier(GEO, torch.device("cpu"), 4 * HOST_PAGE * GEO.bytes_per_token / 2**30, None,
                    page_tokens=HOST_PAGE)
    times = iter([0.5, 2.0])  # the copy's median, then the prefill's

    def median_s(fn, device, runs=5):
        fn()
        return next(times)
    monkeypatch.setattr(reload_rule, "median_s", median_s)
    prefilled = []
    s = reload_rule.measure(tier, prefilled.append, GEO.bytes_per_token, probe_tokens=20)
    assert prefilled == [20]
    assert s.reload_bytes_per_s == 24 * GEO.bytes_per_token / 0.5  # 3 pages of 8 tokens in 0.5 s
    assert s.prefill_s_per_token == 2.0 / 20 and s.bytes_per_token == GEO.bytes_per_token


def test_a_context_longer_than_the_whole_host_tier_leaves_the_tier_as_it_was():
    """Not a mutant: a bug this pass found. A cached row taken back whose context is longer than the whole host tier
    is not stored (it cannot fit); `_store` found that out only after dropping every host entry for room, so one
    long context evicted from the pool emptied the tier of every conversation it held (with --host-cache-gib below
    a --max-seq-len context's KV, every such eviction did). Kills the up-front check removed."""
    cache = with_host(slots=1, host_pages=4)  # 32 tokens of host pages
    a, b = tokens(16, 30), tokens(12, 31)
    served(cache, a)
    served(cache, b, reuse=False)  # takes a's row back: a to the host tier
    served(cache, tokens(40, 32), reuse=False)  # b to the host tier; 40 tokens cached in the pool
    assert sorted((e.where[0], e.length) for e in cache.index.entries()) == [(DEVICE, 40), (HOST, 12), (HOST, 16)]
    served(cache, tokens(8, 33), reuse=False)  # takes the 40 back: too long for the tier, so not stored
    hosted = sorted(e.length for e in cache.index.entries() if e.where[0] == HOST)
    assert hosted == [12, 16] and cache.stats.evicted_host == 0, (hosted, cache.stats)
