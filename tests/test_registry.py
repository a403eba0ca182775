"""The registry: the one way to build links; options per backend; lazy, light imports; the receive loop's
destination provider (a request's registered destination is filled in place)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from decode_server.config import DecodeConfig
from decode_server.peer.receiver import ReceiveLoop
from kvtransfer.geometry import CacheGeometry
from kvtransfer.transport import registry
from kvtransfer.transport.options import DistOptions, GrpcOptions, IpcOptions
from prefill_server.config import PrefillConfig
from support import contract


def test_resolve_and_needs_cuda():
    assert registry.resolve("auto", "cpu").name == "gloo"
    assert registry.resolve("auto", "cuda").name == "nccl"
    assert registry.resolve("grpc", "cpu").rendezvous is registry.Rendezvous.ADDRESS
    for name in ("nccl", "cuda_ipc"):
        with pytest.raises(ValueError, match="needs CUDA"):
            registry.resolve(name, "cpu")
    with pytest.raises(ValueError, match="choose one of"):
        registry.resolve("carrier-pigeon", "cpu")


def test_options_from_the_server_config():
    assert registry.options_from(PrefillConfig(transport="grpc", grpc_channels=3, checksum="none"), "grpc") == \
        GrpcOptions(channels=3, checksum="none")
    assert registry.options_from(PrefillConfig(layers_per_message=2), "auto") == DistOptions(layers_per_message=2)
    assert registry.options_from(DecodeConfig(transport="grpc"), "grpc").listener_workers == 64
    assert registry.options_from(DecodeConfig(transport="cuda_ipc", ipc_slots=3), "cuda_ipc") == IpcOptions(slots=3)


@pytest.mark.parametrize("cls,kw,flag", [
    (PrefillConfig, dict(transport="gloo", grpc_channels=2), "--grpc-channels is a grpc option"),
    (PrefillConfig, dict(transport="grpc", layers_per_message=2), "--layers-per-message is a nccl/gloo option"),
    (PrefillConfig, dict(transport="auto", checksum="none"), "--checksum is a grpc option"),
    (DecodeConfig, dict(transport="grpc", ipc_slots=4), "--ipc-slots is a cuda_ipc option"),
    (DecodeConfig, dict(transport="gloo", data_tls_cert="x.pem", data_tls_key="x.key"), "--data-tls-cert is a grpc"),
])
def test_a_flag_of_another_backend_is_refused(cls, kw, flag):
    with pytest.raises(ValueError, match=flag):
        cls(**kw)


def test_options_are_validated():
    for bad in (dict(channels=0), dict(chunk_bytes=0), dict(checksum="crc"), dict(abort_cancel_s=0)):
        with pytest.raises(ValueError):
            GrpcOptions(**bad)
    with pytest.raises(ValueError):
        DistOptions(layers_per_message=0)
    with pytest.raises(ValueError):
        IpcOptions(slots=0)


def test_transport_enum_matches_the_proto():
    from proto import kvtransfer_pb2 as pb
    for t in registry.Transport:
        if t is not registry.Transport.FAKE:
            assert pb.Transport.Name(t.proto) == f"TRANSPORT_{t.name}"
            assert registry.Transport.from_proto(t.proto) is t


def test_transport_modules_do_not_import_transformers():
    code = ("import sys; import kvtransfer.transport.grpc.backend, kvtransfer.transport.cuda_ipc.backend, "
            "kvtransfer.transport.fake, kvtransfer.transport.dist.backend, kvtransfer.transport.registry; "
            "bad = [m for m in ('transformers', 'kvtransfer.model.streaming') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_grpc_path_does_not_import_torch_distributed_backend():
    code = ("import sys; from kvtransfer.transport import registry; "
            "registry.receiver_link('grpc', 'cpu', address='127.0.0.1:0').close(); "
            "assert 'kvtransfer.transport.dist.backend' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_receive_loop_fills_the_registered_destination():
    """expect(rid, n, destination=views of a pool): the frame lands in those views; others get fresh tensors."""
    r_link = registry.receiver_link("fake", "cpu", address="fake://loop", max_bytes=1 << 30)
    s_link = registry.sender_link("fake", "cpu", address="fake://loop")
    geom = CacheGeometry(num_layers=contract.LAYERS, kv_heads=contract.HEADS, head_dim=contract.DIM,
                         dtype=torch.float32)
    loop = ReceiveLoop(r_link, geom, torch.device("cpu"), finish_timeout_s=10)
    loop.start()
    pool = contract.Pool("cpu")
    h = contract.header(21, 7)
    exp = loop.expect(21, 7, destination=pool(h))
    other = loop.expect(22, 5)
    t = threading.Thread(target=lambda: [contract.send_all(s_link, x, "cpu") for x in (h, contract.header(22, 5))])
    t.start()
    got = exp.future.result(timeout=10)
    pool.check(h, got)
    fresh = other.future.result(timeout=10)
    assert all(contract.same(k, wk) for (k, _), (wk, _) in zip(fresh, contract.layers_for(contract.header(22, 5))))
    t.join(10)
    loop.retire("test over")
    r_link.close()


def test_a_frame_that_does_not_match_its_request_is_dropped():
    """The header-vs-geometry check: a frame of another length than its request expects fails that request
    (protocol) and never touches the memory the request registered."""
    r_link = registry.receiver_link("fake", "cpu", address="fake://mismatch", max_bytes=1 << 30)
    s_link = registry.sender_link("fake", "cpu", address="fake://mismatch")
    geom = CacheGeometry(num_layers=contract.LAYERS, kv_heads=contract.HEADS, head_dim=contract.DIM,
                         dtype=torch.float32)
    loop = ReceiveLoop(r_link, geom, torch.device("cpu"), finish_timeout_s=10)
    loop.start()
    pool = contract.Pool("cpu")
    exp = loop.expect(23, 7, destination=pool(contract.header(23, 7)))
    contract.send_all(s_link, contract.header(23, 6), "cpu")  # one token short
    with pytest.raises(Exception) as info:
        exp.future.result(timeout=10)
    assert getattr(info.value, "cause", None) == "protocol" and "expected 1 x 7 tokens" in str(info.value)
    assert bool((pool.pool == pool.SENTINEL).all()), "a mismatched frame wrote into the registered destination"
    assert loop.dropped == 1
    loop.retire("test over")


def test_a_slot_stays_held_while_a_late_frame_lands_in_it():
    """The receive loop holds the request's slot lease from the moment its frame starts landing until it stops,
    so a request that gives up meanwhile cannot have its slot handed to another request under the late frame."""
    from kvtransfer.engine.pool import KVPool

    r_link = registry.receiver_link("fake", "cpu", address="fake://late", max_bytes=1 << 30)
    s_link = registry.sender_link("fake", "cpu", address="fake://late")
    geom = CacheGeometry(num_layers=contract.LAYERS, kv_heads=contract.HEADS, head_dim=contract.DIM,
                         dtype=torch.float32)
    pool = KVPool(geom, torch.device("cpu"), slots=1, max_seq=16)
    loop = ReceiveLoop(r_link, geom, torch.device("cpu"), finish_timeout_s=10)
    loop.start()
    lease = pool.try_lease()
    h = contract.header(31, 7)
    exp = loop.expect(31, 7, destination=pool.views(lease.slot, 7), lease=lease)
    s = s_link.open(h)
    layers = contract.layers_for(h)
    s.send_layer(0, *layers[0])  # the frame starts landing
    deadline = time.monotonic() + 10
    while loop._landing is None and time.monotonic() < deadline:
        time.sleep(0.01)
    lease.release()  # the request lets go of its slot (it gave up, or ended) while its frame is mid-landing
    assert pool.used() == 1, "the slot was freed while a frame was still landing in it"
    for i in range(1, contract.LAYERS):
        s.send_layer(i, *layers[i])
    s.finish(timeout=10)
    while pool.used() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.used() == 0 and exp.future.result(timeout=10)  # let go once the frame stopped landing
    loop.retire("test over")
