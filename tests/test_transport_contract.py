"""Runs the contract scenarios (tests/contract.py) against every backend available here."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import threading

import pytest
import torch

import contract
from kvtransfer.transport import fake


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scenario", sorted(contract.SCENARIOS))
def test_fake(scenario):
    send, recv = contract.SCENARIOS[scenario]
    s_link, r_link = fake.pair()
    errors = []

    def sender():
        try:
            send(s_link, "cpu")
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    t = threading.Thread(target=sender)
    t.start()
    recv(r_link, "cpu")
    t.join(timeout=30)
    assert not errors, errors


def run_two_processes(backend: str, scenario: str, options: dict | None = None, timeout: float = 90) -> None:
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=contract.run_in_process, args=(backend, rank, address, scenario, options or {}, q, done))
             for rank in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, err = q.get(timeout=timeout)
            results[rank] = err
    except queue.Empty:
        pytest.fail(f"{backend}/{scenario}: a side did not finish in {timeout} s; got {results}")
    finally:
        done.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, err in sorted(results.items()):
        assert err is None, f"rank {rank} ({'sender' if rank == 0 else 'receiver'}) failed:\n{err}"


@pytest.mark.parametrize("scenario", sorted(contract.SCENARIOS))
def test_gloo(scenario):
    run_two_processes("gloo", scenario)


@pytest.mark.parametrize("per_msg", [3, 4])
def test_gloo_grouped_layers(per_msg):
    run_two_processes("gloo", "many", {"layers_per_message": per_msg})


@pytest.mark.parametrize("scenario", sorted(contract.SCENARIOS))
def test_grpc(scenario):
    run_two_processes("grpc", scenario)


def test_grpc_many_channels_small_chunks():
    run_two_processes("grpc", "many", {"channels": 3, "chunk_bytes": 1024})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scenario", sorted(contract.SCENARIOS))
def test_grpc_cuda(scenario):
    """Both sides on the GPU: staged D2H on the sender, pinned landing + H2D on the receiver."""
    run_two_processes("grpc", scenario, {"device": "cuda"})
