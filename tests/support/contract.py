"""The transport contract: scenarios every backend must pass unchanged.

Each scenario has a send half (runs against a SenderLink) and a receive half (runs against
a ReceiverLink and asserts). Harnesses (tests/support/harness.py) build both links through the
registry, with non-default options, and run the halves in two threads (in-process backends)
or two real processes (gloo, gRPC). Every layer's contents are checked, through
`wait_for_layer` as it lands (the sender paces its layers, so a receiver that hands out a
layer before it arrived shows stale bytes), and in a destination provider's pool (views of
a bigger tensor: every byte outside them must stay untouched). A header no receiver may accept
(zero-size, over the receive limit, too many layers) is put on the wire as it is: the receive side's
one validator (frames.py) must refuse it whatever the backend, not only where a test builds raw frames.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvtransfer.transport import TransferError, TransferHeader, TransferState
from kvtransfer.transport.frames import MAX_LAYERS

DIE = None  # set by a harness: how a receive half dies (two processes: exit hard; in-process: close the link)
PACE_S = 0.05  # between paced layers

LAYERS, HEADS, DIM = 4, 2, 8


def header(request_id: int, seq_len: int, dtype=torch.float32) -> TransferHeader:
    return TransferHeader(request_id=request_id, seq_len=seq_len, num_layers=LAYERS, kv_heads=HEADS,
                          head_dim=DIM, dtype=dtype)


def layers_for(h: TransferHeader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic per request: both processes can build the expected cache. K/V adjacent like prefill's."""
    g = torch.Generator().manual_seed(h.request_id * 7919 + h.seq_len)
    block = torch.randn((h.num_layers, 2, *h.layer_shape()), generator=g).to(h.dtype)
    return [(block[i, 0], block[i, 1]) for i in range(h.num_layers)]


def send_all(link, h: TransferHeader, device, pace: float = 0.0) -> None:
    s = link.open(h)
    assert s.status() == TransferState.WAITING
    for i, (k, v) in enumerate(layers_for(h)):
        if pace and i:
            time.sleep(pace)
        s.send_layer(i, k.to(device), v.to(device))
        assert s.status() == TransferState.TRANSFERRING
    s.finish(timeout=30)
    assert s.status() == TransferState.SUCCESS


def recv_check(link, h: TransferHeader, timeout: float = 30) -> None:
    check_received(link.accept(timeout=timeout), h, timeout)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(
        got.cpu().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def check_layer(r, h: TransferHeader, i: int, timeout: float = 30):
    """wait_for_layer(i) returns layer i's bytes, right away (before later layers are in)."""
    k, v = r.wait_for_layer(i, timeout=timeout)
    wk, wv = layers_for(h)[i]
    assert same(k, wk) and same(v, wv), f"request {h.request_id}: layer {i} from wait_for_layer differs"
    return k, v


def check_received(r, h: TransferHeader, timeout: float = 30, every_layer: bool = False) -> list:
    """The header, every layer through wait_for_layer (all of them, or 0 only), then finish: the same tensors."""
    assert r.header == h, (r.header, h)
    assert r.status() == TransferState.TRANSFERRING
    seen = [check_layer(r, h, i, timeout) for i in (range(h.num_layers) if every_layer else [0])]
    got = r.finish(timeout=timeout)
    assert r.status() == TransferState.SUCCESS
    want = layers_for(h)
    assert len(got) == len(want)
    for i, ((gk, gv), (wk, wv)) in enumerate(zip(got, want)):
        assert same(gk, wk) and same(gv, wv), f"request {h.request_id}: layer {i} differs"
    for (k, v), (gk, gv) in zip(seen, got):
        assert k is gk and v is gv, "finish returns the tensors wait_for_layer returned"
    return got


def expect_error(fn, cause: str) -> TransferError:
    try:
        fn()
    except TransferError as e:
        assert e.cause == cause, f"cause {e.cause!r}, expected {cause!r}: {e}"
        return e.with_traceback(None)  # no frame cycle keeping received buffers (and their slots) alive
    raise AssertionError(f"no TransferError({cause}) raised")


# --- scenarios: name -> (send half, receive half); halves take (link, device) ---

def s_roundtrip(link, dev):
    """One request, then the calls a finished sender refuses or ignores (kvtransfer/transport/sender.py)."""
    h = header(1, 5)
    layers = [(k.to(dev), v.to(dev)) for k, v in layers_for(h)]
    s = link.open(h)
    assert s.status() == TransferState.WAITING
    for i, (k, v) in enumerate(layers):
        s.send_layer(i, k, v)
        assert s.status() == TransferState.TRANSFERRING
    expect_error(lambda: s.send_layer(LAYERS, *layers[0]), "protocol")  # past the header's layers: refused
    s.finish(timeout=30)
    s.finish(timeout=30)  # again: done already
    s.abort("too late")  # after success: nothing
    assert s.status() == TransferState.SUCCESS
    expect_error(lambda: s.send_layer(0, *layers[0]), "protocol")


def r_roundtrip(link, dev):
    recv_check(link, header(1, 5))


def s_many(link, dev):
    for rid, n in enumerate([3, 17, 1, 64, 9, 33, 2, 40]):
        send_all(link, header(100 + rid, n, torch.bfloat16 if rid % 2 else torch.float32), dev)


def r_many(link, dev):
    for rid, n in enumerate([3, 17, 1, 64, 9, 33, 2, 40]):
        recv_check(link, header(100 + rid, n, torch.bfloat16 if rid % 2 else torch.float32))


def s_abort_then_ok(link, dev):
    h = header(2, 6)
    s = link.open(h)
    for i, (k, v) in enumerate(layers_for(h)[:2]):
        s.send_layer(i, k.to(dev), v.to(dev))
    s.abort("prefill failed")
    assert s.status() == TransferState.FAILED
    k, v = layers_for(h)[2]
    expect_error(lambda: s.send_layer(2, k.to(dev), v.to(dev)), "protocol")  # after abort: refused, nothing sent
    expect_error(lambda: s.finish(timeout=5), "aborted")
    s.abort("again")  # once only: a second abort sends nothing
    assert s.status() == TransferState.FAILED
    send_all(link, header(3, 7), dev)


def expect_aborted(r) -> None:
    expect_error(lambda: r.finish(timeout=30), "aborted")
    assert r.status() == TransferState.FAILED


def recv_by_id(link, checks: dict) -> None:
    """Accept len(checks) requests in whatever order they arrive and check each by its id.

    Requests are matched by the id in their header, never by position: an ordered stream
    (nccl, gloo, cuda_ipc) delivers them in send order, gRPC's independent streams may not.
    """
    while checks:
        r = link.accept(timeout=30)
        assert r.header.request_id in checks, f"unexpected request {r.header.request_id}"
        checks.pop(r.header.request_id)(r)


def r_abort_then_ok(link, dev):
    recv_by_id(link, {2: expect_aborted, 3: lambda r: check_received(r, header(3, 7))})


def s_misuse(link, dev):
    """Out-of-order layer, wrong shape, wrong dtype, early finish: refused on the sender; link stays usable."""
    h = header(4, 6)
    good = layers_for(h)
    s = link.open(h)
    expect_error(lambda: s.send_layer(1, good[1][0].to(dev), good[1][1].to(dev)), "protocol")
    bad = torch.zeros(1, HEADS, 5, DIM, device=dev)
    expect_error(lambda: s.send_layer(0, bad, bad), "protocol")
    expect_error(lambda: s.send_layer(0, good[0][0].to(dev).double(), good[0][1].to(dev).double()), "protocol")
    s.send_layer(0, good[0][0].to(dev), good[0][1].to(dev))
    expect_error(lambda: s.send_layer(0, good[0][0].to(dev), good[0][1].to(dev)), "protocol")  # duplicate
    expect_error(lambda: s.finish(timeout=5), "protocol")  # layers missing
    s.abort("misuse")
    send_all(link, header(5, 4), dev)


def r_misuse(link, dev):
    recv_by_id(link, {4: expect_aborted, 5: lambda r: check_received(r, header(5, 4))})


def s_silent_peer(link, dev):
    """Sends the header and one layer, then goes silent (a peer that died)."""
    h = header(6, 4)
    s = link.open(h)
    k, v = layers_for(h)[0]
    s.send_layer(0, k.to(dev), v.to(dev))
    time.sleep(3.0)


def r_silent_peer(link, dev):
    r = link.accept(timeout=30)
    t0 = time.monotonic()
    expect_error(lambda: r.finish(timeout=1.0), "timeout")
    took = time.monotonic() - t0
    assert took < 2.5, f"timeout took {took:.2f} s"
    assert r.status() == TransferState.FAILED


def s_every_layer(link, dev):
    """Layers paced PACE_S apart: a receiver must hand out layer i only once layer i is in."""
    for rid in (7, 8):
        send_all(link, header(rid, 9), dev, pace=PACE_S)


def r_every_layer(link, dev):
    for rid in (7, 8):
        check_received(link.accept(timeout=30), header(rid, 9), every_layer=True)


class Pool:
    """A provider over a KV pool laid out per layer and K/V as (slots, kv_heads, max_seq, head_dim): request
    i gets slot i % slots, positions [3, 3 + seq): non-contiguous views. Everything else must stay SENTINEL."""
    SENTINEL = -7.25

    def __init__(self, dev, dtype=torch.float32, slots: int = 3, max_seq: int = 80):
        self.pool = torch.full((LAYERS, 2, slots, HEADS, max_seq, DIM), self.SENTINEL, dtype=dtype, device=dev)
        self.slots, self.handed = slots, {}

    def __call__(self, h: TransferHeader):
        slot = h.request_id % self.slots
        views = [(self.pool[i, 0, slot:slot + 1, :, 3:3 + h.seq_len], self.pool[i, 1, slot:slot + 1, :, 3:3 + h.seq_len])
                 for i in range(h.num_layers)]
        self.handed[h.request_id] = views
        return views

    def check(self, h: TransferHeader, got) -> None:
        views = self.handed[h.request_id]
        for (k, v), (vk, vv) in zip(got, views):
            assert k is vk and v is vv, "the receiver returns the provider's tensors themselves"
        slot = h.request_id % self.slots
        outside = torch.ones(self.pool.shape, dtype=torch.bool, device=self.pool.device)
        outside[:, :, slot, :, 3:3 + h.seq_len] = False
        assert bool((self.pool[outside] == self.SENTINEL).all()), "bytes outside the destination views changed"
        self.pool[:, :, slot].fill_(self.SENTINEL)  # the next request in this slot starts clean


def s_pool(link, dev):
    for rid, n in ((10, 5), (11, 64), (12, 1)):
        send_all(link, header(rid, n), dev, pace=PACE_S if rid == 10 else 0.0)


def r_pool(link, dev):
    pool = Pool(dev)
    for rid, n in ((10, 5), (11, 64), (12, 1)):
        h = header(rid, n)
        r = link.accept(timeout=30, destinations=pool)
        pool.check(h, check_received(r, h, every_layer=rid == 10))


def s_provider_fails(link, dev):
    """The receiver's provider refuses request 13: its receiver fails, the link carries request 14."""
    h = header(13, 6)
    s = link.open(h)
    try:
        for i, (k, v) in enumerate(layers_for(h)):
            s.send_layer(i, k.to(dev), v.to(dev))
        s.finish(timeout=30)
    except TransferError:
        pass  # backends with a back channel tell the sender; the others drain the frame
    send_all(link, header(14, 3), dev)


def r_provider_fails(link, dev):
    def refuse(h):
        raise TransferError("protocol", f"no room for request {h.request_id}")
    r = link.accept(timeout=30, destinations=refuse)
    assert r.header.request_id == 13
    expect_error(lambda: r.finish(timeout=30), "protocol")
    assert r.status() == TransferState.FAILED
    recv_check(link, header(14, 3))


def s_receiver_abort(link, dev):
    """The receiver aborts after layer 0. With a back channel, the sender hears of it by itself, mid-frame (its
    status turns FAILED before it sends layer 1), so prefill can stop early: every later call fails `aborted`. No
    time bound (a busy machine delays the abort, it does not lose it): the sender waits for it, up to a deadline.
    Without one, the rest of the frame is sent and drained."""
    h = header(15, 8)
    s = link.open(h)
    layers = layers_for(h)
    s.send_layer(0, layers[0][0].to(dev), layers[0][1].to(dev))
    if type(link).abort_reaches_sender:
        deadline = time.monotonic() + 30
        while s.status() != TransferState.FAILED:
            assert time.monotonic() < deadline, "the receiver's abort did not reach the sender within 30 s"
            time.sleep(0.01)
        expect_error(lambda: s.send_layer(1, layers[1][0].to(dev), layers[1][1].to(dev)), "aborted")
        expect_error(lambda: s.finish(timeout=5), "aborted")  # the first failure, whatever is called next
        s.abort("after the failure")  # nothing more goes out
        assert s.status() == TransferState.FAILED
    else:
        try:
            for i in range(1, LAYERS):
                time.sleep(0.4)  # the receiver aborts mid-frame; the rest of it is drained
                s.send_layer(i, layers[i][0].to(dev), layers[i][1].to(dev))
            s.finish(timeout=30)
        except TransferError:
            pass
    send_all(link, header(16, 4), dev)


def r_receiver_abort(link, dev):
    r = link.accept(timeout=30)
    check_layer(r, header(15, 8), 0)
    r.abort("the request gave up")
    assert r.status() == TransferState.FAILED
    expect_error(lambda: r.finish(timeout=5), "aborted")
    recv_check(link, header(16, 4))


def s_dead_receiver(link, dev):
    """The receiving side dies mid-frame: the sender fails (peer, aborted or timeout) within a few seconds."""
    h = header(17, 8)
    s = link.open(h)
    t0 = time.monotonic()
    try:
        for i, (k, v) in enumerate(layers_for(h)):
            s.send_layer(i, k.to(dev), v.to(dev))
            time.sleep(0.3)
        s.finish(timeout=5)
    except TransferError as e:
        assert e.cause in ("peer", "aborted", "timeout"), e
        assert time.monotonic() - t0 < 8, f"the dead receiver was noticed after {time.monotonic() - t0:.1f} s"
        return
    raise AssertionError("a transfer to a dead receiver succeeded")


def r_dead_receiver(link, dev):
    r = link.accept(timeout=30)
    check_layer(r, header(17, 8), 0)
    DIE(link)


# --- insane headers: whatever the backend, the receiver refuses them at `accept` with its one validator ---

INSANE = {  # scenario -> (a header no receiver may accept, what its refusal says)
    "insane_zero_size": (header(20, 0), "must be >= 1"),
    "insane_huge_seq": (header(20, 2**32 - 1), "exceeds the receive limit"),  # the largest seq_len every wire carries
    "insane_layer_count": (dataclasses.replace(header(20, 3), num_layers=MAX_LAYERS + 1), "layers exceed"),
}
SENT, REFUSED_AT_OPEN = 21, 22  # the next request's id: whether the insane header left the sender
_LEFT_OPEN: list = []  # the insane frame's sender on a link that does not survive it: kept until the process ends


def insane_header(name: str):
    """An insane header (one of INSANE) is refused at `accept` with cause `protocol`, holding no memory.

    The sender puts it on the wire unchanged, then, where the link survives a failed request, sends
    request SENT, which must arrive whole. A sender may refuse
    it at `open` before anything leaves (cuda_ipc: a request must fit the receiver's slot); it then sends
    request REFUSED_AT_OPEN instead, so the receive half knows there is no frame to refuse.
    """
    bad, words = INSANE[name]

    def send(link, dev):
        try:
            s = link.open(bad)
        except TransferError as e:
            assert e.cause == "protocol", f"the sender refused {bad} with {e}"
            send_all(link, header(REFUSED_AT_OPEN, 3), dev)
            return
        if type(link).survives_failed_request:
            s.abort("an insane header, sent on purpose")
            send_all(link, header(SENT, 3), dev)
        else:  # the stream is out of step after a refused header: nothing more on this link
            _LEFT_OPEN.append(s)

    def recv(link, dev):
        survives, refused, sent = type(link).survives_failed_request, None, False
        while True:  # in arrival order: gRPC's streams may deliver request SENT before the refusal
            try:
                r = link.accept(timeout=30)
            except TransferError as e:
                assert refused is None, f"one insane header, two refusals: {refused}; {e}"
                assert e.cause == "protocol" and words in str(e), f"{name}: {e!r}; expected protocol, {words!r}"
                refused = e.with_traceback(None)
                if not survives:
                    return
                if sent:  # request SENT came first: both are in
                    assert link.inflight() == 0, "the refused request holds receive memory"
                    return
                continue
            rid = r.header.request_id
            assert rid in (SENT, REFUSED_AT_OPEN), f"{name}: the receiver accepted {r.header}"
            assert not sent, f"{name}: request {rid} accepted twice"
            check_received(r, header(rid, 3))
            if rid == REFUSED_AT_OPEN:
                assert refused is None, f"the sender refused {name} at open, yet a frame was refused: {refused}"
                return
            sent = True
            if refused is not None:
                assert link.inflight() == 0, "the refused request holds receive memory"
                return

    return send, recv


SCENARIOS = {
    "roundtrip": (s_roundtrip, r_roundtrip),
    "many": (s_many, r_many),
    "every_layer": (s_every_layer, r_every_layer),
    "pool": (s_pool, r_pool),
    "provider_fails": (s_provider_fails, r_provider_fails),
    "abort_then_ok": (s_abort_then_ok, r_abort_then_ok),
    "receiver_abort": (s_receiver_abort, r_receiver_abort),
    "misuse": (s_misuse, r_misuse),
    "silent_peer": (s_silent_peer, r_silent_peer),
    "dead_receiver": (s_dead_receiver, r_dead_receiver),
    **{name: insane_header(name) for name in INSANE},
}


