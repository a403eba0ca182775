"""cuda_ipc building blocks on CPU: message codec, control channel, slot pool, CUDA handle seam.

Why apart from test_cuda_ipc.py: these are unit tests of the pieces (no links, no threads
beyond a timer); the protocol end to end and the GPU runs are there.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvtransfer.transport import TransferError
from kvtransfer.transport.cuda_ipc import messages as msg
from kvtransfer.transport.cuda_ipc.channel import Channel, listen
from kvtransfer.transport.cuda_ipc.device import CudaOps
from kvtransfer.transport.cuda_ipc.pool import HeldSlots, SlotPool

SAMPLES = [
    msg.Hello(msg.MAGIC, msg.VERSION, msg.ROLE_SENDER, 4242, b"GPU-5c1e"),
    msg.Pool(3, 1 << 33, 28),
    msg.Slot(1, 1 << 30, 4096, 7, True, bytes(range(66)), b"/torch_1_2_3", bytes(64), b"\x01" * 64),
    msg.Events(2, bytes(range(256)) * 2),
    msg.Ready(),
    msg.Header(-5, 1, 32768, 28, 4, 128, 1, 2),
    msg.Landed(2**62, 27),
    msg.Trailer(9, msg.TRAILER_ABORTED, "prefill failed: ü".encode()),
    msg.Trailer(9, msg.TRAILER_OK, b""),
    msg.Release(11, 0, False),
]


def expect_error(fn, cause: str) -> TransferError:
    with pytest.raises(TransferError) as info:
        fn()
    assert info.value.cause == cause, info.value
    return info.value


# --- codec ---

@pytest.mark.parametrize("m", SAMPLES, ids=lambda m: type(m).__name__)
def test_codec_roundtrip(m):
    data = msg.encode(m)
    tag, n = msg.FRAME.unpack_from(data)
    assert (tag, n) == (m.TAG, len(data) - msg.FRAME.size)
    assert msg.decode(tag, data[msg.FRAME.size:]) == m


def test_codec_covers_every_message_and_fast_landed_matches():
    assert {type(m) for m in SAMPLES} == set(msg._BY_TAG.values())
    assert msg.encode_landed(123, 7) == msg.encode(msg.Landed(123, 7))
    assert len(msg.encode_landed(1, 2)) == 17


@pytest.mark.parametrize("payload", [b"", b"\x01\x00", msg.encode(msg.Landed(1, 2))[5:] + b"x"])
def test_codec_rejects_malformed(payload):
    expect_error(lambda: msg.decode(msg.Landed.TAG, payload), "protocol")


def test_codec_rejects_unknown_tag_and_overlong_blob():
    expect_error(lambda: msg.decode(200, b""), "protocol")
    good = msg.encode(msg.Trailer(1, 1, b"abc"))[5:]
    expect_error(lambda: msg.decode(msg.Trailer.TAG, good[:-1]), "protocol")  # blob runs past the payload


def test_cuda_handle_fields_keep_their_types(monkeypatch):
    """_share_cuda_() -> Slot -> wire -> _new_shared_cuda(): the same values and Python types
    (int, bytes, int, int, bytes, int, bytes, bool), device replaced by the local index."""
    shared = (3, b"\x02\x01" + bytes(64), 1 << 20, 4096, b"/torch_77_1234_0", 5, bytes(range(64)), True)

    class FakeStorage:
        def _share_cuda_(self):
            return shared

    seen = []
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", lambda *a: seen.append(a) or "storage",
                        raising=False)
    ops = object.__new__(CudaOps)  # no CUDA here: only the (de)serialisation seam is exercised
    m = msg.Slot(slot=0, release_event=bytes(64), **ops.share(FakeStorage()))
    wire = msg.encode(m)
    back = msg.decode(msg.Slot.TAG, wire[msg.FRAME.size:])
    assert ops.open(back, owner=1) == "storage"
    assert seen == [(1, *shared[1:])]
    assert [type(v) for v in seen[0]] == [int, bytes, int, int, bytes, int, bytes, bool]


# --- channel ---

def test_channel_reassembles_partial_frames_and_times_out():
    a, b = socket.socketpair()
    tx, rx = Channel(a), Channel(b)
    data = b"".join(msg.encode(m) for m in SAMPLES)
    for i in range(0, len(data), 7):  # dribble it in 7-byte pieces
        a.sendall(data[i:i + 7])
    assert [rx.recv(time.monotonic() + 5) for _ in SAMPLES] == SAMPLES
    t0 = time.monotonic()
    assert rx.recv(time.monotonic() + 0.2) is None
    assert 0.15 < time.monotonic() - t0 < 5  # at its deadline, not before; late only by a busy machine's delay
    tx.send(msg.Ready())
    assert rx.recv(None) == msg.Ready()
    tx.close()
    expect_error(lambda: rx.recv(time.monotonic() + 5), "peer")


def test_channel_refuses_oversized_frame():
    a, b = socket.socketpair()
    a.sendall(msg.FRAME.pack(msg.Events.TAG, msg.MAX_PAYLOAD + 1))
    expect_error(lambda: Channel(b).recv(time.monotonic() + 5), "protocol")


def test_addresses():
    sock, address = listen("tcp://127.0.0.1:0")
    assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
    sock.close()
    for bad in ("127.0.0.1:5", "tcp://nohost", "ipc:///x"):
        with pytest.raises(ValueError):
            listen(bad)


# --- pool bookkeeping ---

def test_pool_slot_needs_both_sides_done():
    pool = SlotPool(2)
    assert (pool.acquire(1, 0), pool.acquire(2, 0)) == (0, 1)
    expect_error(lambda: pool.acquire(3, 0.05), "timeout")
    pool.sender_done(0)                # sender finished request 1 ...
    expect_error(lambda: pool.acquire(3, 0), "timeout")  # ... but the receiver still holds its cache
    pool.released(1, 2, early=False)   # receiver let go of request 2 first ...
    expect_error(lambda: pool.acquire(3, 0), "timeout")  # ... but copies of request 2 may still be issued
    pool.released(0, 1, early=False)
    assert pool.acquire(3, 0) == 0     # slot 0 is free (both sides done), slot 1 is not ...
    expect_error(lambda: pool.acquire(4, 0), "timeout")
    pool.sender_done(1)
    assert pool.acquire(4, 0) == 1     # ... until its sender is done too


def test_pool_exhaustion_waits_for_a_release():
    pool = SlotPool(1)
    pool.acquire(1, 0)
    pool.sender_done(0)
    threading.Timer(0.2, pool.released, (0, 1, False)).start()
    t0 = time.monotonic()
    assert pool.acquire(2, 5) == 0
    assert 0.15 < time.monotonic() - t0 < 2
    t0 = time.monotonic()
    err = expect_error(lambda: pool.acquire(3, 0.3), "timeout")
    assert "exhausted" in str(err) and 0.25 < time.monotonic() - t0 < 2


def test_pool_early_release_marks_gave_up_and_abort_frees():
    pool = SlotPool(1)
    pool.acquire(7, 0)
    pool.released(0, 7, early=True)     # the receiver aborted mid-transfer
    assert pool.gave_up[0] == 7
    expect_error(lambda: pool.acquire(8, 0), "timeout")  # the sender's copies may still be issued
    pool.sender_done(0)                 # the sender aborts too: the slot comes back
    assert pool.acquire(8, 0) == 0 and pool.gave_up[0] is None


def test_pool_refuses_wrong_release_and_fails_waiters():
    pool = SlotPool(1)
    pool.acquire(1, 0)
    expect_error(lambda: pool.released(0, 99, early=False), "protocol")
    expect_error(lambda: pool.released(5, 1, early=False), "protocol")
    threading.Timer(0.1, pool.fail, (TransferError("peer", "gone"),)).start()
    expect_error(lambda: pool.acquire(2, 5), "peer")


def test_held_slots():
    held = HeldSlots(2)
    held.hold(0, 1)
    expect_error(lambda: held.hold(0, 2), "protocol")
    expect_error(lambda: held.hold(2, 3), "protocol")
    assert held.free(0, 1) and not held.free(0, 1) and held.held() == {}
