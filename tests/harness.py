"""Run a transport scenario's two halves: in two threads (in-process backends) or two real processes.

Why here: one free-port helper and one two-process harness for every transport test; both
sides build their links through the registry (kvtransfer.transport.registry), with the
options given, exactly as the servers do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import tempfile
import threading
import traceback

import torch

import contract
from kvtransfer.transport import registry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _links(backend: str, rank: int, address: str, options, dev):
    """This side's link; rank 0 sends, rank 1 receives. Process groups are joined here first."""
    b = registry.backend(backend)
    if b.rendezvous is registry.Rendezvous.PROCESS_GROUP:
        from kvtransfer.transport.dist import init_pair
        init_pair(rank, address, dev, timeout_s=30)
        address = ""
    if rank == 0:
        return registry.sender_link(backend, dev, options, address=address, connect_timeout_s=30)
    return registry.receiver_link(backend, dev, options, address=address, max_bytes=16 << 20,
                                  max_layers=contract.LAYERS)


def run_in_threads(backend: str, scenario: str, options=None, address: str = "") -> None:
    """Both halves in this process (fake; cuda_ipc with its CPU stand-in): the receiver here, the sender in a
    thread (its link is built there: a cuda_ipc sender's handshake needs the receiver's first accept)."""
    send, recv = contract.SCENARIOS[scenario]
    address = address or (f"unix:{tempfile.mkdtemp(prefix='kvt')}/s.sock" if backend == "cuda_ipc"
                          else f"{backend}://{scenario}")
    r_link = _links(backend, 1, address, options, torch.device("cpu"))
    errors = []

    def sender():
        try:
            send(_links(backend, 0, r_link.address or address, options, torch.device("cpu")), "cpu")
        except BaseException:  # surfaced by the assert below
            errors.append(traceback.format_exc())

    t = threading.Thread(target=sender)
    t.start()
    contract.DIE = lambda link: link.close()
    try:
        recv(r_link, "cpu")
    finally:
        t.join(timeout=60)
        r_link.close()
    assert not errors, errors[0]


def _child(backend: str, rank: int, address: str, scenario: str, options, devices, q, done) -> None:
    """One side: build its link, run its half, report, then stay alive until the parent has both reports
    (a sender's data may still be in flight), exit hard."""
    try:
        dev = torch.device(devices[rank])
        if dev.type == "cuda":
            dev = torch.device("cuda", dev.index or 0)  # "cuda" means the first GPU; set_device needs an index
            torch.cuda.set_device(dev)
        link = _links(backend, rank, address, options, dev)

        def die(_link):
            q.put((rank, None))
            q.close()
            q.join_thread()  # the report must leave before the process does
            os._exit(0)
        contract.DIE = die
        contract.SCENARIOS[scenario][rank](link, dev)
        q.put((rank, None))
    except BaseException:  # report everything to the parent; the child exits below either way
        q.put((rank, traceback.format_exc()))
    finally:
        done.wait(timeout=60)
        os._exit(0)


def run_two_processes(backend: str, scenario: str, options=None, device: str = "cpu", timeout: float = 90,
                      devices: tuple[str, str] | None = None) -> None:
    """devices: (sender's, receiver's), default both `device`."""
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    port = free_port()
    address = f"tcp://127.0.0.1:{port}" if registry.backend(backend).rendezvous is registry.Rendezvous.PROCESS_GROUP \
        else f"127.0.0.1:{port}"
    procs = [ctx.Process(target=_child, args=(backend, rank, address, scenario, options, devices or (device, device), q, done))
             for rank in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, err = q.get(timeout=timeout)
            results[rank] = err
    except queue.Empty:
        raise AssertionError(f"{backend}/{scenario}: a side did not finish in {timeout} s; got {results}") from None
    finally:
        done.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, err in sorted(results.items()):
        assert err is None, f"rank {rank} ({'sender' if rank == 0 else 'receiver'}) failed:\n{err}"

