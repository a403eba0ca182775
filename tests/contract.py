"""The transport contract: scenarios every backend must pass unchanged.

Each scenario has a send half (runs against a SenderLink) and a receive half (runs against
a ReceiverLink and asserts). Harnesses in test_transport_contract.py run the halves in two
threads (in-process backends) or two real processes (gloo, gRPC, ...).
"""

from __future__ import annotations

import time

import torch

from kvtransfer.transport import TransferError, TransferHeader, TransferState

LAYERS, HEADS, DIM = 4, 2, 8


def header(request_id: int, seq_len: int, dtype=torch.float32) -> TransferHeader:
    return TransferHeader(request_id=request_id, seq_len=seq_len, num_layers=LAYERS, kv_heads=HEADS,
                          head_dim=DIM, dtype=dtype)


def layers_for(h: TransferHeader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic per request: both processes can build the expected cache. K/V adjacent like prefill's."""
    g = torch.Generator().manual_seed(h.request_id * 7919 + h.seq_len)
    block = torch.randn((h.num_layers, 2, *h.layer_shape()), generator=g).to(h.dtype)
    return [(block[i, 0], block[i, 1]) for i in range(h.num_layers)]


def send_all(link, h: TransferHeader, device) -> None:
    s = link.open(h)
    for i, (k, v) in enumerate(layers_for(h)):
        s.send_layer(i, k.to(device), v.to(device))
    s.finish(timeout=30)
    assert s.status() == TransferState.SUCCESS


def recv_check(link, h: TransferHeader, timeout: float = 30) -> None:
    check_received(link.accept(timeout=timeout), h, timeout)


def check_received(r, h: TransferHeader, timeout: float = 30) -> None:
    assert r.header.request_id == h.request_id and r.header.seq_len == h.seq_len, r.header
    assert r.header.dtype == h.dtype
    k0, v0 = r.wait_for_layer(0, timeout=timeout)
    got = r.finish(timeout=timeout)
    assert r.status() == TransferState.SUCCESS
    want = layers_for(h)
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(gk.cpu().view(torch.uint8), wk.view(torch.uint8))
        assert torch.equal(gv.cpu().view(torch.uint8), wv.view(torch.uint8))
    assert torch.equal(k0.cpu(), want[0][0]) and torch.equal(v0.cpu(), want[0][1])


def expect_error(fn, cause: str) -> TransferError:
    try:
        fn()
    except TransferError as e:
        assert e.cause == cause, f"cause {e.cause!r}, expected {cause!r}: {e}"
        return e.with_traceback(None)  # no frame cycle keeping received buffers (and their slots) alive
    raise AssertionError(f"no TransferError({cause}) raised")


# --- scenarios: name -> (send half, receive half); halves take (link, device) ---

def s_roundtrip(link, dev):
    send_all(link, header(1, 5), dev)


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
    expect_error(lambda: s.finish(timeout=5), "protocol")
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


SCENARIOS = {
    "roundtrip": (s_roundtrip, r_roundtrip),
    "many": (s_many, r_many),
    "abort_then_ok": (s_abort_then_ok, r_abort_then_ok),
    "misuse": (s_misuse, r_misuse),
    "silent_peer": (s_silent_peer, r_silent_peer),
}


# --- process harness: one real process per side ---

def run_in_process(backend: str, rank: int, address: str, scenario: str, options: dict, q, done) -> None:
    """Child entry point: build this side's link for `backend`, run its half, report, then stay
    alive until the parent has both reports (a sender's data may still be in flight), exit hard."""
    import os
    import traceback
    try:
        dev = torch.device(options.get("device", "cpu"))
        send, recv = SCENARIOS[scenario]
        if backend == "gloo":
            from kvtransfer.transport.dist import ReceiverLink, SenderLink, init_pair
            init_pair(rank, address, dev, timeout_s=30)
            link = (SenderLink(dev, peer=1, layers_per_message=options.get("layers_per_message", 1))
                    if rank == 0 else ReceiverLink(dev, peer=0))
        elif backend == "grpc":  # the receiver listens on `address`; the sender connects to it
            from kvtransfer.transport.grpc_backend import Checksum, ReceiverLink, SenderLink
            hostport = address.removeprefix("tcp://")
            link = (SenderLink(hostport, channels=options.get("channels", 2),
                               chunk_bytes=options.get("chunk_bytes", 4 << 20),
                               checksum=Checksum[options.get("checksum", "XXH3_64")])
                    if rank == 0 else ReceiverLink(hostport, device=dev))
        else:
            raise ValueError(backend)
        (send if rank == 0 else recv)(link, dev)
        q.put((rank, None))
    except BaseException:  # report everything to the parent; the child exits below either way
        q.put((rank, traceback.format_exc()))
    finally:
        done.wait(timeout=60)
        os._exit(0)
