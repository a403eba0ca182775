"""cuda_ipc transport: the whole protocol on CPU; the contract on GPU (units: test_cuda_ipc_units.py).

The CPU half runs the real links over a real Unix socket with `LocalOps` (in-process
stand-ins for the CUDA handles and events), so the message protocol, the slot pool and the
state machine are tested here. The GPU half (marked gpu; skipped without CUDA) runs
tests/support/contract.py's scenarios in two real processes over CUDA IPC: cuda:0 -> cuda:0 always,
cuda:0 -> cuda:1 when two GPUs are visible. Run it with: python3 -m pytest tests/test_cuda_ipc.py -m gpu -s
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time

import pytest
import torch

from bench.measure.stats import summarize
from bench.measure.twoproc import run_pair
from kvtransfer.transport import TransferError, TransferHeader, TransferState
from kvtransfer.transport.cuda_ipc.backend import LocalOps, ReceiverLink, SenderLink
from kvtransfer.transport.options import IpcOptions
from support import contract
from support.harness import run_in_threads

SLOT_BYTES = 64 << 10  # contract requests need at most 4 x 2 x 2 x 64 x 8 x 4 B = 32 KiB


def expect_error(fn, cause: str) -> TransferError:
    with pytest.raises(TransferError) as info:
        fn()
    assert info.value.cause == cause, info.value
    return info.value


# --- the protocol end to end, CPU (LocalOps: two threads, one real socket) ---

@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="kvipc")  # short: AF_UNIX paths are limited to ~107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_local_contract_over_tcp():
    """The contract scenarios run over a Unix socket in test_transport_contract.py; TCP once here."""
    run_in_threads("cuda_ipc", "many", IpcOptions(slots=2, local_ops=True), address="tcp://127.0.0.1:0")


class Pair:
    """A receiver link here and a sender link built in a thread (the handshake needs both)."""

    def __init__(self, address: str, slots: int = 1, slot_timeout: float = 10.0):
        self.r = ReceiverLink("cpu", address, slot_bytes=SLOT_BYTES, slots=slots, max_layers=contract.LAYERS,
                              ops=LocalOps())
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(
            s=SenderLink("cpu", self.r.address, connect_timeout=10, slot_timeout=slot_timeout, ops=LocalOps())))
        t.start()
        self.r._connect(time.monotonic() + 10)
        t.join(timeout=10)
        self.s = box["s"]

    def send(self, h: TransferHeader) -> threading.Thread:
        t = threading.Thread(target=contract.send_all, args=(self.s, h, "cpu"))
        t.start()
        return t

    def close(self):
        self.s.close()
        self.r.close()


def wait_until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_slot_held_while_views_live_then_pool_recovers(sock_dir):
    p = Pair(f"unix:{sock_dir}/s.sock", slots=1, slot_timeout=0.3)
    h1, h2 = contract.header(1, 5), contract.header(2, 6)
    p.send(h1).join()
    r1 = p.r.accept(timeout=5)
    layers = r1.finish(timeout=5)
    del r1
    assert p.r.held.held() == {0: 1}  # the views in `layers` still hold the slot
    t0 = time.monotonic()
    expect_error(lambda: p.s.open(h2), "timeout")  # pool exhausted: one slot, held
    assert time.monotonic() - t0 < 2
    del layers  # the last view dies: RELEASE goes out
    wait_until(lambda: p.r.held.held() == {})
    t = p.send(h2)  # open() waits (slot_timeout) for that RELEASE to reach the sender's pool
    contract.recv_check(p.r, h2)
    t.join()
    p.send(contract.header(3, 4)).join()
    r3 = p.r.accept(timeout=5)
    kept = r3.finish(timeout=5)
    r3.release()  # explicit: the slot goes back although `kept` is still alive
    assert p.r.held.held() == {} and len(kept) == contract.LAYERS
    p.close()


def test_oversize_refused_before_anything_is_sent(sock_dir):
    p = Pair(f"unix:{sock_dir}/s.sock")
    too_long = contract.header(1, SLOT_BYTES)  # 4 layers x 2 x 2 heads x 64k tokens x 8 x 4 B
    err = expect_error(lambda: p.s.open(too_long), "protocol")
    assert "slot_bytes" in str(err)
    too_deep = TransferHeader(request_id=2, seq_len=1, num_layers=contract.LAYERS + 1, kv_heads=1, head_dim=1,
                              dtype=torch.float32)
    assert "max_layers" in str(expect_error(lambda: p.s.open(too_deep), "protocol"))
    expect_error(lambda: p.r.accept(timeout=0.2), "timeout")  # nothing reached the wire
    t = p.send(contract.header(3, 5))
    contract.recv_check(p.r, contract.header(3, 5))
    t.join()
    p.close()


def test_receiver_abort_stops_the_sender(sock_dir):
    p = Pair(f"unix:{sock_dir}/s.sock")
    h = contract.header(4, 6)
    layers = contract.layers_for(h)
    s = p.s.open(h)
    s.send_layer(0, *layers[0])
    r = p.r.accept(timeout=5)
    r.wait_for_layer(0, timeout=5)
    r.abort("client went away")
    assert r.status() == TransferState.FAILED
    wait_until(lambda: p.s.pool.gave_up[s.slot] == 4)
    expect_error(lambda: s.send_layer(1, *layers[1]), "aborted")
    assert s.status() == TransferState.FAILED
    t = p.send(contract.header(5, 3))  # the stale trailer is skipped, the slot is back
    contract.recv_check(p.r, contract.header(5, 3))
    t.join()
    p.close()


def test_dead_peer_is_reported_promptly(sock_dir):
    p = Pair(f"unix:{sock_dir}/s.sock")
    h = contract.header(6, 4)
    s = p.s.open(h)
    s.send_layer(0, *contract.layers_for(h)[0])
    r = p.r.accept(timeout=5)
    p.s.chan.close()  # the sender process "dies"
    t0 = time.monotonic()
    expect_error(lambda: r.finish(timeout=10), "peer")
    # the closed channel ends it, not finish's 10 s timeout (5 s: room for a busy machine, well short of 10)
    assert time.monotonic() - t0 < 5 and r.status() == TransferState.FAILED
    expect_error(lambda: p.r.accept(timeout=1), "peer")
    p.r.close()


# --- GPU: the contract in two real processes over CUDA IPC ---

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
PAIRS = [pytest.param((0, 0), id="cuda0-cuda0")]
if N_GPUS >= 2:
    PAIRS.append(pytest.param((0, 1), id="cuda0-cuda1", marks=pytest.mark.gpu2))
gpu = pytest.mark.skipif(N_GPUS == 0, reason="cuda_ipc needs a CUDA GPU (CPU machines run the LocalOps tests above)")

COST = dict(layers=28, kv_heads=4, head_dim=128, seq_len=1024, requests=30)  # Qwen2.5-7B shape, 1k, bf16


def _cost_header(rid: int) -> TransferHeader:
    return TransferHeader(request_id=rid, seq_len=COST["seq_len"], num_layers=COST["layers"],
                          kv_heads=COST["kv_heads"], head_dim=COST["head_dim"], dtype=torch.bfloat16)


def _cost_block(dev) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    h = _cost_header(1)
    return torch.randn((h.num_layers, 2, *h.layer_shape()), generator=g).to(torch.bfloat16).to(dev)


def _cost_send(link, dev) -> dict:
    """Per-layer host time of send_layer, K/V adjacent like StreamingCache's block."""
    block, per_layer = _cost_block(dev), []
    for rid in range(1, COST["requests"] + 1):
        s = link.open(_cost_header(rid))
        torch.cuda.synchronize(dev)
        for i in range(COST["layers"]):
            t0 = time.perf_counter()
            s.send_layer(i, block[i, 0], block[i, 1])
            per_layer.append(time.perf_counter() - t0)
        s.finish(timeout=30)
    warm = summarize(per_layer[5 * COST["layers"]:], scale=1e6)
    return {"send_layer_us_median": round(warm["median"], 2), "send_layer_us_p90": round(warm["p90"], 2), **COST}


def _cost_recv(link, dev) -> None:
    want = _cost_block(dev)
    for _ in range(COST["requests"]):
        got = link.accept(timeout=60).finish(timeout=30)
        assert all(torch.equal(k, want[i, 0]) and torch.equal(v, want[i, 1]) for i, (k, v) in enumerate(got))


def _gpu_side(rank, address, scenario, devices, slots):
    """Spawned: rank 0 sends (connects), rank 1 receives (listens)."""
    dev = torch.device("cuda", devices[rank])
    torch.cuda.set_device(dev)
    big = scenario == "host_cost"
    slot_bytes = _cost_header(0).layer_bytes() * COST["layers"] if big else SLOT_BYTES
    link = (SenderLink(dev, address, connect_timeout=60) if rank == 0 else
            ReceiverLink(dev, address, slot_bytes=slot_bytes, slots=slots, max_layers=COST["layers"]))
    if big:
        return (_cost_send if rank == 0 else _cost_recv)(link, dev)
    return contract.SCENARIOS[scenario][rank](link, dev)


def run_gpu(scenario: str, devices: tuple[int, int], slots: int = 2, timeout: float = 120) -> list:
    sock_dir = tempfile.mkdtemp(prefix="kvipc")
    try:
        return run_pair(_gpu_side, (f"unix:{sock_dir}/s.sock", scenario, devices, slots), timeout,
                        what=f"cuda_ipc/{scenario}")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("devices", PAIRS)
@pytest.mark.parametrize("scenario", sorted(contract.SCENARIOS))
def test_gpu_contract(scenario, devices):
    from support.harness import run_two_processes
    run_two_processes("cuda_ipc", scenario, IpcOptions(slots=2), devices=tuple(f"cuda:{d}" for d in devices),
                      timeout=120)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("devices", PAIRS)
def test_gpu_one_slot_reuse(devices):
    """Eight requests through one slot: every reuse waits for the release event of the last cache."""
    run_gpu("many", devices, slots=1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("devices", PAIRS)
def test_gpu_host_cost_report(devices):
    """Byte-exact 56 MiB caches, 30 times; prints the per-layer host cost as one JSON line (-s shows it)."""
    report = run_gpu("host_cost", devices)[0]
    print(json.dumps({"test": "cuda_ipc_host_cost", "devices": list(devices), **report}))
