"""Cases a mutation pass over code no earlier pass covered found untested: decode_server/peer/liveness.py (the health
Watch that ends a pairing), decode_server/peer/peers.py (which prefill worker takes a request, the one retry on
another, the first pairing at start), decode_server/peer/remote.py (which answers are the peer's failure),
kvtransfer/transport/layout.py (when K, V and layers are one view), kvtransfer/engine/queued.py (hand_out,
release_delivered, staging_s), kvtransfer/engine/graphs.py (Step._replay and its `replayed` event), and what the
four servers' __main__ make of their flags. Each test here failed on a one-line change of that code that the other
tests let through (the pair lifecycle, start check, prompt limit, metrics, operability, fault, xPyD, router, API,
transfer, streaming and scheduler tests); its docstring names the change it kills ("kills ...").

Of 110 planted changes, 58 were caught already (all 7 in kvtransfer/rpc/modes.py among them), 48 only here, and 4
are equivalent: byte_array's contiguous() before a reshape that copies anyway, Step.__call__'s reset of `replayed`
(a Step with no graph never records one), the router's `not stop.event.is_set()` (the health servicer ignores every
set once shut_down began its graceful shutdown), and the colocated decode worker's "" SERVING (the servicer's
default). On CUDA, test_engine_gpu.py's staging test catches the event never made or never handed to the queued
step, once it builds its LoadedModel on torch.device("cuda", 0): on torch.device("cuda") the scheduler thread's
set_device refuses it, so it failed before any change (H100, this pass).

Why in process, with stand-ins: the real-process tests reach a pairing's watch, a peer's choice, a retry or a
server's start only through the scenarios written for them (one peer refused once, a kill -9 mid-load, one flag
set), where a NOT_SERVING counted before the peer was up, a tie always going to the first peer, a third try on a
third peer or a flag passed as another value does not show. Here each case is a fake health stream, fake pairings,
a fake CUDA event, or a server's serve() run to its stop with its model, engine and port stood in for, so the file
runs in about a second on 2 cores, the same way every time. Waits are on asyncio conditions, bounded by GUARD_S (a
wait still not over then is a hang); nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

import api_server.__main__ as api_main
import decode_server.__main__ as decode_main
import prefill_server.__main__ as prefill_main
import router.__main__ as router_main
from api_server.config import ApiConfig
from decode_server.config import DecodeConfig
from decode_server.peer.dataplane import DataPlane
from decode_server.peer.handshake import HandshakeRefused, HandshakeTimedOut
from decode_server.peer.liveness import STOPPING, until_down, watch_peer
from decode_server.peer.peers import DECODE_SERVICE, PrefillPeers
from decode_server.peer.remote import PeerFailure, RequestError
from kvtransfer.engine import graphs
from kvtransfer.engine.mixed import Chunk
from kvtransfer.engine.queued import QueuedStep, hand_out, queue_step, release_delivered
from kvtransfer.engine.sequence import LocalPrefill, Sequence, Token
from kvtransfer.model.prefill import logits_digest
from kvtransfer.rpc.lifecycle import FatalStop
from kvtransfer.rpc.metrics import Metrics
from kvtransfer.rpc.server import new_health
from kvtransfer.transport import registry, rendezvous
from kvtransfer.transport.layout import byte_array, contiguous_run, kv_block, kv_pair_view, run_or_stack
from prefill_server.config import PrefillConfig
from router.config import RouterConfig

GUARD_S = 30.0  # a wait still not over after this long is a hang
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def run(coro):
    """Run `coro` in a fresh loop, bounded by GUARD_S (a hang fails, it does not stall the suite)."""
    async def bounded():
        return await asyncio.wait_for(coro, GUARD_S)
    return asyncio.run(bounded())


# --- decode_server/peer/liveness.py: the watch that ends a pairing ---


class WatchCall:
    """A health Watch stream: `statuses` in order, then `error` raised, or the stream's end (`hang`: it stays open
    until cancelled, as a live peer's does)."""

    def __init__(self, statuses, error: BaseException | None = None, hang: bool = False):
        self.statuses, self.error, self.hang = list(statuses), error, hang
        self.taken, self.cancelled = 0, False

    async def _stream(self):
        for s in self.statuses:
            self.taken += 1
            yield health_pb2.HealthCheckResponse(status=s)
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.Event().wait()

    def __aiter__(self):
        return self._stream()

    def cancel(self):
        self.cancelled = True


class HealthStub:
    def __init__(self, call: WatchCall):
        self.call, self.asked = call, []

    def Watch(self, request, metadata=None, wait_for_ready=None):
        self.asked.append((request.service, metadata, wait_for_ready))
        return self.call


def armed_event(armed: bool) -> asyncio.Event:
    e = asyncio.Event()
    if armed:
        e.set()
    return e


def watch(call: WatchCall, armed: bool, stub: HealthStub | None = None) -> str:
    async def go():
        return await watch_peer(stub or HealthStub(call), (("k", "v"),), armed_event(armed), "pair-7")
    return run(go())


def test_a_not_serving_before_the_peer_was_ever_up_does_not_end_the_pairing():
    """The peer answers NOT_SERVING until it is up (it is still starting, or pairing); only a NOT_SERVING after a
    SERVING says it is stopping (kills `seen_serving and` dropped: a pairing armed while the peer's pair service
    still read NOT_SERVING ended at once, and re-paired for ever)."""
    call = WatchCall([NOT_SERVING, SERVING])
    assert watch(call, armed=True) == "the prefill worker ended the liveness watch"
    assert call.taken == 2
    call = WatchCall([NOT_SERVING, SERVING, NOT_SERVING, SERVING])
    assert watch(call, armed=True) == STOPPING
    assert call.taken == 3  # ends at the NOT_SERVING that followed a SERVING, not before


def test_a_not_serving_before_the_pairing_is_armed_does_not_end_it():
    """The handshake itself turns the peer NOT_SERVING for a moment: that must not end the pairing it starts
    (kills `and armed.is_set()` dropped: every handshake ended its own pairing)."""
    call = WatchCall([SERVING, NOT_SERVING, SERVING])
    assert watch(call, armed=False) == "the prefill worker ended the liveness watch"
    assert call.taken == 3


def test_the_watch_waits_for_the_peer_names_the_pairs_service_and_ends_its_stream():
    """The watch is opened before the peer is up, so it must wait for it (kills wait_for_ready=True turned False:
    a watch opened while the peer was still starting failed UNAVAILABLE at once, and the pairing read that as the
    control channel lost); it asks after the pair's own service with the caller's metadata; and its stream is
    cancelled once it returns (kills the `finally: call.cancel()` dropped: the prefill worker kept seeing this
    decode worker's watch open, so a pairing given up still looked alive to it)."""
    call = WatchCall([SERVING, NOT_SERVING, SERVING], hang=True)
    stub = HealthStub(call)
    assert watch(call, armed=True, stub=stub) == STOPPING
    assert stub.asked == [("pair-7", (("k", "v"),), True)]
    assert call.cancelled


def test_a_watch_cancelled_at_the_stop_ends_its_stream():
    """DecodePairing.close cancels the watch: its stream must end with it (kills the `finally` cancel dropped)."""
    call = WatchCall([SERVING], hang=True)

    async def go():
        task = asyncio.ensure_future(watch_peer(HealthStub(call), (), armed_event(True), ""))
        while call.taken < 1:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(go())
    assert call.cancelled


def test_a_data_plane_that_stopped_ends_the_pairing_and_its_watch():
    """until_down returns when the receive loop stopped, naming why, and cancels the watch (kills the data plane's
    future left out of the wait: a receive loop that died left the pairing up, every request then waiting for a
    cache that never came; and `watch.cancel()` dropped: the old watch stayed open beside the next pairing's)."""
    async def go():
        stopped = asyncio.get_running_loop().create_future()
        w = asyncio.ensure_future(asyncio.Event().wait())  # a watch whose peer stays up
        asyncio.get_running_loop().call_soon(stopped.set_result, "the link broke")
        why = await until_down(w, stopped)
        await asyncio.sleep(0)  # the cancellation lands
        return why, w.cancelled()
    assert run(go()) == ("data plane failed: the link broke", True)


# --- decode_server/peer/peers.py: ties, the prompt limit, the one retry, the first pairing ---


class Pairing:
    """A DecodePairing as PrefillPeers reads it: up or not, its data plane's load, its announced prompt limit;
    `fails`: how its remote prefill fails (a PeerFailure), else it answers its own address."""

    def __init__(self, addr: str, up: bool = True, load: int = 0, max_prompt_tokens: int = 0,
                 fails: PeerFailure | None = None):
        self.addr, self.up, self.max_prompt_tokens, self.fails = addr, up, max_prompt_tokens, fails
        self.transport, self.stub, self.instance_id = "fake", object(), 1
        self.calls = 0
        self.supervised: list[bool] = []
        self.data = SimpleNamespace(load=lambda: load, remote_prefill=self._remote_prefill)

    async def _remote_prefill(self, stub, request, rid, deadline, metadata, destination, lease, wire, instance):
        self.calls += 1
        if self.fails is not None:
            raise self.fails
        return self.addr

    def supervise(self, paired: bool = True) -> None:
        self.supervised.append(paired)


def peers_of(*pairings: Pairing) -> PrefillPeers:
    peers = PrefillPeers(SimpleNamespace(on_failure="fail"), None, Metrics("decode"))
    for p in pairings:
        peers.add(p)
    return peers


def failure(cause: str = "peer_error") -> PeerFailure:
    return PeerFailure(cause, grpc.StatusCode.UNAVAILABLE, f"{cause} here")


def test_equally_loaded_peers_take_requests_in_turn():
    """Ties go round-robin, so idle peers share the work (kills the rotation's turn not advancing, or the rotated
    list not used: every request of an idle fleet went to the first prefill worker)."""
    peers = peers_of(Pairing("a"), Pairing("b"), Pairing("c"))
    chosen = [peers.choose().addr for _ in range(6)]
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"], chosen
    assert chosen[:3] in (["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"])


def test_the_prompt_limit_is_the_smallest_any_peer_announced():
    """A peer that announced none (0: an older prefill worker, or not paired yet) does not count (kills the
    filter dropped: (0, addr) came back, which reads as no limit, and prompts over a live peer's limit were sent to
    it); the smallest announced wins (kills min turned max: a prompt over one peer's limit was admitted)."""
    peers = peers_of(Pairing("a", max_prompt_tokens=0), Pairing("b", max_prompt_tokens=4096),
                     Pairing("c", max_prompt_tokens=1024))
    assert peers.prompt_limit() == (1024, "c")
    assert peers_of(Pairing("a")).prompt_limit() == (0, "")


def remote(peers: PrefillPeers, deadline_s: float = GUARD_S):
    return run(peers.remote_prefill(SimpleNamespace(), 7, time.perf_counter() + deadline_s, (), None, None, None))


def test_a_peer_failure_is_tried_once_more_on_another_peer_and_counted():
    """The first peer fails: the request goes to another peer that is up (the failure counted under its cause),
    and that peer's answer is the request's."""
    bad, good = Pairing("bad", fails=failure("peer_timeout")), Pairing("good", load=1)
    peers = peers_of(bad, good)
    assert remote(peers) == "good"
    assert (bad.calls, good.calls) == (1, 1)
    assert peers.metrics.registry.get_sample_value("kvt_failures_total", {"cause": "peer_timeout"}) == 1


def test_a_request_is_tried_on_two_peers_at_most():
    """A second failure is raised to the --on-failure policy even when a third peer is up (kills `len(tried) > 1`
    turned `> 2`: a request went round every prefill worker of a failing fleet before its policy applied, its
    deadline spent on retries instead of a recompute here)."""
    first, second, third = (Pairing(a, load=i, fails=failure()) for i, a in enumerate(("p1", "p2", "p3")))
    peers = peers_of(first, second, third)
    with pytest.raises(PeerFailure):
        remote(peers)
    assert (first.calls, second.calls, third.calls) == (1, 1, 0)


class Starting(Pairing):
    """A pairing whose first handshake ends when the test says: `outcome` set to None (paired) or an exception."""

    def __init__(self, addr: str):
        super().__init__(addr, up=False)
        self.outcome: asyncio.Future | None = None

    async def start(self) -> None:
        self.outcome = asyncio.get_running_loop().create_future()
        error = await self.outcome
        if error is not None:
            raise error
        self.up = True


async def settle() -> None:
    """Let every task that can run, run (no thread or socket is involved: the same steps every time)."""
    for _ in range(50):
        await asyncio.sleep(0)


async def start_outcome(peers: PrefillPeers) -> HandshakeRefused | None:
    """peers.start() in a task of its own: a HandshakeRefused (a SystemExit, which a task would raise out of the
    loop) comes back as its value."""
    try:
        await peers.start()
    except HandshakeRefused as e:
        return e
    return None


async def started(peers: PrefillPeers) -> asyncio.Task:
    task = asyncio.ensure_future(start_outcome(peers))
    while any(p.outcome is None for p in peers.pairings):
        await asyncio.sleep(0)
    return task


def test_at_start_a_peer_that_timed_out_keeps_trying_once_another_paired():
    """The start waits for the first pairing; a peer that gave up before it (timed out) and one still pairing
    when it came both keep pairing in the background (kills the timed-out peers' `supervise(paired=False)`
    dropped, and the late peers' callback: a prefill worker that was slow to start never joined)."""
    early, first, late = Starting("early"), Starting("first"), Starting("late")
    peers = peers_of(early, first, late)

    async def go():
        task = await started(peers)
        early.outcome.set_result(HandshakeTimedOut("early: no answer"))
        await settle()  # the start has seen it time out before the first pairs
        first.outcome.set_result(None)
        assert await task is None  # the first pairing is up
        assert (early.supervised, first.supervised, late.supervised) == ([False], [], [])
        late.outcome.set_result(HandshakeTimedOut("late: no answer"))
        while not late.supervised:
            await asyncio.sleep(0)
    run(go())
    assert late.supervised == [False]


def test_at_start_a_refusal_ends_the_start_and_a_timeout_alone_does_not():
    """A refused handshake (another model or layout) ends the start at once, whatever the others do (kills the
    isinstance check flipped: the refusal was waited out as a timeout, and the decode worker served beside a peer
    that can never pair); with every peer timed out, the first timeout is raised."""
    refused, slow = Starting("refused"), Starting("slow")
    peers = peers_of(refused, slow)

    async def go():
        task = await started(peers)
        refused.outcome.set_result(HandshakeRefused("another model"))
        error = await task
        assert type(error) is HandshakeRefused and str(error) == "another model"
        await settle()
        assert slow.outcome.cancelled()  # its handshake given up with the start
    run(go())

    one, two = Starting("one"), Starting("two")
    peers = peers_of(one, two)

    async def both_time_out():
        task = await started(peers)
        one.outcome.set_result(HandshakeTimedOut("one: no answer"))
        await settle()
        two.outcome.set_result(HandshakeTimedOut("two: no answer"))
        error = await task
        assert type(error) is HandshakeTimedOut and str(error) == "one: no answer"
    run(both_time_out())


# --- decode_server/peer/remote.py: which answers of the prefill worker are its failure ---


class Expecting:
    """A receive loop as remote_prefill uses it: the request is expected, then forgotten and released."""

    def expect(self, rid, n, destination, lease):
        return SimpleNamespace(future=None, t_ready=0.0)

    def forget(self, rid):
        pass

    def release(self, exp):
        pass


def prefill_answering(code: grpc.StatusCode):
    """A decode worker's data plane whose prefill worker answers `code`; what remote_prefill raises."""
    loaded = SimpleNamespace(device=None, geometry=None)
    dp = DataPlane(DecodeConfig(peer_timeout_s=10 * GUARD_S), loaded, registry.backend("fake"), addr="prefill:1")
    dp.loop = Expecting()

    class Stub:
        async def Prefill(self, request, timeout, metadata):
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="it said no")

    request = SimpleNamespace(token_ids=[5, 6, 7], mode=0, return_logits_digest=False)
    with pytest.raises(Exception) as e:
        run(dp.remote_prefill(Stub(), request, 43, time.perf_counter() + GUARD_S, (), None, None))
    return e.value


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL", "UNKNOWN", "DATA_LOSS", "ABORTED", "CANCELLED"])
def test_the_prefill_workers_own_failures_go_to_the_on_failure_policy(code):
    """A peer that failed (down, crashed, lost or aborted the data, cancelled) is the policy's to handle: fail or
    recompute here, after one try on another peer (kills each code dropped from PEER_CODES: such a request kept the
    peer's status, was never retried nor recomputed under --on-failure recompute)."""
    e = prefill_answering(grpc.StatusCode[code])
    assert type(e) is PeerFailure and e.cause == "peer_error" and e.code == grpc.StatusCode[code]
    assert e.message == f"the prefill worker at prefill:1 failed the request ({code}: it said no)"


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
                                  "FAILED_PRECONDITION"])


def test_what_the_request_itself_got_wrong_keeps_its_status(code):
    """A refusal of the request's own (bad input, a limit, its own deadline) is not the peer's failure (kills
    DEADLINE_EXCEEDED or another of these added to PEER_CODES: a request out of time, or refused for its input, was
    sent to a second prefill worker and then recomputed here, twice the work for the same refusal)."""
    e = prefill_answering(grpc.StatusCode[code])
    assert type(e) is RequestError and e.code == grpc.StatusCode[code] and e.message == "prefill worker: it said no"


# --- kvtransfer/engine/queued.py: a delivered step's tokens and first tokens ---


class Lease:
    """A pool lease as the queued step holds and lets go of it."""

    def __init__(self, slot: int = 3):
        self.slot, self.holds = slot, 0

    def hold(self):
        self.holds += 1

    def release(self):
        self.holds -= 1


def test_a_delivered_row_s_token_carries_its_logits_digest():
    """A request that asked for digests gets each token's logits digest, the check that a disaggregated run made the
    same logits as a colocated one (kills hand_out's digest turned "": every token after the first came without
    one, and `--verify` runs compared nothing)."""
    got = []
    rows = torch.arange(12, dtype=torch.float32).view(2, 6)
    seqs = [Sequence(1, Lease(), 9, 4, 2, got.append, want_digest=True),
            Sequence(2, Lease(), 9, 4, 2, got.append, want_digest=False)]
    done = QueuedStep(seqs, None, None, None, {0: rows[0]}, [2, 2])
    assert hand_out(done, None, [7, 8], 1.5) == []
    assert got == [Token(1, 7, logits_digest(rows[0]), 1.5, False), Token(1, 8, "", 1.5, False)]


def test_a_prompt_finished_in_a_step_gets_its_first_token_digest_and_prefill_time():
    """release_delivered tells each prompt whose last chunk rode in the step its first token (after the decode rows'
    tokens in the host copy), its first logits' digest, and its prefill time in ms from its first chunk (kills the
    digest turned "": a mixed-prefilled request's first token came without its digest; and `* 1e3` dropped: its
    prefill_ms, in the answer's timing and the kvt_prefill_ms histogram, read a thousand times too small)."""
    row_lease, chunk_lease, first = Lease(), Lease(), torch.linspace(-1.0, 1.0, 6)
    row_lease.holds = chunk_lease.holds = 1  # the step's holds, taken when it was queued
    row = Sequence(1, row_lease, 9, 4, 2, lambda item: None)
    task = SimpleNamespace(future=Future(), t0=10.0, lease=chunk_lease)
    done = QueuedStep([row], None, None, None, {}, [1], chunk_tasks=[task], first_tasks=[task], first_logits=[first])
    ended = []
    release_delivered(done, [5, 42], 10.25, [], lambda s, item: ended.append(item))  # the row's token, then the first
    assert task.future.result(timeout=0) == LocalPrefill(42, logits_digest(first), 250.0)
    assert row_lease.holds == chunk_lease.holds == 0 and ended == []


def test_a_queued_step_keeps_the_replay_event_its_step_just_recorded():
    """queue_step hands the step's `replayed` (recorded during this call) to the QueuedStep whose staging_s reads it
    (kills it passed as None: every served step's staging read 0, on CUDA graphs too)."""
    event = object()  # the event the step recorded before its replay

    class OneHot:  # a plain step that replays a graph
        replayed, mixed_graphs = None, {}

        def __call__(self, tokens, positions, slots):
            self.replayed = event
            return torch.nn.functional.one_hot(tokens % 8, 8).float()

    lease = Lease()
    q = queue_step(OneHot(), torch.device("cpu"), [Sequence(1, lease, 9, 4, 2, lambda item: None)], None)
    assert q.replayed is event
    assert q.host.tolist() == [4] and lease.holds == 1  # the step ran: token 4's one-hot row, the slot held


# --- kvtransfer/engine/graphs.py: the event before a graph's replay (a step's staging time) ---


class CudaEvent:
    """torch.cuda.Event as Step uses it: recorded into `trace` (a list shared with the graphs)."""

    trace: list = []

    def __init__(self, enable_timing: bool = False):
        self.enable_timing = enable_timing

    def record(self):
        CudaEvent.trace.append(("event", self))


class Graph:
    def replay(self):
        CudaEvent.trace.append(("replay", self))


@pytest.fixture
def graphed(monkeypatch):
    """A Step with a captured graph per bucket (stand-ins) over a runner that says it is on CUDA, its events
    recorded into CudaEvent.trace; eager work (the mixed step without a graph) returns `eager`."""
    CudaEvent.trace = []
    monkeypatch.setattr(graphs.torch.cuda, "Event", CudaEvent)
    eager = (torch.zeros(1, 8), torch.zeros(1, 8))
    monkeypatch.setattr(graphs, "mixed_forward", lambda *args: eager)
    runner = SimpleNamespace(device=torch.device("cpu"), lm_head=torch.zeros(8, 4), pool=SimpleNamespace(scratch=0))
    step = graphs.Step(runner, max_batch=4, cuda_graphs=False, sampling=False)
    step._inputs()
    out = torch.zeros(4, 8)
    step.graphs = {b: (Graph(), out) for b in step.buckets}
    runner.device = SimpleNamespace(type="cuda")
    return step


def decode_inputs(n: int):
    return torch.arange(n), torch.arange(n) + 5, torch.arange(n) + 1


def test_a_graphed_step_records_its_event_just_before_the_replay(graphed):
    """The step's staging time runs from its start to this event: the event must be recorded, timed, before the
    replay (kills the event's record moved after the replay: staging_s took the graph's own work in, and the metric
    read the whole step as staging; and the event never made: staging_s read 0 on every GPU step)."""
    graphed(*decode_inputs(3))
    (what, event), (what2, graph) = CudaEvent.trace
    assert (what, what2) == ("event", "replay") and graph is graphed.graphs[4][0]
    assert graphed.replayed is event and event.enable_timing


def test_a_mixed_step_run_eagerly_after_a_graphed_one_reports_no_replay(graphed):
    """A mixed step that falls back to eager (no graph holds its rows) has no replay event; the last graphed step's
    must not stand for it (kills the mixed step's reset of `replayed` dropped: its staging_s was read from an
    event recorded a step earlier, before its own start, and came out negative)."""
    graphed(*decode_inputs(2))
    assert graphed.replayed is not None
    chunk = Chunk(torch.arange(3), slot=2, start=0, last=True)
    graphed.mixed(*decode_inputs(1), [chunk])
    assert graphed.replayed is None


# --- kvtransfer/transport/layout.py: when K and V (and layers) may be sent or landed as one view ---


def test_k_and_v_are_one_view_only_when_v_directly_follows_k_in_one_storage():
    """kv_pair_view is a zero-copy (2, ...) view over K then V: of the same storage, dtype and shape, V starting
    where K ends, the view starting where K does (kills `k.storage_offset()` turned 0: a layer other than the
    first sent layer 0's bytes). Anything else is None, and the sender copies (kills V anywhere after K accepted:
    the bytes between them were sent as V; the shape check dropped: V's first elements only, in K's shape; the
    dtype check dropped: V's bits read as K's dtype; the one-storage check dropped: a view over K's storage ran
    past its end)."""
    block = torch.arange(3 * 2 * 6, dtype=torch.float32).view(3, 2, 2, 3)
    pair = kv_pair_view(block[1, 0], block[1, 1])
    assert pair is not None and pair.shape == (2, 2, 3) and pair.data_ptr() == block[1, 0].data_ptr()
    assert torch.equal(pair, block[1])
    assert kv_pair_view(block[0, 0], block[1, 1]) is None  # V further on, not next
    flat = torch.zeros(10)
    assert kv_pair_view(flat[:4].view(2, 2), flat[4:].view(2, 3)) is None  # V of another shape
    assert kv_pair_view(flat[:4], flat[4:8].view(torch.int32)) is None  # V of another dtype
    raw = bytearray(32)
    k, v = torch.frombuffer(raw, dtype=torch.float32, count=4), torch.frombuffer(raw, dtype=torch.float32,
                                                                                  count=4, offset=16)
    assert v.data_ptr() == k.data_ptr() + k.nbytes  # adjacent, but two storages
    assert kv_pair_view(k, v) is None


def test_layers_are_one_run_only_when_each_follows_the_last():
    """contiguous_run: n (2, ...) tensors each starting where the last ends are one (n, 2, ...) view, the landing
    place a transfer writes into directly (kills the offset off by one: no run was ever found, and every transfer
    landed in a staging block and was copied again; and run_or_stack copying a run that is one: the gloo sender
    copied every message's layers once more); strided ones, or ones with a gap, are None (kills the
    contiguity check dropped: a transposed layer was viewed as contiguous and took the wrong bytes)."""
    block = torch.arange(4 * 2 * 6, dtype=torch.float32).view(4, 2, 2, 3)
    run = contiguous_run([block[1], block[2], block[3]])
    assert run is not None and run.data_ptr() == block[1].data_ptr() and torch.equal(run, block[1:])
    assert contiguous_run([block[0], block[2]]) is None
    square = torch.arange(2 * 2 * 3 * 3, dtype=torch.float32).view(2, 2, 3, 3)
    assert contiguous_run([square[0].transpose(-1, -2), square[1].transpose(-1, -2)]) is None
    stacked = run_or_stack([square[0].transpose(-1, -2), square[1].transpose(-1, -2)])
    assert torch.equal(stacked, square.transpose(-1, -2))
    assert run_or_stack([block[2], block[3]]).data_ptr() == block[2].data_ptr()  # adjacent: sent as is, no copy


def test_a_kv_block_holds_layer_i_s_k_and_v_at_i_0_and_i_1_and_its_bytes_are_bytes():
    """kv_block is (layers, 2, ...) (kills (2, layers, ...): layer i's K and V were not adjacent, so no frame of it
    was one view); byte_array is the tensor's bytes, bfloat16 too (kills the uint8 view dropped: numpy has no
    bfloat16, and the gRPC staging's byte offsets counted elements)."""
    block = kv_block(3, (1, 2, 4, 5), torch.bfloat16, torch.device("cpu"))
    assert block.shape == (3, 2, 1, 2, 4, 5) and block.dtype == torch.bfloat16
    t = torch.arange(6, dtype=torch.bfloat16)
    raw = byte_array(t)
    assert raw.dtype.name == "uint8" and raw.nbytes == t.nbytes == 12
    assert bytes(raw) == t.view(torch.uint8).numpy().tobytes()


# --- api_server/__main__.py: the socket, the TLS and token checks, the exit code ---


def test_the_http_front_binds_ipv4_and_bracketed_ipv6_and_names_a_taken_port():
    """--listen [::1]:PORT binds an IPv6 socket (kills the family always AF_INET: an IPv6 --listen exited 2 as
    "cannot bind"); a taken port is one line naming the flag."""
    with api_main.bind("127.0.0.1:0") as four:
        assert four.family == socket.AF_INET
        with pytest.raises(ValueError, match=f"--listen 127.0.0.1:{four.getsockname()[1]}: cannot bind"):
            api_main.bind(f"127.0.0.1:{four.getsockname()[1]}")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with api_main.bind("[::1]:0") as six:
        assert six.family == socket.AF_INET6 and six.getsockname()[0] == "::1"


def test_only_loopback_hosts_count_as_loopback():
    """`localhost` and 127.0.0.0/8, ::1 are loopback: no warning there (kills `localhost` dropped: the default-
    looking `--listen localhost:8000` warned that anyone could call it)."""
    assert all(api_main._loopback(h) for h in ("localhost", "127.0.0.1", "127.3.2.1", "::1"))
    assert not any(api_main._loopback(h) for h in ("0.0.0.0", "10.1.2.3", "::", "example.com"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("pki")
    subprocess.run(["bash", os.path.join(ROOT, "deploy", "make_test_ca.sh"), str(out), "1"], check=True,
                   capture_output=True)
    return {n: str(out / n) for n in ("ca.pem", "server.pem", "server.key")}


def prepared(**flags):
    """The uvicorn server `kvtransfer-api` would run with these flags (its socket closed at once)."""
    server, sock = api_main._prepare(ApiConfig(served_model_name="m", **{"listen": "127.0.0.1:0", **flags}))
    sock.close()
    return server


def test_a_certificate_that_does_not_parse_is_refused_at_start_naming_the_flags(pki, tmp_path):
    """The TLS context is built before the socket is bound, so a bad --tls-cert is one line naming the flags and
    exit 2 (kills `uv.load()` dropped: the start went on, bound the port, and uvicorn failed inside its run with
    a traceback)."""
    bad = tmp_path / "bad.pem"
    bad.write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="--tls-cert/--tls-key/--tls-ca: cannot load"):
        prepared(tls_cert=str(bad), tls_key=pki["server.key"])


def test_a_front_reachable_from_other_hosts_warns_of_what_it_lacks(pki, caplog):
    """Off loopback, the start warns unless both TLS and a token guard the front, naming what is missing (kills
    `and token` dropped: a front with TLS and no token, open to any caller, said nothing)."""
    tls = dict(tls_cert=pki["server.pem"], tls_key=pki["server.key"])

    def warned(**flags) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtransfer.api"):
            prepared(**flags)
        return [r.getMessage() for r in caplog.records if "anyone who can reach" in r.getMessage()]

    assert warned(listen="0.0.0.0:0", **tls) == ["listening on 0.0.0.0:0 without a token: anyone who can reach "
                                                 "this address can call it"]
    assert warned(listen="0.0.0.0:0") == ["listening on 0.0.0.0:0 without TLS and a token: anyone who can reach "
                                          "this address can call it"]
    assert warned(listen="0.0.0.0:0", auth_token="s3cret", **tls) == []
    assert warned() == []  # loopback


@pytest.mark.parametrize("started,code", [(True, 0), (False, 2)])
def test_the_api_exits_0_after_serving_and_2_when_uvicorn_never_started(monkeypatch, started, code):
    """A front whose server never started (uvicorn gave up at its start) exits 2, as a refused start does (kills
    the exit always 0: a supervisor saw a front that never served as a clean stop); and SIGTERM/SIGINT are made
    no-ops for uvicorn's re-raise at its end, so a signal stop exits 0 (kills the handlers not installed)."""
    ran = []

    class Server:
        def run(self, sockets):
            ran.append(sockets)
            self.started = started

    sock = socket.socket()
    monkeypatch.setattr(api_main, "_prepare", lambda config: (Server(), sock))
    monkeypatch.setattr(api_main.logging, "basicConfig", lambda **kw: None)  # the test session's logging stays
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as e:
            api_main.main(["--served-model-name", "m"])
        handlers = {s: signal.getsignal(s) for s in saved}
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        sock.close()
    assert e.value.code == code and ran == [[sock]]
    for s, h in handlers.items():
        assert callable(h) and h not in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler), (s, h)
        assert h(s, None) is None


# --- router/__main__.py: the drain at a stop ---


def test_the_router_gives_its_requests_in_flight_the_shutdown_grace(monkeypatch):
    """At SIGTERM the router drains for --shutdown-grace-s (kills the grace passed as 0: every stream in flight
    through the router was cut at once, though each worker would have finished it). The router runs in this loop,
    its workers, service and gRPC server stand-ins; the drain itself (kvtransfer/rpc/lifecycle.shut_down) is
    test_lifecycle_mutants.py's."""
    drains, stops = [], []

    class Workers:
        def __init__(self, addrs, *args):
            self.workers, self.on_change = [SimpleNamespace(addr=a) for a in addrs], None

        def healthy(self):
            return True

        def describe(self):
            return "1 worker"

        def open(self):
            pass

        def start(self):
            pass

        async def close(self):
            pass

    class Server:
        async def start(self):
            pass

    class CapturedStop(router_main.Stop):
        def __init__(self):
            super().__init__()
            stops.append(self)

    async def shut_down(server, health, running, stop, grace_s, log, role):
        drains.append((grace_s, role, stop.signal))

    monkeypatch.setattr(router_main, "WorkerSet", Workers)
    monkeypatch.setattr(router_main, "RouterService", lambda *args: SimpleNamespace(running=None, health=None))
    monkeypatch.setattr(router_main, "build_server", lambda *args: (Server(), 50050, args[-1]))
    monkeypatch.setattr(router_main, "Stop", CapturedStop)
    monkeypatch.setattr(router_main, "shut_down", shut_down)

    async def go():
        task = asyncio.ensure_future(router_main.serve(RouterConfig(worker=("127.0.0.1:50051",), shutdown_grace_s=7.5)))
        while not stops:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        stops[0]._on(signal.SIGTERM)
        await task
    run(go())
    assert drains == [(7.5, "router", "SIGTERM")]


# --- prefill_server/__main__.py: what the flags become ---


class Served(SimpleNamespace):
    """What a server's serve() made of its flags, as the stand-ins around it saw it."""


async def both(serve, driver):
    """Run a server's serve() and the test's driver of it together; the first failure of either is raised (a
    driver that failed would otherwise leave serve() waiting for a stop that never comes)."""
    tasks = [asyncio.ensure_future(serve), asyncio.ensure_future(driver)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class NotFound(Exception):
    pass


class CheckContext:
    """The context a health Check aborts on (NOT_FOUND) for a service never set."""

    async def abort(self, code, details=""):
        raise NotFound(code)


async def health_status(health, service: str) -> int | None:
    """A health servicer's status for `service` (None: it was never set)."""
    try:
        return (await health.Check(health_pb2.HealthCheckRequest(service=service), CheckContext())).status
    except NotFound:
        return None


def serve_prefill(monkeypatch, **flags) -> Served:
    """prefill_server.__main__.serve over stand-ins (no model, no port): it runs to its stop (a SIGTERM, given once
    it waits) and its drain, recording what each part was built with and the health it set."""
    seen, stops = Served(links=[], drains=[], stores=[]), []

    class Service:
        def __init__(self, config, worker, compat, backend, connect, metrics, store):
            seen.connect, seen.store = connect, store
            self.pairing, self.running = SimpleNamespace(health=new_health(), stopping=False), None

        async def close(self):
            pass

    class Server:
        async def start(self):
            pass

    class CapturedStop(prefill_main.Stop):
        def __init__(self):
            super().__init__()
            stops.append(self)

    async def create_server(config, service, token):
        seen.service = service
        return Server(), 50061

    async def shut_down(server, health, running, stop, grace_s, log, role, before_stop=None):
        seen.drains.append((grace_s, role, seen.service.pairing.stopping))

    async def health_when_started():
        while not stops or not hasattr(seen, "service"):
            await asyncio.sleep(0)
        for _ in range(50):  # serve() on to its wait for the stop
            await asyncio.sleep(0)
        seen.health_at_start = await health_status(seen.service.pairing.health, "")
        stops[0]._on(signal.SIGTERM)

    loaded = SimpleNamespace(spec=None, model=None, geometry=None, device=torch.device("cpu"))
    monkeypatch.setattr(prefill_main, "pick_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(prefill_main, "load", lambda spec, device, deterministic: loaded)
    monkeypatch.setattr(prefill_main, "local_compat", lambda *args: None)
    monkeypatch.setattr(prefill_main, "PrefillWorker", lambda *args: setattr(seen, "worker", args))
    monkeypatch.setattr(prefill_main, "PrefillService", Service)
    monkeypatch.setattr(prefill_main, "create_server", create_server)
    monkeypatch.setattr(prefill_main, "Stop", CapturedStop)
    monkeypatch.setattr(prefill_main, "shut_down", shut_down)
    monkeypatch.setattr(registry, "sender_link", lambda *args, **kw: seen.links.append((args, kw)))
    monkeypatch.setattr(rendezvous, "open_store", lambda *args: seen.stores.append(args) or "store")

    config = PrefillConfig(**{"device": "cpu", "transport": "grpc", **flags})
    run(both(prefill_main.serve(config), health_when_started()))
    return seen


def test_the_prefill_worker_s_links_connect_within_its_send_timeout(monkeypatch):
    """A sender link gets --send-timeout-s to connect (kills it replaced: a decode worker's data listener that
    no longer answered held a pairing's connect far past the flag)."""
    seen = serve_prefill(monkeypatch, send_timeout_s=7.0)
    seen.connect("127.0.0.1:9")
    [(args, kw)] = seen.links
    assert args[0] == "grpc" and kw["address"] == "127.0.0.1:9" and kw["connect_timeout_s"] == 7.0
    assert seen.worker[1] == 7.0  # and the worker bounds each transfer's finish by it


def test_the_fault_flags_build_the_stall_they_name(monkeypatch):
    """--fail-after-layers 0 holds the first layer (kills `>= 0` turned `> 0`: the flag's documented 0 turned
    fault injection off); --fail-requests holds that many requests (kills it replaced by 1); -1 is off."""
    fault = serve_prefill(monkeypatch, fail_after_layers=0, fail_stall_s=2.5, fail_requests=3).worker[2]
    assert (fault.after_layers, fault.stall_s, fault.left) == (0, 2.5, 3)
    assert serve_prefill(monkeypatch).worker[2] is None


def test_the_rendezvous_store_waits_dist_timeout_s(monkeypatch):
    """gloo: the store is hosted at --dist-init, rank 0, waiting --dist-timeout-s (kills another timeout)."""
    seen = serve_prefill(monkeypatch, transport="gloo", dist_init="tcp://127.0.0.1:29555", dist_timeout_s=12.0)
    assert seen.stores == [("tcp://127.0.0.1:29555", 0, 12.0)] and seen.store == "store"


def test_the_prefill_worker_says_not_serving_until_paired_and_refuses_handshakes_while_it_drains(monkeypatch):
    """Health "" is NOT_SERVING from its start (kills the set dropped: the servicer's default SERVING told a load
    balancer an unpaired prefill worker was ready). At a stop, the pairing stops taking handshakes before the drain,
    which gets --shutdown-grace-s (test_metrics.py and test_pair_lifecycle.py catch those two in real processes;
    here they are the same run's last facts)."""
    seen = serve_prefill(monkeypatch, shutdown_grace_s=9.0)
    assert seen.health_at_start == NOT_SERVING
    assert seen.drains == [(9.0, "prefill server", True)]


# --- decode_server/__main__.py: what the flags become ---


def serve_decode(monkeypatch, stop_with=None, **flags) -> Served:
    """decode_server.__main__.serve over stand-ins (no model, no engine, no port; each prefill pairing pairs at
    once), to its stop and drain. `stop_with(seen, stop)`: how the test stops it once it serves (a coroutine;
    default: SIGTERM)."""
    seen, stops = Served(pairings=[], slots=None, channels=[], drains=[], metrics=None, fatal=None), []

    class Pairing:
        def __init__(self, config, loaded, backend, compat, channel, metadata, metrics, on_change, addr, init):
            self.addr, self.init, self.on_change, self.transport = addr, init, on_change, backend.name
            self.up, self.max_prompt_tokens, self.on_fatal = False, 0, None
            seen.pairings.append(self)

        def watch_fatal(self, on_fatal):
            self.on_fatal = on_fatal

        async def start(self):
            self.up = True
            await self.on_change()

        async def close(self):
            pass

    class Service:
        def __init__(self, config, engine, peers, metrics, metadata):
            self.health, self.running, self.failed = None, None, ""

        def fail_all(self, cause):
            self.failed = cause

        def end_for_shutdown(self, r):
            pass

    class Server:
        async def start(self):
            pass

    class CapturedStop(decode_main.Stop):
        def __init__(self):
            super().__init__()
            stops.append(self)

    async def create_server(config, service, token="", health=None):
        seen.service = service
        service.health = health if health is not None else new_health()
        return Server(), 50051

    async def shut_down(server, health, running, stop, grace_s, log, role, end):
        seen.drains.append((grace_s, role))

    def start_metrics(role, port, addr):
        seen.metrics = Metrics(role)
        return seen.metrics

    def plan_engine(config, loaded, receive_slots):
        seen.slots = receive_slots
        return None, "the plan"

    def channel_options(max_message_bytes, keepalive_s):
        seen.channels.append((max_message_bytes, keepalive_s))
        return []

    async def status(name: str) -> int | None:
        return await health_status(seen.service.health, name)

    async def sigterm(seen, stop):
        stop._on(signal.SIGTERM)

    async def serving_then_stop():
        while not stops or not hasattr(seen, "service") or seen.service.health is None:
            await asyncio.sleep(0)
        for _ in range(50):  # serve() on to its wait for the stop
            await asyncio.sleep(0)
        seen.health = {name: await status(name) for name in ("", DECODE_SERVICE)}
        await (stop_with or sigterm)(seen, stops[0])

    loaded = SimpleNamespace(spec=None, model=None, geometry=None, device=torch.device("cpu"))
    monkeypatch.setattr(decode_main, "pick_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(decode_main, "load", lambda spec, device, deterministic: loaded)
    monkeypatch.setattr(decode_main, "start_metrics", start_metrics)
    monkeypatch.setattr(decode_main, "plan_engine", plan_engine)
    monkeypatch.setattr(decode_main, "DecodeEngine", lambda *args, **kw: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(decode_main, "local_compat", lambda *args: None)
    monkeypatch.setattr(decode_main, "peer_channel_options", channel_options)
    monkeypatch.setattr(decode_main, "DecodePairing", Pairing)
    monkeypatch.setattr(decode_main, "DecodeService", Service)
    monkeypatch.setattr(decode_main, "create_server", create_server)
    monkeypatch.setattr(decode_main, "Stop", CapturedStop)
    monkeypatch.setattr(decode_main, "shut_down", shut_down)

    pair_flags = {} if flags.get("colocated") else {"transport": "gloo", "dist_init": "tcp://127.0.0.1:29500"}

    async def go():
        try:
            await both(decode_main.serve(DecodeConfig(**{"device": "cpu", **pair_flags, **flags})), serving_then_stop())
        except FatalStop as e:  # what makes the process exit 70
            seen.fatal = e
        seen.stop = stops[0]
    run(go())
    return seen


def test_colocated_warns_of_each_peer_flag_it_ignores_and_exports_no_peer_gauge(monkeypatch, caplog):
    """--colocated beside a peer's flags serves, saying which flags have no effect (kills the warning dropped: an
    operator who meant a pair got a colocated server without a word); it exports no kvt_peer_up, whose 0 would read
    as a pair down (kills export_peer_up(True)); and it reserves no receive slots."""
    with caplog.at_level(logging.WARNING, logger="kvtransfer.decode"):
        seen = serve_decode(monkeypatch, colocated=True, prefill_addr="10.0.0.9:50061", peer_timeout_s=5.0)
    assert any(r.getMessage() == "--prefill-addr, --peer-timeout-s: no effect with --colocated (this worker "
               "prefills itself; no prefill peer)" for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert seen.metrics.registry.get_sample_value("kvt_peer_up") is None
    assert seen.slots == 0 and seen.pairings == []


def test_a_pair_reserves_a_receive_slot_per_prefill_worker_and_keeps_each_link_alive(monkeypatch):
    """Each prefill worker's caches may land at once: one receive slot per peer is kept out of the pool (kills the
    count of peers dropped: an xPyD decode worker planned device memory for one landing cache); a pairing that dies
    stops the server (kills watch_fatal dropped: a dead pairing task left the worker up, NOT_SERVING for good,
    never pairing again); each pairing gets its own rendezvous and control channel, pinging every
    --peer-keepalive-s (test_faults.py's link-down case catches that one); kvt_peer_up is exported."""
    seen = serve_decode(monkeypatch, prefill_addr="127.0.0.1:50061,127.0.0.1:50062",
                        dist_init="tcp://127.0.0.1:29500,tcp://127.0.0.1:29501", peer_keepalive_s=3.0)
    assert seen.slots == 2
    assert [c[1] for c in seen.channels] == [3.0, 3.0]
    assert [(p.addr, p.init) for p in seen.pairings] == [("127.0.0.1:50061", "tcp://127.0.0.1:29500"),
                                                         ("127.0.0.1:50062", "tcp://127.0.0.1:29501")]
    assert all(p.on_fatal == seen.stop.fail for p in seen.pairings)
    assert seen.metrics.registry.get_sample_value("kvt_peer_up") == 2


def test_a_fatal_stop_does_not_wait_out_the_grace(monkeypatch):
    """A server whose engine or pairing died stops at once (its requests already failed), then exits 70 (kills the
    grace kept for a fatal stop: a dead server stayed up --shutdown-grace-s, answering nothing)."""
    async def engine_dies(seen, stop):
        stop.fail("the decode scheduler", RuntimeError("device lost"))
    seen = serve_decode(monkeypatch, stop_with=engine_dies, shutdown_grace_s=9.0)
    assert str(seen.fatal) == "the decode scheduler died: RuntimeError: device lost"
    assert seen.drains == [(0.0, "decode server")] and seen.service.failed == str(seen.fatal)
    assert serve_decode(monkeypatch, shutdown_grace_s=9.0).drains == [(9.0, "decode server")]  # a SIGTERM: the grace
