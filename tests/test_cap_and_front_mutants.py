"""Cases a mutation pass over the --max-pending-pairings cap (prefill_server/pair.py, pairing.py), the front's
slow-client guards (api_server/slow_clients.py), its body limit (api_server/limits.py) and --colocated's unused peer
flags (decode_server/config.py) found untested: each test here failed on a one-line change of that code that the
other tests let through.

Why in process: every case is a pairing's or a connection's ordering, held where the test wants it (a join waits at
a gate, the device thread is kept busy, a client's reads are scripted), so each runs in well under a second, the
same way every time; the real processes of test_pair_lifecycle.py and test_api_slow_clients.py show the same paths
only now and then.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from kvtransfer.transport import TransferError, rendezvous
from test_prefill_pairing import Refused, handshake, pairing

GUARD_S = 60  # a wait still not over after this long is a hang
SOON_S = 10  # what the code under test does at once, here within this (ms when it works; a mutant waits it out)


# --- the pairing's places (prefill_server/pair.py, pairing.py) ---


class Health:
    """PeerHealth's liveness bookkeeping (peer_health.py): `watching` the instances with a watch open now, `seen`
    those that ever had one; `left` = seen and no longer watching, and `forget` starts an instance afresh."""

    def __init__(self, *watching: int):
        self.watching, self.seen = set(watching), set(watching)

    def watched(self, who):
        return who in self.watching

    def left(self, who):
        return who in self.seen and who not in self.watching

    def forget(self, who):
        self.seen.discard(who)

    def handshake(self, who, token):  # no watch named (an older decode worker): any watch counts
        return "no liveness watch named"

    async def set_pair(self, who, up):
        await asyncio.sleep(0)

    async def set_any(self, up):
        await asyncio.sleep(0)


class Link:
    def close(self):
        pass


@pytest.fixture
def joins(monkeypatch):
    """Joins held at `gate`; one looks whether it was abandoned (PairingAbandoned, as join_pair does) only once its
    prefix's `check` event is set (`check_all`: every join looks, every few ms). `entered[prefix]`: it is in."""
    held = SimpleNamespace(gate=threading.Event(), check_all=False, entered=defaultdict(threading.Event),
                           check=defaultdict(threading.Event), threads={})

    def join_pair(rank, store, prefix, device, timeout_s, op_timeout_s, abandoned, host):
        held.threads[prefix] = threading.current_thread()
        held.entered[prefix].set()
        while not held.gate.wait(0.005):
            if (held.check_all or held.check[prefix].is_set()) and abandoned():
                raise rendezvous.PairingAbandoned("given up")
        return f"group {prefix}"

    monkeypatch.setattr(rendezvous, "open_store", lambda *a: "store")
    monkeypatch.setattr(rendezvous, "store_address", lambda init: ("127.0.0.1", 1))
    monkeypatch.setattr(rendezvous, "pairing_prefix", lambda instance, epoch: str(epoch))
    monkeypatch.setattr(rendezvous, "join_pair", join_pair)
    monkeypatch.setattr(rendezvous, "leave_pair", lambda group: None)
    yield held
    held.gate.set()  # a test that failed midway: its joins end too


def place(gpu, cap: int, health: Health, warmup=lambda n, link: None):
    """A gloo pairing of --max-pending-pairings `cap` whose links close; `settled` gets (instance, epoch) each time a
    pairing ends without its pair up (PrefillPairing._settle)."""
    p = pairing(gpu)
    p.config.max_pending_pairings, p.health = cap, health
    p.connect = lambda address="", group=None: Link()
    p.worker.warmup = warmup
    settled, settle = asyncio.Queue(), p._settle

    async def spy(pair, epoch):
        await settle(pair, epoch)
        settled.put_nowait((pair.instance, epoch))
    p._settle = spy
    return p, settled


async def entered(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, GUARD_S)


async def drained(p, joins) -> None:
    """Every join let go and ended, and what each left for the device thread and the loop done (nothing calls into
    the loop once the scenario has returned)."""
    joins.gate.set()
    for t in list(joins.threads.values()):
        await asyncio.to_thread(t.join, GUARD_S)
    try:
        await asyncio.get_running_loop().run_in_executor(p.gpu, lambda: None)
    except RuntimeError:  # the device thread was shut down
        pass
    for _ in range(int(GUARD_S / 0.01)):
        if not p.pending():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("pairings still pending")


def test_a_superseded_join_giving_way_leaves_the_newer_pairing_pending(joins):
    """A decode worker handshakes again while its join is held: the old join gives way and settles its epoch, which
    must not end the newer pairing (kills Pair.settle ignoring the epoch, and _settle setting the event itself): its
    place stays taken (cap 1: another worker is refused) and a request for it still waits for the new join."""
    joins.check_all = True
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            p, settled = place(gpu, 1, Health(11, 12))
            await handshake(p, 11)
            await entered(joins.entered["1"])
            await handshake(p, 11)  # epoch 2: pending, so no place needed
            assert await asyncio.wait_for(settled.get(), SOON_S) == (11, 1)  # the old join gave way
            assert p.pending() == 1 and p.pairs[11].epoch == 2
            with pytest.raises(Refused):
                await handshake(p, 12)
            request = asyncio.ensure_future(p.request(11, "request"))
            await asyncio.sleep(0)
            assert not request.done()  # waits for epoch 2
            joins.gate.set()
            link, args = await asyncio.wait_for(request, GUARD_S)
            assert isinstance(link, Link) and args == ("request",) and p.pairs[11].up and not p.pending()
            await drained(p, joins)
        asyncio.run(scenario())


def test_a_join_that_returns_after_its_decode_worker_left_frees_its_place(joins):
    """torch's join returned, but the decode worker's liveness watch had closed meanwhile: the group is left and the
    place freed (kills _joined's abandoned branch not settling: the place stayed taken, and since the cap is checked
    before any gone pair is forgotten, a full cap of them refused every new decode worker for good)."""
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            health = Health(11, 12)
            p, settled = place(gpu, 1, health)
            await handshake(p, 11)
            await entered(joins.entered["1"])
            health.watching.discard(11)  # decode worker 11 is gone
            joins.gate.set()  # ...and its join returns a group anyway
            assert await asyncio.wait_for(settled.get(), SOON_S) == (11, 1)
            assert p.pending() == 0 and not p.pairs[11].up
            await handshake(p, 12)  # the place is free
            await drained(p, joins)
        asyncio.run(scenario())


def test_a_warm_up_that_fails_after_the_join_frees_the_place_and_fails_the_waiting_request(joins):
    """The group joined, its warm-up raised: the pairing ends at once (kills _joined's failure branch not settling):
    the request waiting for it fails now rather than after --dist-timeout-s, and the place is free."""
    def warmup(n, link):
        raise RuntimeError("warm-up failed")
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            p, settled = place(gpu, 1, Health(11, 12), warmup)
            await handshake(p, 11)
            await entered(joins.entered["1"])
            request = asyncio.ensure_future(p.request(11, "request"))
            joins.gate.set()
            with pytest.raises(TransferError, match="no data plane paired here"):
                await asyncio.wait_for(request, SOON_S)
            assert await asyncio.wait_for(settled.get(), SOON_S) == (11, 1)
            assert p.pending() == 0
            await handshake(p, 12)
            await drained(p, joins)
        asyncio.run(scenario())


def test_a_gone_pair_forgotten_by_a_later_handshake_gives_its_join_and_place_up(joins):
    """Decode worker 11 leaves while its join waits, and worker 12's handshake forgets 11's pair before 11's join
    looked: the entry is dropped (kills `del self.pairs[...]` removed), so the join, looking next, sees its pair is
    gone and gives way (with the entry kept, forget() had cleared `left`: the join waited --dist-timeout-s, holding
    a place)."""
    with ThreadPoolExecutor(1) as gpu:
        async def scenario():
            health = Health(11, 12)
            p, settled = place(gpu, 2, health)
            await handshake(p, 11)
            await entered(joins.entered["1"])
            health.watching.discard(11)
            await handshake(p, 12)
            await asyncio.get_running_loop().run_in_executor(gpu, lambda: None)  # 12's _rejoin (and _forget) ran
            assert 11 not in p.pairs
            joins.check["1"].set()  # 11's join looks now
            assert await asyncio.wait_for(settled.get(), SOON_S) == (11, 1)
            assert p.pending() == 1  # 12's alone
            await drained(p, joins)
        asyncio.run(scenario())


def test_at_the_stop_a_pairing_whose_device_work_is_cut_off_settles(joins):
    """The stop shuts the device thread down (cancel_futures): a join that returns then (gpu.submit refused) and a
    warm-up still queued (cancelled) each settle their pairing, so a request waiting for it ends now rather than
    after --dist-timeout-s (kills the settle on submit's RuntimeError removed, and _on_failure not settling a
    cancelled job)."""
    async def shut_down_before_the_join_returns():
        gpu = ThreadPoolExecutor(1)
        p, settled = place(gpu, 1, Health(11))
        await handshake(p, 11)
        await entered(joins.entered["1"])
        gpu.shutdown(wait=True)
        joins.gate.set()
        assert await asyncio.wait_for(settled.get(), SOON_S) == (11, 1)
        assert p.pending() == 0
        await drained(p, joins)

    async def shut_down_with_the_warm_up_queued():
        gpu, busy = ThreadPoolExecutor(1), threading.Event()
        p, settled = place(gpu, 1, Health(11))
        await handshake(p, 11)
        await entered(joins.entered["1"])
        request = asyncio.ensure_future(p.request(11, "request"))
        gpu.submit(busy.wait, GUARD_S)  # the device thread busy: _joined will queue behind it
        joins.gate.set()
        await asyncio.to_thread(joins.threads["1"].join, GUARD_S)  # it submitted _joined and ended
        gpu.shutdown(wait=False, cancel_futures=True)
        busy.set()
        assert await asyncio.wait_for(settled.get(), SOON_S) == (11, 1)
        with pytest.raises(RuntimeError, match="shutdown"):  # the device thread is gone: the request ends at once
            await asyncio.wait_for(request, SOON_S)
        await drained(p, joins)

    asyncio.run(shut_down_before_the_join_returns())
    for held in (joins.gate, joins.entered, joins.threads):
        held.clear()
    asyncio.run(shut_down_with_the_warm_up_queued())



# --- the front's slow-client guards (api_server/slow_clients.py) ---


@contextmanager
def guarded_server(header_timeout_s: float, keep_alive_s: float = 30.0):
    """uvicorn with the front's protocol (guarded_h11) in a thread of its own, around an app that reads the body and
    answers 404; yields (host, port). Why not the real front: its start takes seconds; the protocol is the same."""
    import uvicorn

    from api_server.slow_clients import guarded_h11

    async def app(scope, receive, send):
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", http=guarded_h11(header_timeout_s), timeout_keep_alive=keep_alive_s,
                            log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        for _ in range(int(GUARD_S / 0.01)):
            if server.started:
                break
            assert thread.is_alive(), "uvicorn did not start"
            threading.Event().wait(0.01)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(GUARD_S)
        sock.close()


def _openai_error(resp: http.client.HTTPResponse, status: int, code: str) -> dict:
    """The response as an HTTP client reads it, by its Content-Length: OpenAI's error body, whole."""
    assert resp.status == status and resp.getheader("content-type") == "application/json", resp.status
    err = json.loads(resp.read())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def test_the_guard_s_answers_are_whole_by_their_content_length():
    """A client reads a response by its Content-Length, not to the connection's end (kills a Content-Length one
    byte short in _raw_error: the raw-socket tests read to EOF and passed; http.client got truncated JSON)."""
    with guarded_server(0.3) as addr:
        with socket.create_connection(addr, timeout=GUARD_S) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            assert "HTTP/1.1" in _openai_error(resp, 400, "invalid_request")["message"]
        with socket.create_connection(addr, timeout=GUARD_S) as sock:  # sends nothing
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            assert "--header-timeout-s" in _openai_error(resp, 408, "request_timeout")["message"]


def test_the_header_deadline_runs_from_the_end_of_the_last_response():
    """On a kept-alive connection the next request's headers are due --header-timeout-s after the last response
    ended, as the flag says, whether or not a byte of them came (kills on_response_complete not arming it: the
    deadline then began only at the next request's first byte, and an idle connection lasted until uvicorn's
    keep-alive closed it without a word)."""
    with guarded_server(0.3, keep_alive_s=5.0) as addr:
        with socket.create_connection(addr, timeout=GUARD_S) as sock:
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            first = http.client.HTTPResponse(sock)
            first.begin()
            assert first.status == 404 and first.read() == b"{}"
            second = http.client.HTTPResponse(sock)  # nothing more is sent
            second.begin()
            assert "line and headers" in _openai_error(second, 408, "request_timeout")["message"]


def _client(*paced: tuple[float, dict]):
    """A client's ASGI messages, each (after_s, message): sent `after_s` after the app asked (the client's pace, not
    a synchronization: a deadline's timer and a message's are ordered by when they are due)."""
    left = list(paced)

    async def receive():
        after_s, message = left.pop(0)
        await asyncio.sleep(after_s)
        return message
    return receive


async def _read_body(app_receive, got: list) -> None:
    while True:
        got.append(await app_receive())
        if not got[-1].get("more_body", False):
            return


def test_a_body_trickled_in_pieces_is_cut_off_at_the_whole_body_s_deadline():
    """--body-timeout-s bounds the whole body, not each read (kills a per-read timeout: a client sending a byte
    just sooner than the timeout, again and again, held the connection for ever; and kills the body counted whole
    after its first piece)."""
    from api_server.slow_clients import BodyDeadline, BodyTimedOut
    got = []

    async def app(scope, receive, send):
        await _read_body(receive, got)

    piece = {"type": "http.request", "body": b"x", "more_body": True}
    receive = _client(*[(0.1, piece)] * 5, (0.1, {"type": "http.request", "body": b"", "more_body": False}))
    with pytest.raises(BodyTimedOut) as cut:
        asyncio.run(BodyDeadline(app, 0.25)({"type": "http"}, receive, None))
    assert cut.value.status_code == 408 and "--body-timeout-s" in cut.value.detail and len(got) < 6


def test_a_read_after_the_whole_body_is_not_timed():
    """Once the body is in, the app's next read (a disconnect watch while a long answer streams) waits as long as
    it takes (kills every read timed: a stream longer than --body-timeout-s was cut with a 408)."""
    from api_server.slow_clients import BodyDeadline
    got = []

    async def app(scope, receive, send):
        await _read_body(receive, got)
        got.append(await receive())

    receive = _client((0, {"type": "http.request", "body": b"{}", "more_body": False}),
                      (0.3, {"type": "http.disconnect"}))  # the client hangs up after the deadline
    asyncio.run(BodyDeadline(app, 0.2)({"type": "http"}, receive, None))
    assert [m["type"] for m in got] == ["http.request", "http.disconnect"]


# --- the 413 (api_server/limits.py) ---


def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413():
    """--max-body-bytes is the most a body may hold, with a Content-Length or without (kills `>=` for `>`)."""
    from api_server.limits import BodyLimit, BodyTooLarge

    def exchange(body: bytes, pieces: int, length: bool):
        """(status, body the app read) for `body` sent in `pieces` messages, with a Content-Length or chunked."""
        read, sent = [], []

        async def app(scope, receive, send):
            while True:
                m = await receive()
                read.append(m.get("body", b""))
                if not m.get("more_body", False):
                    break
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        step = -(-len(body) // pieces)
        messages = [{"type": "http.request", "body": body[i:i + step], "more_body": i + step < len(body)}
                    for i in range(0, len(body), step)]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)
        headers = [(b"content-length", str(len(body)).encode())] if length else []
        asyncio.run(BodyLimit(app, 10)({"type": "http", "headers": headers}, receive, send))
        return sent[0]["status"], b"".join(read)

    assert exchange(b"x" * 10, 1, True) == (200, b"x" * 10)
    assert exchange(b"x" * 10, 2, False) == (200, b"x" * 10)
    assert exchange(b"x" * 11, 1, True)[0] == 413
    with pytest.raises(BodyTooLarge):
        exchange(b"x" * 11, 2, False)


# --- --colocated's unused peer flags (decode_server/config.py) ---


def test_every_peer_flag_beside_colocated_is_named(tmp_path):
    """Each flag that only configures the prefill peer, given beside --colocated, is named in the start warning
    (kills any one dropped from the list: only three of seventeen were checked; now twenty-one)."""
    from decode_server.config import DecodeConfig
    from kvtransfer.rpc.configargs import flag_name
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    for given in ({"prefill_addr": "10.0.0.2:50061"}, {"transport": "grpc"}, {"data_listen": "127.0.0.1:5000"},
                  {"dist_init": "tcp://127.0.0.1:29500"}, {"transport": "cuda_ipc", "ipc_slots": 3},
                  {"on_failure": "recompute"}, {"peer_timeout_s": 5.0}, {"peer_keepalive_s": 1.0},
                  {"handshake_timeout_s": 5.0}, {"dist_timeout_s": 5.0}, {"dist_op_timeout_s": 5.0},
                  {"local_suffix_max_tokens": 0},
                  {"prefill_tls_ca": str(pem), "prefill_tls_cert": str(pem), "prefill_tls_key": str(pem)},
                  {"prefill_auth_token": "token"}, {"prefill_auth_token_file": str(pem)},
                  {"transport": "grpc", "grpc_listener_workers": 8},
                  {"transport": "grpc", "data_tls_cert": str(pem), "data_tls_key": str(pem), "data_tls_ca": str(pem)}):
        named = DecodeConfig(colocated=True, **given).unused_when_colocated()
        assert sorted(named) == sorted(flag_name(f) for f in given), (given, named)
