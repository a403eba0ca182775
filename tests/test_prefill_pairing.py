"""A prefill worker's request that comes while its pair's process-group pairing is still in progress waits for it
(prefill_server/pairing.py, PrefillPairing.request), in process, with the join held where the test wants it.

Why: the decode worker counts the pair up (and turns SERVING) as soon as its own side of the gloo/NCCL join returns,
and a client may send at once. On the prefill side the join runs on a thread of its own, which then hands the group
to the device thread to be warmed up; a request that reached the device thread first found "no data plane paired
here" (UNAVAILABLE for a request sent once the decode worker was SERVING: test_prefix_servers failed so on a
fresh clone with one core kept busy). Why in process: the window is a thread's scheduling, which real processes
show only now and then; here the join is held until the request has queued whatever it queues on the device
thread, so the old order happens every time.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from kvtransfer.transport import TransferError, rendezvous
from kvtransfer.transport.registry import Rendezvous
from prefill_server.pairing import PrefillPairing

DECODE = 5  # the decode instance
GUARD_S = 60  # a request still waiting this long is a hang (the pairing's own bound is --dist-timeout-s, 3600 here)


@pytest.fixture
def held_join(monkeypatch):
    """The rendezvous with the join held: `joining` is set once the join thread is in it, `release` lets it go
    (`fail`: then it raises, as a join whose peer never came)."""
    held = SimpleNamespace(joining=threading.Event(), release=threading.Event(), fail=False)

    def join_pair(rank, store, prefix, device, *args):
        held.joining.set()
        assert held.release.wait(GUARD_S)
        if held.fail:
            raise RuntimeError("the peer did not join the process group")
        return f"group {prefix}"

    monkeypatch.setattr(rendezvous, "open_store", lambda *a: "store")
    monkeypatch.setattr(rendezvous, "store_address", lambda init: ("127.0.0.1", 1))
    monkeypatch.setattr(rendezvous, "pairing_prefix", lambda instance, epoch: f"{instance:x}/{epoch}")
    monkeypatch.setattr(rendezvous, "join_pair", join_pair)
    return held


def pairing(gpu) -> PrefillPairing:
    config = SimpleNamespace(dist_init="tcp://127.0.0.1:1", dist_timeout_s=3600.0, dist_op_timeout_s=0.0,
                             warmup_tokens=0, max_pending_pairings=16)
    worker = SimpleNamespace(m=SimpleNamespace(device=torch.device("cpu")), warmup=lambda n, link: None,
                             run=lambda link, *args: (link, args))
    backend = SimpleNamespace(name="gloo", rendezvous=Rendezvous.PROCESS_GROUP)
    metrics = SimpleNamespace(pairings=SimpleNamespace(inc=lambda: None), peer_up=SimpleNamespace(set=lambda n: None))
    return PrefillPairing(config, worker, backend, lambda address="", group=None: Link(f"link over {group}"), gpu,
                          metrics)


class Link(str):
    """A sender link as the pairing handles it: closed when its pair is dropped."""

    def close(self) -> None:
        pass


async def request_during_the_join(p: PrefillPairing, gpu, held) -> asyncio.Future:
    """A handshake, then a request while the join is held; once whatever the request queued on the device thread
    has run, the join goes on. The request's future."""
    loop = asyncio.get_running_loop()
    await p.handshake(SimpleNamespace(instance_id=DECODE, data_address=""), context=Context())
    assert await asyncio.to_thread(held.joining.wait, GUARD_S)
    task = asyncio.ensure_future(p.request(DECODE, "request 1"))
    for _ in range(5):
        await asyncio.sleep(0)  # the request is either waiting or queued on the device thread
    await loop.run_in_executor(gpu, lambda: None)  # the device thread is one FIFO: what was queued before has run
    held.release.set()
    return task


def test_a_request_during_the_join_waits_for_it_and_goes_over_the_new_link(held_join):
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            p = pairing(gpu)
            task = await request_during_the_join(p, gpu, held_join)
            return await asyncio.wait_for(task, GUARD_S), p
        (link, args), p = asyncio.run(scenario())
    assert link == f"link over group {p.instance_id:x}/1" and args == ("request 1",)  # this epoch's group
    assert p.pairs[DECODE].up


def test_a_request_during_a_join_that_fails_fails_once_it_has_failed(held_join):
    """Not after --dist-timeout-s: the failed pairing lets its waiting requests go on, to find no data plane."""
    held_join.fail = True
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            task = await request_during_the_join(pairing(gpu), gpu, held_join)
            with pytest.raises(TransferError, match="no data plane paired here"):
                await asyncio.wait_for(task, GUARD_S)
        asyncio.run(scenario())


class Refused(Exception):
    def __init__(self, code, details):
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise Refused(code, details)


class Health:
    """Every decode instance watching; setting a pair's health yields to the loop, as grpc's health service does
    while a Watch of it is being written to."""

    def watched(self, who):
        return True

    def left(self, who):
        return False

    def forget(self, who):
        pass

    def handshake(self, who, token):
        return "no liveness watch named"

    async def set_pair(self, who, up):
        await asyncio.sleep(0)

    async def set_any(self, up):
        await asyncio.sleep(0)


@pytest.fixture
def gated_join(monkeypatch):
    """Joins that wait at a gate (`gate.set()` lets every waiting join return its group)."""
    gate = SimpleNamespace(event=threading.Event())
    monkeypatch.setattr(rendezvous, "open_store", lambda *a: "store")
    monkeypatch.setattr(rendezvous, "store_address", lambda init: ("127.0.0.1", 1))
    monkeypatch.setattr(rendezvous, "pairing_prefix", lambda instance, epoch: f"{instance:x}/{epoch}")
    monkeypatch.setattr(rendezvous, "join_pair", lambda rank, store, prefix, *a: gate.event.wait(GUARD_S) and prefix)
    monkeypatch.setattr(rendezvous, "leave_pair", lambda group: None)
    yield gate
    gate.event.set()  # no join thread outlives the test


def capped(gpu, cap: int) -> PrefillPairing:
    p = pairing(gpu)
    p.config.max_pending_pairings, p.health = cap, Health()
    return p


async def handshake(p: PrefillPairing, who: int):
    return await p.handshake(SimpleNamespace(instance_id=who, data_address=""), context=Context())


async def joined(p: PrefillPairing, gate) -> None:
    """The gate opened and every pending pairing ended (no join thread left to call into a closed loop)."""
    gate.event.set()
    for _ in range(int(GUARD_S / 0.01)):
        if not p.pending():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("pairings still pending")


def test_handshakes_at_once_take_at_most_the_cap(gated_join):
    """Each takes its place before it yields: handshakes arriving together (while the health service is busy) could
    all pass the check before any took a place (8 of 8 past a cap of 2 in a review)."""
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            p = capped(gpu, 2)
            got = await asyncio.gather(*(handshake(p, who) for who in (11, 12, 13, 14)), return_exceptions=True)
            pending = p.pending()
            await joined(p, gated_join)
            return pending, got
        pending, got = asyncio.run(scenario())
    refused = [g for g in got if isinstance(g, Refused)]
    assert len(refused) == 2 and pending == 2, got
    assert all("--max-pending-pairings" in r.details and r.code.name == "RESOURCE_EXHAUSTED" for r in refused)


def test_a_handshake_cancelled_before_its_join_started_frees_its_place(gated_join):
    """A caller gone while its handshake waits on the health service: no join runs for that epoch, so nothing else
    would settle it, and its place stayed taken until that instance came back."""
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            p = capped(gpu, 1)
            task = asyncio.ensure_future(handshake(p, 11))
            await asyncio.sleep(0)  # inside its await on the health service
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert p.pending() == 0
            await handshake(p, 12)  # the place is free
            with pytest.raises(Refused):  # 11 is known here but never paired: it needs a place like a new one
                await handshake(p, 11)
            assert p.pending() == 1
            await joined(p, gated_join)
        asyncio.run(scenario())


def test_only_a_pair_pending_or_once_up_skips_the_cap(gated_join):
    """A pending pair may handshake again (its new epoch supersedes its join), and so may one that paired before (a
    decode worker after a failure); a pair that never paired takes a place like a new one, or callers without the
    token could collect pairs and start all their joins at once."""
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            p = capped(gpu, 1)
            await handshake(p, 11)
            with pytest.raises(Refused):
                await handshake(p, 12)
            await handshake(p, 11)  # pending: supersedes, no new place
            await joined(p, gated_join)
            assert p.pairs[11].up
            gated_join.event = threading.Event()  # joins wait again
            await handshake(p, 12)  # the one place
            with pytest.raises(Refused):
                await handshake(p, 13)
            await handshake(p, 11)  # paired before: in, though the place is taken
            assert p.pending() == 2
            await joined(p, gated_join)
        asyncio.run(scenario())


class BrokenLink(str):
    def close(self) -> None:
        raise RuntimeError("the old link would not close")


def test_a_rejoin_that_raises_on_the_device_thread_frees_its_place(gated_join):
    """Anything the device thread's part of a pairing raises (here the old link's close) ends that pairing: logged,
    and settled, or its place under --max-pending-pairings stayed taken with no join to free it."""
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            p = capped(gpu, 1)
            await handshake(p, 11)
            await joined(p, gated_join)
            gated_join.event = threading.Event()  # joins wait again
            p.pairs[11].link = BrokenLink("old link")
            await handshake(p, 11)  # paired before: in; its _rejoin raises dropping the old link
            for _ in range(int(GUARD_S / 0.01)):
                if not p.pending():
                    break
                await asyncio.sleep(0.01)
            assert not p.pending()
            await handshake(p, 12)  # the one place is free
            await joined(p, gated_join)
        asyncio.run(scenario())


# --- which liveness watch says a decode worker is gone (prefill_server/peer_health.py) ---


def test_an_old_watch_closing_after_the_new_handshake_is_not_the_decode_worker_leaving():
    """The link went down and came back: the old watch's stream closes here only after the new handshake, and before
    the watch it names opens. The decode worker is not gone (counted as gone, its new pairing was abandoned while it
    joined: the first request after it was back was recomputed, test_faults' link-down test, CI run 34). Kills the
    handshake keeping `seen` when its watch is not open yet."""
    from prefill_server.peer_health import PeerHealth
    h = PeerHealth()
    h.opened(11, "a")
    assert h.handshake(11, "a") == "its liveness watch open" and not h.left(11)
    assert h.handshake(11, "b") == "its liveness watch not open yet"  # pairing 2, its watch on its way
    h.closed(11, "a")  # the old connection's stream ends now
    assert not h.left(11) and not h.watched(11)
    h.opened(11, "b")
    assert not h.left(11) and h.watched(11)
    h.closed(11, "b")  # the named watch ends: the decode worker is gone
    assert h.left(11)


def test_only_the_named_watch_makes_its_decode_worker_seen():
    """A stream of the old pairing opening late (a retransmission) and closing does not count (kills `opened` making
    any watch count once one is named); the new one, already open at the handshake, does (kills the handshake
    clearing `seen` whatever the watch's state); a decode worker naming none goes by any watch, as before."""
    from prefill_server.peer_health import PeerHealth
    h = PeerHealth()
    h.handshake(11, "b")
    h.opened(11, "a")
    h.closed(11, "a")
    assert not h.left(11)
    h.handshake(12, "a")  # pairing 1, then pairing 2's watch opens before its handshake (the usual order)
    h.opened(12, "c")
    assert h.handshake(12, "c") == "its liveness watch open"
    h.closed(12, "c")
    assert h.left(12)
    h.opened(13, "")
    assert h.handshake(13, "") == "no liveness watch named"
    h.closed(13, "")
    assert h.left(13)
    h.forget(13)  # its pair dropped: a later watch starts afresh
    assert not h.left(13) and not h.open  # nothing kept for watches that ended


def test_a_watch_token_over_the_limit_is_read_as_none():
    from kvtransfer.rpc.server import MAX_WATCH_TOKEN, WATCH_KEY
    from prefill_server.peer_health import watch_token
    assert watch_token({WATCH_KEY: "ab12"}) == "ab12"
    assert watch_token({WATCH_KEY: "x" * (MAX_WATCH_TOKEN + 1)}) == "" and watch_token({}) == ""


def test_the_decode_side_names_the_watch_it_has_open_in_its_handshake():
    """decode_server/peer/pairing.py: each watch it opens carries a token of its own, and the handshake carries the
    token of the watch open then (kills either metadata losing the token, and a watch reopened under the old one)."""
    from decode_server.peer.pairing import DecodePairing
    from kvtransfer.rpc.server import DECODE_INSTANCE_KEY, WATCH_KEY

    class Stub:
        def __init__(self):
            self.calls, self.end = [], None

        def Watch(self, request, metadata, wait_for_ready):
            self.calls.append(dict(metadata))
            return self

        def __aiter__(self):
            return self

        async def __anext__(self):
            await self.end.wait()
            raise StopAsyncIteration

        def cancel(self):
            pass

    async def scenario():
        p = DecodePairing.__new__(DecodePairing)
        p.metadata, p.instance_id, p._watch, p._watch_token = (("authorization", "x"),), 0xab, None, ""
        p._armed, p.health_stub = asyncio.Event(), Stub()
        p.health_stub.end = asyncio.Event()
        p._open_watch()
        await asyncio.sleep(0)
        first = dict(p._handshake_metadata())
        assert first[WATCH_KEY] and first["authorization"] == "x"
        assert p.health_stub.calls[-1][WATCH_KEY] == first[WATCH_KEY]
        assert p.health_stub.calls[-1][DECODE_INSTANCE_KEY] == "ab"
        p._open_watch()  # still open: the same watch, the same token
        await asyncio.sleep(0)
        assert len(p.health_stub.calls) == 1 and dict(p._handshake_metadata())[WATCH_KEY] == first[WATCH_KEY]
        p.health_stub.end.set()
        await p._watch
        p.health_stub.end = asyncio.Event()
        p._open_watch()  # that one ended: a new watch, a new token, and the handshake names it
        await asyncio.sleep(0)
        second = dict(p._handshake_metadata())[WATCH_KEY]
        assert second != first[WATCH_KEY] and p.health_stub.calls[-1][WATCH_KEY] == second
        p._watch.cancel()
    asyncio.run(scenario())
