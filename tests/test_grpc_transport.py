"""gRPC backend beyond the contract: integrity, chunking, limits, faults, the loopback probe.

Both links live in this process (the receiver's server threads and the sender's streams
are real gRPC over loopback TCP); the two-process runs are in test_transport_contract.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from bench.measure.launch import free_port
from kvtransfer.transport import Cause, TransferError, TransferState
from kvtransfer.transport.grpc import frames as wire
from kvtransfer.transport.grpc.backend import Checksum, ReceiverLink, SenderLink
from kvtransfer.transport.status import CAUSE_STATUS
from proto import kvdata_pb2 as pb
from support import contract


@pytest.fixture
def receiver():
    links = []

    def make(**kw) -> ReceiverLink:
        links.append(ReceiverLink("127.0.0.1:0", **kw))
        return links[-1]

    yield make
    for link in links:
        link.close()


def send_in_thread(link, h, layers=None, finish_timeout=10.0):
    """Send `h` from a thread; returns (thread, errors list)."""
    errors: list[BaseException] = []

    def run():
        try:
            s = link.open(h)
            for i, (k, v) in enumerate(layers or contract.layers_for(h)):
                s.send_layer(i, k, v)
            s.finish(timeout=finish_timeout)
        except BaseException as e:  # checked by the caller
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def test_checksum_mismatch_is_data_loss(receiver):
    r_link = receiver()
    s_link = SenderLink(r_link.address, channels=2, chunk_bytes=256, corrupt_layer=2)
    h = contract.header(7, 9)
    t, errors = send_in_thread(s_link, h)
    r = r_link.accept(timeout=10)
    try:
        k, _ = r.wait_for_layer(1, timeout=10)  # layers before the corrupt one are fine ...
    except TransferError as e:  # ... unless layer 2's check came first: from then on the whole request is failed
        assert e.cause == "data_loss" and "layer 2" in str(e), e
    else:
        assert torch.equal(k, contract.layers_for(h)[1][0])
    contract.expect_error(lambda: r.wait_for_layer(2, timeout=10), "data_loss")
    contract.expect_error(lambda: r.finish(timeout=10), "data_loss")
    assert r.status() == TransferState.FAILED
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], TransferError) and errors[0].cause == "data_loss", errors
    s_link.corrupt_layer = None  # the link stays usable
    t, errors = send_in_thread(s_link, contract.header(8, 3))
    contract.recv_check(r_link, contract.header(8, 3), timeout=10)
    t.join(10)
    assert not errors, errors
    s_link.close()


def test_corruption_goes_unnoticed_without_checksum(receiver):
    """The fault injection is real: with the check off, the flipped byte reaches the cache."""
    r_link = receiver()
    s_link = SenderLink(r_link.address, channels=1, checksum=Checksum.NONE, corrupt_layer=0)
    h = contract.header(9, 4)
    t, errors = send_in_thread(s_link, h)
    got = r_link.accept(timeout=10).finish(timeout=10)
    t.join(10)
    assert not errors, errors
    assert not torch.equal(got[0][0].view(torch.uint8), contract.layers_for(h)[0][0].view(torch.uint8))
    s_link.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_channels_small_chunks_byte_equal(receiver, dtype):
    """3 channels, 1 KiB chunks; K/V adjacent, separate, and strided (non-contiguous) sources."""
    r_link = receiver()
    s_link = SenderLink(r_link.address, channels=3, chunk_bytes=1024)
    for rid, seq in enumerate([1, 37, 130]):
        h = contract.header(20 + rid, seq, dtype)
        want = contract.layers_for(h)
        layers = want if rid == 0 else [(k.clone(), v.clone()) for k, v in want]
        if rid == 2:  # (b, h, s, d) views of (b, s, h, d) storage
            layers = [(k.transpose(1, 2).contiguous().transpose(1, 2), v) for k, v in want]
        t, errors = send_in_thread(s_link, h, layers)
        contract.recv_check(r_link, h, timeout=10)
        t.join(10)
        assert not errors, errors
    s_link.close()


def test_header_over_max_bytes_is_refused(receiver):
    r_link = receiver(max_bytes=4096)
    s_link = SenderLink(r_link.address, channels=2)
    big = contract.header(30, 64)  # 4 layers x 2 x 2 heads x 64 x 8 x 4 B = 32 KiB
    t, errors = send_in_thread(s_link, big)
    e = contract.expect_error(lambda: r_link.accept(timeout=10), "protocol")
    assert "max_bytes=4096" in str(e)
    t.join(10)
    assert len(errors) == 1 and errors[0].cause == "protocol" and "max_bytes" in str(errors[0]), errors
    small = contract.header(31, 2)  # 1 KiB: the link still works, and the refused request left nothing queued
    t, errors = send_in_thread(s_link, small)
    contract.recv_check(r_link, small, timeout=10)
    t.join(10)
    assert not errors, errors
    s_link.close()


@pytest.mark.parametrize("field,value", [("num_streams", 0), ("dtype", 9), ("seq_len", 0), ("checksum", 7)])
def test_insane_header_is_refused(receiver, field, value):
    r_link = receiver()
    m = pb.FrameHeader(link_id=1, seq=0, request_id=1, seq_len=4, num_layers=2, kv_heads=1, head_dim=8, batch=1,
                       dtype=pb.DTYPE_FLOAT32, num_streams=1)
    setattr(m, field, value)
    with grpc.insecure_channel(r_link.address) as ch:
        push = ch.stream_unary(wire.PUSH_PATH)
        with pytest.raises(grpc.RpcError) as info:
            push(iter([bytes((wire.KIND_HEADER,)) + m.SerializeToString()]), timeout=10)
    assert info.value.code() == CAUSE_STATUS[Cause.PROTOCOL]  # the one cause -> status table
    contract.expect_error(lambda: r_link.accept(timeout=5), "protocol")


def test_receiver_abort_reaches_sender_mid_frame(receiver):
    """The receiver aborts after layer 0: the sender hears of it by itself (its status turns FAILED before layer 1
    is sent; waited for, up to a deadline, not timed), so prefill can stop early; every later call fails."""
    r_link = receiver()
    s_link = SenderLink(r_link.address, channels=2)
    h = contract.header(40, 8)
    layers = contract.layers_for(h)
    s = s_link.open(h)
    s.send_layer(0, *layers[0])
    r = r_link.accept(timeout=10)
    r.wait_for_layer(0, timeout=10)
    r.abort("decode gave up")
    contract.expect_error(lambda: r.wait_for_layer(1, timeout=10), "aborted")
    deadline = time.monotonic() + 30
    while s.status() != TransferState.FAILED:
        assert time.monotonic() < deadline, "the receiver's abort did not reach the sender within 30 s"
        time.sleep(0.01)
    contract.expect_error(lambda: s.send_layer(1, *layers[1]), "aborted")
    contract.expect_error(lambda: s.finish(timeout=10), "aborted")
    s_link.close()


def test_sender_abort_and_lost_sender(receiver):
    r_link = receiver()
    s_link = SenderLink(r_link.address, channels=2)
    h = contract.header(50, 8)
    s = s_link.open(h)
    s.send_layer(0, *contract.layers_for(h)[0])
    r = r_link.accept(timeout=10)
    s.abort("prefill failed")
    contract.expect_error(lambda: r.wait_for_layer(3, timeout=10), "aborted")
    s = s_link.open(contract.header(51, 8))  # a sender whose process dies: its connections drop
    r = r_link.accept(timeout=10)
    s_link.close()
    contract.expect_error(lambda: r.finish(timeout=10), "peer")


def test_no_receiver_is_a_peer_error():
    s_link = SenderLink(f"127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    contract.expect_error(lambda: s_link.open(contract.header(60, 2)), "peer")
    s_link.close()


def test_options_are_checked():
    with pytest.raises(ValueError):
        SenderLink("127.0.0.1:1", channels=0)
    with pytest.raises(ValueError):
        SenderLink("127.0.0.1:1", chunk_bytes=wire.MAX_CHUNK_BYTES + 1)
    with pytest.raises(ValueError):
        SenderLink("127.0.0.1:1", checksum=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_send_layer_never_waits_for_compute(receiver):
    """send_layer returns while the GPU is still busy, and the staged copy still waits for the layer's compute.
    Asserted by the compute stream's state when each send_layer returns (still busy: the host did not wait for
    it), not by the host time it took (printed): ~2 s of GPU work queued first leave the host's four calls ample
    room, where waiting for the compute would wait for all of it."""
    r_link = receiver(device="cuda")
    s_link = SenderLink(r_link.address, channels=2, chunk_bytes=64 << 10)
    h = contract.header(70, 256)
    want = contract.layers_for(h)
    src = torch.stack([torch.stack(kv) for kv in want]).cuda()  # (layers, 2, b, h, s, d)
    block = torch.zeros_like(src)
    torch.cuda.synchronize()
    s = s_link.open(h)
    host_s = 0.0
    torch.cuda._sleep(4_000_000_000)  # ~2 s of GPU time ahead of every layer
    for i in range(h.num_layers):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time stands in for layer i's attention
        block[i].copy_(src[i])  # the layer is written only after it
        t0 = time.perf_counter()
        s.send_layer(i, block[i, 0], block[i, 1])
        host_s += time.perf_counter() - t0
        assert not torch.cuda.current_stream().query(), f"send_layer {i} waited for the compute stream"
    print(f"send_layer: {host_s * 1e3:.1f} ms of host time for {h.num_layers} layers")
    r = r_link.accept(timeout=10)
    s.finish(timeout=30)
    got = r.finish(timeout=30)
    assert got[0][0].is_cuda
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(gk.cpu(), wk) and torch.equal(gv.cpu(), wv)
    s_link.close()


def test_loopback_probe():
    from bench.measure.grpc_probe import measure_loopback
    out = measure_loopback(4 << 20, channels=2, chunk_bytes=256 << 10, layers=4, repeats=1)
    assert out["bytes"] == 4 << 20
    for key in ("grpc", "socket"):
        assert out[key]["bytes_ok"] and out[key]["gbps"] > 0 and out[key]["median_ms"] > 0


@pytest.mark.parametrize("checksum", ["none", "xxh3"])
def test_the_servers_checksum_setting_reaches_the_link(receiver, checksum):
    """--checksum on the prefill server -> its options -> the registry's link: off, a flipped byte arrives
    unnoticed; on, it is DATA_LOSS."""
    import dataclasses

    from kvtransfer.transport import registry
    from prefill_server.config import PrefillConfig
    r_link = receiver()
    options = registry.options_from(PrefillConfig(transport="grpc", checksum=checksum), "grpc")
    s_link = registry.sender_link("grpc", "cpu", dataclasses.replace(options, corrupt_layer=1), address=r_link.address)
    h = contract.header(31, 5)
    t, errors = send_in_thread(s_link, h)
    r = r_link.accept(timeout=10)
    if checksum == "none":
        got = r.finish(timeout=10)
        assert not torch.equal(got[1][0], contract.layers_for(h)[1][0])  # the corruption got through
    else:
        contract.expect_error(lambda: r.finish(timeout=10), "data_loss")
    t.join(10)
    s_link.close()


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="openssl makes the test certificates")
def test_a_tls_name_mismatch_fails_the_connect_at_once_saying_tls(receiver, tmp_path):
    """The decode side listening on an address its certificate does not name (127.0.0.2; make_test_ca.sh names
    localhost and 127.0.0.1): the sender waited its whole connect timeout and said "no gRPC receiver", while the
    two sides re-handshook until the decode side gave up, neither naming TLS (an operator's pass). Now the first
    second's failed handshake ends it, saying what to fix. The same certificate at 127.0.0.1 connects."""
    import os
    import subprocess

    from support.servers import ROOT
    subprocess.run(["bash", os.path.join(ROOT, "deploy", "make_test_ca.sh"), str(tmp_path), "1"], check=True,
                   capture_output=True)
    read = lambda n: (tmp_path / n).read_bytes()  # noqa: E731
    server_creds = grpc.ssl_server_credentials([(read("server.key"), read("server.pem"))])
    client_creds = grpc.ssl_channel_credentials(read("ca.pem"))
    r_link = ReceiverLink("127.0.0.2:0", credentials=server_creds)
    s_link = SenderLink(f"127.0.0.2:{r_link.port}", connect_timeout_s=30, credentials=client_creds)
    err = contract.expect_error(lambda: s_link.open(contract.header(60, 2)), "peer")
    s_link.close()
    assert "TLS handshake" in str(err) and "--data-tls-cert" in str(err), err  # before: after 30 s, no word of TLS
    ok = receiver(credentials=server_creds)
    s_ok = SenderLink(f"127.0.0.1:{ok.port}", connect_timeout_s=30, credentials=client_creds)
    try:
        s_ok._connect()
    finally:
        s_ok.close()
        r_link.close()
