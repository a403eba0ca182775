"""Cases a mutation pass over the KV transfer path found untested: kvtransfer/transport/ (the sender's checks, the
frame spec, where layers land, the gloo and gRPC links), decode_server/peer/ (the receive loop, the data plane),
decode_server/landing.py (a frame into the paged pool) and prefill_server/worker.py (the sending side). Each test
here failed on a one-line change of that code that the contract suite (tests/support/contract.py) and the gRPC,
registry, pool, fault and server tests let through; its docstring names the change it kills.

Why in process: every case is one frame's header, destination, bytes or ending, held where the test wants it (raw
gRPC streams, both ranks of one gloo group in this process, a fake link, a spy link), so the file runs in seconds
on 2 cores, the same way every time; the two-process runs of the contract suite reach these paths only through the
scenarios written for it. Waits are on conditions, bounded by GUARD_S; the only short timeouts are the ones under
test (finish(timeout=0.5) must fail as a timeout, however slow the machine).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
import torch.distributed as dist

from decode_server.config import DecodeConfig
from decode_server.landing import pool_destination
from decode_server.peer.dataplane import DataPlane
from decode_server.peer.receiver import ReceiveLoop
from decode_server.peer.remote import PeerFailure
from kvtransfer.engine.pool import KVPool
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.spec import ModelSpec
from kvtransfer.transport import TransferError, TransferState, fake, registry
from kvtransfer.transport.dist import backend as gloo
from kvtransfer.transport.frames import check_header, header_fields
from kvtransfer.transport.grpc import frames as wire
from kvtransfer.transport.layout import byte_view
from kvtransfer.transport.options import Checksum
from kvtransfer.transport.rendezvous import gloo_options
from prefill_server.worker import PrefillWorker
from support import contract

GUARD_S = 60  # a wait still not over after this long is a hang

GEOMETRY = CacheGeometry(num_layers=contract.LAYERS, kv_heads=contract.HEADS, head_dim=contract.DIM,
                         dtype=torch.float32)


def layers(h):
    return contract.layers_for(h)


def until(ready, what: str) -> None:
    """Wait for a condition another thread makes true (polled; GUARD_S means it never will)."""
    deadline = time.monotonic() + GUARD_S
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {GUARD_S} s"
        time.sleep(0.01)


@pytest.fixture
def receive_loop():
    """A decode worker's receive loop over a fake link: (sender link, loop)."""
    s_link, r_link = fake.pair()
    loop = ReceiveLoop(r_link, GEOMETRY, torch.device("cpu"), finish_timeout_s=10 * GUARD_S)  # outlasts any wait here
    loop.start()
    yield s_link, loop
    loop.retire("test over")
    r_link.close()


def sent_in_thread(s_link, h):
    """Send `h` whole from a thread; returns (thread, errors)."""
    errors: list[BaseException] = []

    def run():
        try:
            contract.send_all(s_link, h, "cpu")
        except BaseException as e:  # checked by the caller
            errors.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


# --- the sender's checks (kvtransfer/transport/sender.py) ---

def finish_times_out(sender) -> None:
    """`sender.finish(timeout=0.5)`, on a thread of its own (a mutant may hang it): it ends within GUARD_S, raising
    TransferError(cause "timeout")."""
    ended: list[BaseException | None] = []

    def finish():
        try:
            sender.finish(timeout=0.5)
            ended.append(None)
        except BaseException as e:  # checked below
            ended.append(e)
    t = threading.Thread(target=finish, daemon=True)
    t.start()
    t.join(GUARD_S)
    assert ended, f"finish(timeout=0.5) still waiting after {GUARD_S} s"
    assert isinstance(ended[0], TransferError) and ended[0].cause == "timeout", ended


def test_a_value_of_another_shape_than_its_key_is_refused_and_the_request_stays_open():
    """send_layer checks V's shape as well as K's (kills check_layer looking at the key only: a V of the wrong
    length went out, and on gRPC the layer's byte count never added up, so the receiver waited out its timeout)."""
    s_link, r_link = fake.pair()
    h = contract.header(1, 5)
    (k, v), *_ = layers(h)
    s = s_link.open(h)
    short = v[:, :, :4]
    with pytest.raises(TransferError) as info:
        s.send_layer(0, k, short)
    assert info.value.cause == "protocol" and "value" in str(info.value)
    assert s.status() == TransferState.WAITING  # a refused call leaves the request open
    for i, (k, v) in enumerate(layers(h)):
        s.send_layer(i, k, v)
    s.finish(timeout=GUARD_S)
    contract.check_received(r_link.accept(timeout=GUARD_S), h, GUARD_S)


# --- the frame spec (kvtransfer/transport/frames.py) ---


def test_a_frame_of_exactly_the_receive_limit_is_accepted():
    """The receive limit is inclusive (kills `total_bytes() >= max_bytes`): the decode worker announces the bytes of
    a --max-prompt-tokens cache as its limit, so a prompt of exactly that many tokens must still be received."""
    h = contract.header(2, 7)
    assert check_header(h, h.total_bytes()) == h
    with pytest.raises(TransferError, match="exceeds the receive limit"):
        check_header(h, h.total_bytes() - 1)


# --- a destination that does not match the frame fails that request, not the link (landing.py) ---


@pytest.mark.parametrize("wrong", ["one layer short", "one layer too many", "on another device"])
def test_a_destination_that_does_not_match_the_frame_fails_that_request_only(wrong):
    """A provider's destination with a layer too few or too many, or on another device than the link's, fails the
    request with `protocol` and the link carries the next one (kills check_destination's layer count `!=` turned `<`
    and its device comparison dropped: the frame was placed into memory that does not match it)."""
    s_link, r_link = fake.pair()
    bad, good = contract.header(3, 6), contract.header(4, 3)

    def provider(h):
        dest = [(torch.empty(h.layer_shape()), torch.empty(h.layer_shape())) for _ in range(h.num_layers)]
        if wrong == "one layer short":
            return dest[1:]
        if wrong == "one layer too many":
            return dest + dest[:1]
        return [(k.to("meta"), v.to("meta")) for k, v in dest]

    t, errors = sent_in_thread(s_link, bad)
    r = r_link.accept(timeout=GUARD_S, destinations=provider)
    contract.expect_error(lambda: r.finish(timeout=GUARD_S), "protocol")
    t.join(GUARD_S)
    t, errors = sent_in_thread(s_link, good)
    contract.recv_check(r_link, good, GUARD_S)
    t.join(GUARD_S)
    assert not errors, errors


# --- into the decode worker's paged pool (decode_server/landing.py: a Landed hand-off) ---


@pytest.fixture
def grpc_pair():
    from kvtransfer.transport.grpc.backend import ReceiverLink, SenderLink
    r_link = ReceiverLink("127.0.0.1:0")
    s_link = SenderLink(r_link.address, channels=2, chunk_bytes=512)
    yield s_link, r_link
    s_link.close()
    r_link.close()


def test_a_grpc_chunk_that_runs_past_its_layer_is_refused_before_it_writes(grpc_pair):
    """A chunk whose bytes run past the end of its layer is refused as `protocol` before it is copied (kills
    GrpcReceiver._chunk dropping its `offset + n > layer_bytes` bound: the bytes spilled into the next layer, one
    already handed out to the consumer, and only the byte count caught the frame afterwards)."""
    _, r_link = grpc_pair
    h = contract.header(10, 3)
    lb = h.layer_bytes()
    head = wire.header_message(h, link_id=1, seq=0, checksum=Checksum.NONE, streams=1, index=0)
    layer1 = bytes(byte_view(torch.stack(layers(h)[1])))
    go_on = threading.Event()

    def stream():
        yield head
        yield wire.CHUNK.pack(wire.KIND_CHUNK, 1, 0, 0) + layer1  # layer 1 whole: it lands
        assert go_on.wait(GUARD_S)
        yield wire.CHUNK.pack(wire.KIND_CHUNK, 0, lb - 4, 0) + bytes(range(1, 9))  # 4 bytes past layer 0's end
        go_on.wait(GUARD_S)  # the receiver ends the stream first
    with grpc.insecure_channel(r_link.address) as ch:
        call = ch.stream_unary(wire.PUSH_PATH).future(stream(), timeout=GUARD_S)
        r = r_link.accept(timeout=GUARD_S)
        k1, v1 = r.wait_for_layer(1, timeout=GUARD_S)  # views of the receive block (CPU, no provider)
        want = torch.stack((k1, v1)).clone()
        go_on.set()
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=GUARD_S)
    assert contract.same(torch.stack((k1, v1)), want), "layer 1, handed out already, was overwritten"
    assert "outside the frame" in info.value.details(), info.value.details()
    contract.expect_error(lambda: r.finish(timeout=GUARD_S), "protocol")


def test_a_grpc_frame_whose_streams_all_end_ok_with_a_layer_missing_fails_at_once(grpc_pair):
    """Every stream of a request sent its OK trailer but a layer never came: the last trailer is answered with
    `protocol`, so the sender's finish fails and the receiver's too, at once (kills GrpcReceiver._end's
    completeness check: the sender was acknowledged for a cache that never arrived, and the decode side waited out
    its whole --request-timeout-s before failing the request as a timeout)."""
    _, r_link = grpc_pair
    h = contract.header(11, 3)
    head = wire.header_message(h, link_id=2, seq=0, checksum=Checksum.NONE, streams=1, index=0)
    sent = [wire.CHUNK.pack(wire.KIND_CHUNK, i, 0, 0) + bytes(byte_view(torch.stack(layers(h)[i])))
            for i in (0, 1, 3)]  # layer 2 is never sent
    with grpc.insecure_channel(r_link.address) as ch:
        call = ch.stream_unary(wire.PUSH_PATH).future(iter([head, *sent, wire.trailer_message(True)]),
                                                       timeout=GUARD_S)
        r = r_link.accept(timeout=GUARD_S)
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=GUARD_S)
    assert "layers [2] are incomplete" in info.value.details(), info.value.details()
    contract.expect_error(lambda: r.finish(timeout=GUARD_S), "protocol")


def test_a_grpc_sender_whose_receiver_never_acknowledges_fails_finish_at_its_timeout():
    """A receiver that takes every byte but never answers (a stalled decode worker): finish(timeout) fails with
    `timeout` (kills GrpcSender._finish waiting on each stream with no deadline: the prefill worker's device thread
    hung in finish for as long as the receiver stayed stalled, whatever --send-timeout-s said)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtransfer.transport.grpc.backend import SenderLink
    release = threading.Event()

    def push(requests, context):
        for _ in requests:  # every byte taken ...
            pass
        release.wait(GUARD_S)  # ... and no answer
        return b""
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        wire.SERVICE, {wire.METHOD: grpc.stream_unary_rpc_method_handler(push)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    s_link = SenderLink(f"127.0.0.1:{port}", channels=1)
    try:
        h = contract.header(12, 3)
        s = s_link.open(h)
        for i, (k, v) in enumerate(layers(h)):
            s.send_layer(i, k, v)

        finish_times_out(s)
    finally:
        release.set()
        s_link.close()
        server.stop(grace=None)


def test_a_late_stream_of_an_ended_grpc_request_is_refused_and_never_accepted_again(grpc_pair):
    """A request of two streams ends (its first stream aborted it) before its second stream arrives: that stream is
    refused by the request's tombstone, and accept() hands out the next real request (kills _retire dropping the
    entry instead of leaving the tombstone: the late stream started a phantom request of the same id, which the
    decode worker's one receive loop accepted and then waited on for --request-timeout-s, every other frame queued
    behind it)."""
    s_link, r_link = grpc_pair
    h = contract.header(13, 3)

    def stream(index):
        head = wire.header_message(h, link_id=3, seq=0, checksum=Checksum.NONE, streams=2, index=index)
        return iter([head, wire.trailer_message(False, "prefill failed")])
    with grpc.insecure_channel(r_link.address) as ch:
        push = ch.stream_unary(wire.PUSH_PATH)
        push(stream(0), timeout=GUARD_S)  # the request is aborted, so it has ended
        contract.expect_error(lambda: r_link.accept(timeout=GUARD_S).finish(timeout=GUARD_S), "aborted")
        with pytest.raises(grpc.RpcError):
            push(stream(1), timeout=GUARD_S)  # late: refused
    nxt = contract.header(14, 3)
    t, errors = sent_in_thread(s_link, nxt)
    r = r_link.accept(timeout=GUARD_S)
    assert r.header.request_id == 14, f"accepted {r.header} before the next request"
    contract.check_received(r, nxt, GUARD_S)
    t.join(GUARD_S)
    assert not errors, errors


def test_the_cause_a_grpc_receiver_sends_back_is_the_cause_its_sender_raises():
    """The receiver's typed cause in trailing metadata wins over the status code (kills error_from_rpc ignoring
    it: `aborted` and `peer` share UNAVAILABLE, so a transfer the decode side gave up on was counted and reported by
    the prefill worker as a lost peer)."""
    class Failed(grpc.RpcError):
        def __init__(self, cause):
            self.meta = ((wire.FAILURE_KEY, wire.pb.Failure(cause=wire._CAUSE_PROTO[cause]).SerializeToString()),)
            self.status = wire.CAUSE_STATUS[cause]

        def code(self):
            return self.status

        def details(self):
            return "receiver said so"

        def trailing_metadata(self):
            return self.meta
    for cause in ("aborted", "peer", "timeout", "protocol", "data_loss"):
        assert wire.error_from_rpc(Failed(cause), "decode:1").cause == cause


@pytest.mark.parametrize("transport", ["fake", "grpc"])
def test_a_frame_lands_in_a_paged_pool_with_k_and_v_in_their_places(transport, request):
    """A remote prefill's cache into a paged pool (its positions spread over 4-token blocks): every layer's K and V
    read back from the request's blocks equal what was sent, and no other block is touched (kills Placement handing
    a Landed destination V as K and K as V; the slot-layout pool of the contract suite never lands this way)."""
    if transport == "fake":
        s_link, r_link = fake.pair()
    else:
        s_link, r_link = request.getfixturevalue("grpc_pair")
    pool = KVPool(GEOMETRY, torch.device("cpu"), slots=2, max_seq=16, page=4)
    other = pool.try_lease(16)
    lease = pool.try_lease(7)
    loop = ReceiveLoop(r_link, GEOMETRY, torch.device("cpu"), finish_timeout_s=GUARD_S)
    loop.start()
    try:
        h = contract.header(5, 7)
        exp = loop.expect(5, 7, destination=pool_destination(pool, lease.slot, 7), lease=lease)
        t, errors = sent_in_thread(s_link, h)
        exp.future.result(timeout=GUARD_S)
        t.join(GUARD_S)
        assert not errors, errors
        for i, ((k, v), (wk, wv)) in enumerate(zip(pool.layers_of(lease.slot, 7), layers(h))):
            assert contract.same(k, wk) and contract.same(v, wv), f"layer {i} landed wrong"
        assert bool((pool.kv[:, :, other.blocks] == 0).all()), "another row's blocks changed"
    finally:
        loop.retire("test over")


def test_layers_of_one_block_given_in_another_order_each_land_in_their_own_place():
    """A destination whose layers are K/V-adjacent pairs of one block, but not in layer order, is no contiguous run:
    each layer lands where the provider said (kills contiguous_run dropping its offset check: the frame was received
    as one run starting at the first layer's pair, over the others' memory and past the block's end)."""
    s_link, r_link = fake.pair()
    h = contract.header(6, 5)
    block = torch.full((h.num_layers, 2, *h.layer_shape()), contract.Pool.SENTINEL)
    order = list(reversed(range(h.num_layers)))  # layer i lands in block[order[i]]
    t, errors = sent_in_thread(s_link, h)
    r = r_link.accept(timeout=GUARD_S, destinations=lambda h: [(block[j, 0], block[j, 1]) for j in order])
    got = r.finish(timeout=GUARD_S)
    t.join(GUARD_S)
    assert not errors, errors
    for i, (wk, wv) in enumerate(layers(h)):
        assert contract.same(block[order[i], 0], wk) and contract.same(block[order[i], 1], wv), f"layer {i}"
        assert got[i][0].data_ptr() == block[order[i], 0].data_ptr()


# --- the gloo link (kvtransfer/transport/dist/backend.py), both ranks of one two-rank group in this process ---

_PREFIXES = itertools.count()


@pytest.fixture
def gloo_groups():
    """(rank 0's group, rank 1's group): a fresh two-rank ProcessGroupGloo over loopback, as join_pair builds one."""
    store, prefix, groups = dist.HashStore(), f"pair-{next(_PREFIXES)}", {}

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2,
                                             gloo_options("127.0.0.1", datetime.timedelta(seconds=GUARD_S)))
    threads = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GUARD_S)
    assert len(groups) == 2, "the gloo pair did not form"
    yield groups[0], groups[1]


def test_a_gloo_sender_whose_receiver_takes_nothing_fails_finish_at_its_timeout(gloo_groups):
    """finish(timeout) bounds the wait for the frame to leave (kills DistSender._finish dropping the deadline: a
    prefill worker whose decode peer stopped receiving held its device thread in finish for IDLE_WAIT_S, a week,
    instead of failing the request after --send-timeout-s)."""
    s_link = gloo.SenderLink("cpu", group=gloo_groups[0])
    h = contract.header(7, 64)  # nobody posts a receive on rank 1
    s = s_link.open(h)
    for i, (k, v) in enumerate(layers(h)):
        s.send_layer(i, k, v)
    finish_times_out(s)
    assert s.status() == TransferState.FAILED


def test_a_gloo_header_of_zero_layers_per_message_is_refused_as_protocol(gloo_groups):
    """A frame header whose layers-per-message field is 0 (corrupt, or a peer of another build) is refused with
    TransferError("protocol") (kills the `per_msg < 1` check: the receiver crashed on range(..., 0) with a
    ValueError, which the decode worker's receive loop treats as a bug in itself and stops the server for)."""
    h = contract.header(8, 3)
    wire = torch.tensor([*header_fields(h), 0], dtype=torch.int64)
    work = gloo_groups[0].send([wire], 1, 0)
    r_link = gloo.ReceiverLink("cpu", group=gloo_groups[1])
    with pytest.raises(TransferError, match="0 layers per message") as info:
        r_link.accept(timeout=GUARD_S)
    assert info.value.cause == "protocol"
    work.wait()


@pytest.mark.parametrize("how", ["its provider refused", "it aborted"])
def test_a_gloo_receiver_that_failed_hands_out_no_layer(gloo_groups, how):
    """Once a gloo receiver's provider refused the frame, or the receiver aborted, wait_for_layer raises that
    failure rather than returning the layer drained into scratch memory (kills wait_for_layer skipping
    _check_alive: a consumer reading layer by layer got bytes that never reached its destination). The frame's
    receives were posted at accept, so the sender still completes and the stream stays in step."""
    s_link, r_link = gloo.SenderLink("cpu", group=gloo_groups[0]), gloo.ReceiverLink("cpu", group=gloo_groups[1])
    h = contract.header(9, 5)
    t, errors = sent_in_thread(s_link, h)

    def refuse(h):
        raise TransferError("protocol", f"no room for request {h.request_id}")
    r = r_link.accept(timeout=GUARD_S, destinations=refuse if how == "its provider refused" else None)
    cause = "protocol" if how == "its provider refused" else "aborted"
    if how == "it aborted":
        r.abort("the request gave up")
    contract.expect_error(lambda: r.wait_for_layer(0, timeout=GUARD_S), cause)
    contract.expect_error(lambda: r.finish(timeout=GUARD_S), cause)
    t.join(GUARD_S)
    assert not errors, errors



# --- the decode worker's receive loop and data plane (decode_server/peer/receiver.py, dataplane.py) ---


def test_a_dropped_frame_gives_its_receive_bytes_back_to_the_ledger(receive_loop):
    """A frame nobody waits for is drained and dropped, and its receive buffer leaves the ledger (kills _one not
    giving a frame's bytes back when it was not handed over: the ledger, which the leak checks and metrics read,
    grew by every cancelled request's cache). Frames are taken in order, so once the next one is handed over the
    dropped one is done with."""
    s_link, loop = receive_loop
    dropped, wanted = contract.header(40, 9), contract.header(41, 5)
    exp = loop.expect(41, 5)
    t, errors = sent_in_thread(s_link, dropped)
    t.join(GUARD_S)
    t, errors2 = sent_in_thread(s_link, wanted)
    exp.future.result(timeout=GUARD_S)
    t.join(GUARD_S)
    assert not errors and not errors2, (errors, errors2)
    assert loop.dropped == 1
    assert loop.ledger.bytes == wanted.total_bytes(), "the dropped frame's bytes are still counted"
    loop.release(exp)
    assert loop.ledger.bytes == 0


@pytest.mark.parametrize("how", ["the request gave up", "the pairing ended"])
def test_a_frame_mid_landing_is_aborted_when_its_request_gives_up_or_its_pairing_ends(receive_loop, how):
    """A request that gives up (forget) or a pairing that ends (fail_pending) while the request's frame is landing
    aborts that frame, and a link with a back channel tells the sender at once (kills both `current.abort(...)`
    calls removed: the prefill worker kept computing and sending a cache nobody would read, and the request's slot
    stayed held until the frame's timeout)."""
    s_link, loop = receive_loop
    h = contract.header(42, 5)
    exp = loop.expect(42, 5)
    s = s_link.open(h)
    s.send_layer(0, *layers(h)[0])
    until(lambda: loop.receiving(), "the frame was never accepted")
    if how == "the request gave up":
        loop.forget(42)
    else:
        loop.fail_pending("prefill peer down: test")
        with pytest.raises(TransferError, match="prefill peer down"):
            exp.future.result(timeout=GUARD_S)
    until(lambda: s.status() == TransferState.FAILED, "the sender never heard of the abort")
    contract.expect_error(lambda: s.send_layer(1, *layers(h)[1]), "aborted")
    until(lambda: not loop.receiving(), "the aborted frame is still landing")


def data_plane(**config) -> DataPlane:
    loaded = SimpleNamespace(device=torch.device("cpu"), geometry=GEOMETRY)
    return DataPlane(DecodeConfig(**config), loaded, registry.backend("fake"), addr="prefill:1")


@pytest.mark.parametrize("limit,tokens", [(1 << 20, 4096), (1 << 30, 16)])
def test_the_receive_limit_is_the_smaller_of_the_byte_limit_and_the_longest_prompt(limit, tokens):
    """The limit a decode worker announces is min(--max-receive-bytes, a --max-prompt-tokens cache) (kills min
    turned max: a frame larger than --max-receive-bytes, or than any prompt this worker takes, was accepted)."""
    dp = data_plane(max_receive_bytes=limit, max_prompt_tokens=tokens)
    assert dp.receive_limit() == min(limit, GEOMETRY.cache_bytes(tokens))


def test_a_remote_prefill_that_fails_leaves_nothing_waiting_and_no_load(receive_loop):
    """The prefill worker refuses the request: remote_prefill raises PeerFailure, and neither the receive loop's
    expectation nor the request's prompt tokens stay behind (kills the `finally` dropping `loop.forget(rid)`: a
    late frame still landed in a slot the request had given back, and the loop counted it pending for good; and
    dropping `inflight_tokens -= n`: the peer looked busier by every failed prompt, and was chosen less)."""
    _, loop = receive_loop
    dp = data_plane()
    dp.loop = loop

    class Stub:
        async def Prefill(self, request, timeout, metadata):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="prefill worker is down")

    request = SimpleNamespace(token_ids=[5, 6, 7], mode=0, return_logits_digest=False)
    with pytest.raises(PeerFailure):
        asyncio.run(dp.remote_prefill(Stub(), request, 43, time.perf_counter() + GUARD_S, (), None, None))
    assert loop.pending() == 0, "the failed request is still expected"
    assert dp.inflight_tokens == 0 and dp.load() == 0


# --- the prefill worker's sending side (prefill_server/worker.py) ---


class SpyLink:
    """A sender link that records what the worker asks of the transport; `fail_open`: open raises it."""

    def __init__(self, fail_open: BaseException | None = None):
        self.fail_open, self.calls = fail_open, []

    def open(self, header):
        if self.fail_open is not None:
            raise self.fail_open
        self.calls.append(("open", header.num_layers))
        return self

    def send_layer(self, i, k, v):
        self.calls.append(("send", i))

    def finish(self, timeout=None):
        self.calls.append(("finish", timeout))

    def abort(self, reason):
        self.calls.append(("abort", reason))


@pytest.fixture
def tiny_loaded(tiny_fp32):
    """The session `tiny` model as the prefill worker holds it (kvtransfer.model.loaded.LoadedModel)."""
    return LoadedModel(ModelSpec("tiny", dtype="float32", seed=0), tiny_fp32,
                       CacheGeometry.from_config(tiny_fp32.config, torch.float32), torch.device("cpu"))


def test_the_prefill_worker_bounds_finish_by_its_send_timeout(tiny_loaded):
    """finish is given --send-timeout-s (kills run() calling finish with no timeout: a decode worker that stopped
    receiving held the prefill worker's device thread for good)."""
    link = SpyLink()
    PrefillWorker(tiny_loaded, send_timeout_s=7.5).run(link, 44, [1, 2, 3, 4], "layerwise", want_digest=False)
    assert link.calls[-1] == ("finish", 7.5), link.calls


def test_a_prefill_that_fails_mid_cache_aborts_its_transfer(tiny_loaded):
    """A failure after some layers left ends the frame in-band as aborted (kills run()'s `sender.abort` removed: on
    gloo/NCCL the decode side's posted receives for the rest of the frame then swallowed the next request's
    bytes, and every later transfer on the pair was out of step)."""
    class Fault:
        def wrap(self, request_id, num_layers, send):
            def failing(i, k, v):
                if i == 1:
                    raise RuntimeError("device error in layer 1")
                send(i, k, v)
            return failing
    link = SpyLink()
    with pytest.raises(RuntimeError, match="device error"):
        PrefillWorker(tiny_loaded, fault=Fault()).run(link, 45, [1, 2, 3, 4], "layerwise", want_digest=False)
    assert [c[0] for c in link.calls] == ["open", "send", "abort"], link.calls


def test_a_data_plane_runtime_error_is_a_peer_failure(tiny_loaded):
    """gloo's RuntimeError ("Connection closed by peer") from the link becomes TransferError("peer") (kills
    _transport_errors no longer mapping it: the decode worker's request then failed as an internal error instead of
    reaching its --on-failure policy)."""
    link = SpyLink(fail_open=RuntimeError("Connection closed by peer"))
    with pytest.raises(TransferError) as info:
        PrefillWorker(tiny_loaded).run(link, 46, [1, 2, 3], "bulk", want_digest=False)
    assert info.value.cause == "peer" and "Connection closed by peer" in str(info.value)
