"""Run a transport scenario's two halves: in two threads (in-process backends) or two real processes.

Why here: every transport test starts its two sides the same way (the process plumbing is
bench/measure/twoproc.py's and the free port bench/measure/launch.py's, shared with the benches); both sides
build their links through the registry (kvtransfer.transport.registry), with the options
given, exactly as the servers do.

Why a fork server for CPU pairs: run_pair spawns a fresh interpreter per side, which imports torch and the
transports again (~4 s of a CI core each, two per scenario, dozens of scenarios). On CPU the sides are instead
forked from one server process per test worker that imported them once (multiprocessing's "forkserver": it
never ran torch or gRPC work, so nothing of either is live in it when it forks). Each side is still its own
process, with its own links, sockets and process group, and run_pair's reporting, timeouts and exit handling
are unchanged. GPU pairs keep spawn (a CUDA context must not be inherited).
"""

from __future__ import annotations

import tempfile
import threading
import traceback
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import torch

from bench.measure import twoproc
from bench.measure.launch import free_port
from bench.measure.twoproc import exit_now, run_pair
from kvtransfer.transport import registry
from support import contract, forked

__all__ = ["forked_pairs", "free_port", "run_in_threads", "run_two_processes"]


def _links(backend: str, rank: int, address: str, options, dev):
    """This side's link; rank 0 sends, rank 1 receives. Process groups are joined here first."""
    b, kw = registry.backend(backend), {}
    if b.rendezvous is registry.Rendezvous.PROCESS_GROUP:  # the servers' way: a store, a pairing's own group
        from kvtransfer.transport.rendezvous import join_pair, open_store
        kw["group"] = join_pair(rank, open_store(address, rank, 30), "contract/", dev, 30)
        address = ""
    if rank == 0:
        return registry.sender_link(backend, dev, options, address=address, connect_timeout_s=30, **kw)
    return registry.receiver_link(backend, dev, options, address=address, max_bytes=16 << 20,
                                  max_layers=contract.LAYERS, **kw)


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


def _side(rank: int, backend: str, address: str, scenario: str, options, devices) -> None:
    """One side in its own process: build its link, run its half; a receive half that dies exits hard."""
    dev = torch.device(devices[rank])
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)  # "cuda" means the first GPU; set_device needs an index
        torch.cuda.set_device(dev)
    link = _links(backend, rank, address, options, dev)
    contract.DIE = lambda _link: exit_now()
    contract.SCENARIOS[scenario][rank](link, dev)


def run_two_processes(backend: str, scenario: str, options=None, device: str = "cpu", timeout: float = 90,
                      devices: tuple[str, str] | None = None) -> None:
    """devices: (sender's, receiver's), default both `device`."""
    address = f"127.0.0.1:{free_port()}"
    if registry.backend(backend).rendezvous is registry.Rendezvous.PROCESS_GROUP:
        address = f"tcp://{address}"
    devices = devices or (device, device)
    args = (_side, (backend, address, scenario, options, devices), timeout)
    if any(torch.device(d).type != "cpu" for d in devices):
        run_pair(*args, what=f"{backend}/{scenario}")
        return
    with forked_pairs():
        run_pair(*args, what=f"{backend}/{scenario}")


def _forkserver(method: str):
    """run_pair's context on CPU: forked from the fork server that imported support.forked.PRELOAD (so torch, the
    transports, the contract, the p2p bench's side and the servers) once; `method` is the one run_pair asks for
    (spawn)."""
    assert method == "spawn", method
    return forked.context()


@contextmanager
def forked_pairs():
    """While in it, bench/measure/twoproc.run_pair forks its two CPU processes from the fork server instead of
    spawning two interpreters (the contract here; the p2p probes of the benches a test runs in its own process).
    Not for CUDA sides; tests/test_bench_stats.py checks run_pair itself as it is, spawning."""
    with mock.patch.object(twoproc, "mp", SimpleNamespace(get_context=_forkserver)):
        yield
