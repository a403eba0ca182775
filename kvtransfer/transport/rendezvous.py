"""Re-joinable process-group pairing for the servers: one long-lived store, one fresh two-rank group per pairing.

Why not `init_process_group(init_method=...)` each time: with tcp:// the prefill (rank 0)
would host a new TCPStore per pairing on the same port, while the old one may still be
held by a thread blocked in the dead group; and a group whose peer died, or whose gloo
wait timed out, is closed for good. So the prefill opens the store once for its lifetime
(torchrun's agent hosts it under env:// when told so), and every pairing builds a new
group under a key prefix that names the pairing: (prefill instance id, epoch), exchanged
at the handshake.

Why groups of their own, not the default group: a prefill worker pairs with several decode
workers and a decode worker with several prefill workers (xPyD), one group per pair, so a
process holds several groups at once, each a two-rank ProcessGroupGloo / ProcessGroupNCCL
built on the pairing's prefixed store (0 the prefill side, 1 the decode side). The links
send and receive on their own group (kvtransfer/transport/dist/backend.py), so a thread of
an old pairing that wakes up fails in its old group and never touches a new one. Leaving
drops the group (NCCL: aborts it); a thread still blocked in it wakes when the peer's side
closes.

Why the store's socket is made here: torch's TCPStore server listens on every interface whatever host it is
given; handed a socket already bound to the --dist-init address (master_listen_fd), it listens there only, so
tcp://127.0.0.1:PORT stays on loopback. The gloo group's own listener is bound the same way: to this host's
address toward the rendezvous (GLOO_SOCKET_IFNAME, when set, still decides), not to whatever the host name
resolves to.

Why each side first says "here" under the prefix and waits for the other's word: a join that
blocked inside torch could not be abandoned (a superseded pairing, a server stopping), and it
held the prefill worker's device thread, and a stopping process, up to --dist-timeout-s. The
wait for the peer's word is a loop of short store waits that checks `abandoned()` between them;
only once both are there does torch build the group.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
from collections.abc import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from kvtransfer.transport.dist.backend import IDLE_WAIT_S


def store_address(init_method: str) -> tuple[str, int]:
    """HOST, PORT of the rendezvous: tcp://HOST:PORT, or env:// (MASTER_ADDR, MASTER_PORT)."""
    if init_method.startswith("tcp://"):
        u = urlparse(init_method)
        if not u.hostname or not u.port:
            raise ValueError(f"--dist-init {init_method!r}: expected tcp://HOST:PORT")
        return u.hostname, u.port
    if init_method.startswith("env://"):
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port or not port.isdigit():
            raise ValueError("--dist-init env:// needs MASTER_ADDR and MASTER_PORT (torchrun sets them); "
                             "or use tcp://HOST:PORT")
        return host, int(port)
    raise ValueError(f"--dist-init {init_method!r}: the servers re-pair after a failure and need tcp://HOST:PORT "
                     "or env://")


LISTEN_BACKLOG = 128


def _listening_socket(host: str, port: int) -> int:
    """A socket bound to HOST:PORT only (not every interface) and listening; its file descriptor, now the caller's."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        s = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(f"cannot resolve {host}: {e}") from None
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(LISTEN_BACKLOG)
    except OSError as e:
        s.close()
        raise RuntimeError(f"cannot listen at {host}:{port}: {e.strerror or e}") from None
    return s.detach()


class RendezvousUnreachable(RuntimeError):
    """Nothing answers at the rendezvous address (a wrong --dist-init port or host, or its host is gone)."""


PROBE_TIMEOUT_S = 10.0  # the longest wait for the store's TCP connection to be accepted


PROBE_RETRY_S = 0.2  # a refused probe is tried again this often: the store's host may be a moment from listening


def check_reachable(host: str, port: int, timeout_s: float) -> None:
    """Raise RendezvousUnreachable, one line, unless a TCP connection to the store is accepted within `timeout_s`
    (a refused one is tried again every PROBE_RETRY_S: a pair's two sides may start together). Why a plain probe
    first: torch's client retries a refused connection for its whole timeout and logs a C++ trace at each try."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(timeout_s, PROBE_TIMEOUT_S)).close()
            return
        except OSError as e:
            if time.monotonic() + PROBE_RETRY_S >= deadline:
                raise RendezvousUnreachable(f"nothing answers at the rendezvous tcp://{host}:{port} (--dist-init) "
                                            f"within {timeout_s:g} s: {e.strerror or e}") from None
            time.sleep(PROBE_RETRY_S)


def open_store(init_method: str, rank: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store (unless torchrun's agent does), listening at the --dist-init address only; rank 1
    connects to it (RendezvousUnreachable when nothing answers there). Does not wait for the peer."""
    host, port = store_address(init_method)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's contract, not our config
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0 or agent:
        check_reachable(host, port, timeout_s)
        return dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    fd = _listening_socket(host, port)
    try:
        return dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def local_address(host: str) -> str | None:
    """This host's address toward `host` (the rendezvous): the source address its packets would leave from. None
    for a wildcard host (0.0.0.0, ::) or one that does not resolve: then gloo's own choice stands."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
        if ipaddress.ip_address(addr[0]).is_unspecified:
            return None
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: no packet sent, only the route chosen
            return s.getsockname()[0]
    except (OSError, ValueError):
        return None


def gloo_options(rendezvous_host: str, timeout: datetime.timedelta):
    """A gloo group's options: its operations' timeout, and its device bound to this host's address toward the
    rendezvous (loopback for a loopback rendezvous) unless GLOO_SOCKET_IFNAME names the interface."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]  # as torch reads it
    if interfaces:
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in interfaces]
    elif local := local_address(rendezvous_host):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts


def pairing_prefix(instance_id: int, epoch: int) -> str:
    return f"kvt/{instance_id:x}/{epoch}/"


PEER_POLL_S = 0.1  # how often a join waiting for its peer looks for it, and whether it was abandoned


class PairingAbandoned(RuntimeError):
    """The join was given up before the peer came (superseded by a newer pairing, or the server is stopping)."""


def wait_for_peer(store: dist.Store, rank: int, timeout_s: float, abandoned: Callable[[], bool]) -> None:
    """Say "here" as `rank` under the pairing's store, then wait for the other rank's word: at most `timeout_s`,
    and never past `abandoned()` turning true (checked every PEER_POLL_S)."""
    store.set(f"here/{rank}", b"1")
    deadline = time.monotonic() + timeout_s
    while not store.check([f"here/{1 - rank}"]):  # a look, not a wait: a timed-out store wait logs a warning
        if abandoned():
            raise PairingAbandoned("the pairing was abandoned before the peer joined")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the peer did not join the process group within {timeout_s:g} s (--dist-timeout-s)")
        time.sleep(PEER_POLL_S)


def join_pair(rank: int, store: dist.Store, prefix: str, device: torch.device, timeout_s: float,
              op_timeout_s: float = 0.0, abandoned: Callable[[], bool] = lambda: False, rendezvous_host: str = ""):
    """A fresh two-rank group (0 prefill, 1 decode) under `prefix`, joined within `timeout_s`; returns it.
    `rendezvous_host`: the store's host (gloo binds its listener to this host's address toward it).

    NCCL's watchdog timeout is per operation from the moment it is enqueued, and the decode
    side keeps the next frame's header receive posted while idle: with the rendezvous
    timeout there, an idle pair would be torn down by the watchdog. So NCCL operations get
    IDLE_WAIT_S; request deadlines, the peer timeout and the keepalive detect a dead peer,
    and leaving the pairing aborts the communicator. `op_timeout_s` (DistOptions) overrides it (0: default).
    """
    op_timeout = datetime.timedelta(seconds=op_timeout_s or (IDLE_WAIT_S if device.type == "cuda" else timeout_s))
    pair_store = dist.PrefixStore(prefix, store)
    wait_for_peer(pair_store, rank, timeout_s, abandoned)
    if device.type != "cuda":
        return dist.ProcessGroupGloo(pair_store, rank, 2, gloo_options(rendezvous_host, op_timeout))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = op_timeout
    group = dist.ProcessGroupNCCL(pair_store, rank, 2, opts)
    if hasattr(group, "eager_connect_single_device"):  # the communicator now, not at the first transfer
        group.eager_connect_single_device(device)
    return group


def leave_pair(group) -> None:
    """Drop a pairing's group (None: nothing): NCCL's is aborted (no waiting on a dead peer); gloo's connections
    close once the last reference goes, which wakes the peer's side."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from a CPU build of torch
    if group is not None and nccl is not None and isinstance(group, nccl):
        group.abort()
