"""Cases a mutation pass over code no earlier pass covered found untested: how the two workers meet
(kvtransfer/transport/rendezvous.py: the store's address, loopback binding, the reachability probe, the wait for
the peer, the group's options), the registry of transports (registry.py), the gRPC listener and its host landing
(grpc/listener.py, grpc/staging.py), cuda_ipc's CPU-side pieces (messages.py, channel.py, pool.py), the fake
backend (fake.py) and the xPyD launch plan (deploy/xpyd_plan.py). Each test here failed on a one-line change of
that code that the rest of the suite (the contract suite, test_registry.py, test_grpc_transport.py,
test_cuda_ipc_units.py, test_start_checks.py, test_loopback.py, test_deploy_launch.py, ...) let through; its
docstring names the change it kills.

Why these went unseen: the rendezvous runs in the suite only as two server processes or the contract harness's
pair, which reach its happy path (both sides up, loopback, no torchrun agent, no GLOO_SOCKET_IFNAME) and its one
scripted failure (a wrong port); every other branch (a refused probe retried, an abandoned or timed-out wait, the
per-operation timeout, an env:// address) needs a peer that misbehaves on cue. Here each is one call: the store
is a HashStore or a TCPStore on 127.0.0.1, torch's group constructors are stand-ins that record their arguments,
and the clock of the probe and of the wait is a fake one, so nothing waits on time. The listener, channel and
fake-link cases are single calls or one frame each, in process; the plan is read from `plan()`, nothing started.
Every socket is bound to 127.0.0.1; every wait is bounded by GUARD_S.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
import torch.distributed as dist

from bench.measure.launch import free_port
from decode_server.config import DecodeConfig
from deploy import xpyd_plan
from kvtransfer.transport import TransferError, TransferState, fake, registry, rendezvous
from kvtransfer.transport.cuda_ipc import channel as ipc_channel
from kvtransfer.transport.cuda_ipc import messages as msg
from kvtransfer.transport.cuda_ipc.pool import HeldSlots, SlotPool, check_fits
from kvtransfer.transport.dist.backend import IDLE_WAIT_S
from kvtransfer.transport.grpc import frames as wire
from kvtransfer.transport.grpc import staging
from kvtransfer.transport.grpc.listener import _TOMBSTONES, ReceiverLink
from kvtransfer.transport.options import Checksum, FakeOptions
from prefill_server.config import PrefillConfig
from support import contract
from support.contract import expect_error
from test_loopback import listening

GUARD_S = 30  # a wait still not over after this long is a hang


def in_thread(fn):
    """Run `fn` on a thread bounded by GUARD_S (a mutant may hang it): its result, or what it raised."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # handed to the caller
            out.append(("raised", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(GUARD_S)
    assert out, f"still running after {GUARD_S} s"
    return out[0]


class FakeClock:
    """rendezvous's `time`: monotonic() reads it, sleep() advances it (bounded: an endless loop fails)."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps += 1
        assert self.sleeps < 10_000, "looping without end"
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(rendezvous, "time", c)
    return c


# --- the store's address and socket (rendezvous.py) ---


def test_a_tcp_rendezvous_needs_a_port_and_env_takes_master_addr_and_a_numeric_port(monkeypatch):
    """tcp://HOST without a port is refused (kills dropping `not u.port`: the store was opened at port None);
    env:// takes MASTER_ADDR as given (kills returning 127.0.0.1 whatever it says) and refuses a MASTER_PORT that
    is no number with the flag's own message (kills dropping `port.isdigit()`: a bare int() ValueError)."""
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        rendezvous.store_address("tcp://127.0.0.1")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rendezvous.store_address("env://") == ("10.1.2.3", 29500)
    monkeypatch.setenv("MASTER_PORT", "29x")
    with pytest.raises(ValueError, match="needs MASTER_ADDR and MASTER_PORT"):
        rendezvous.store_address("env://")


def test_the_store_listens_on_the_rendezvous_address_only():
    """Rank 0's store listens at 127.0.0.1:PORT and nowhere else (kills binding the store's socket to 0.0.0.0,
    and dropping master_listen_fd: torch's TCPStore then listens on every interface)."""
    port = free_port()
    store = rendezvous.open_store(f"tcp://127.0.0.1:{port}", 0, GUARD_S)
    try:
        mine = [a for a in listening(os.getpid()) if a[1] == port]
        assert mine == [("127.0.0.1", port)], mine
    finally:
        del store


def test_a_port_already_taken_is_a_one_line_runtime_error():
    """A rendezvous port another process listens on: RuntimeError 'cannot listen at HOST:PORT' (kills re-raising
    the bare OSError, which the servers' start does not turn into one line)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen at 127.0.0.1:{port}"):
            rendezvous._listening_socket("127.0.0.1", port)


def test_a_store_that_fails_to_start_gives_its_socket_back(monkeypatch):
    """When TCPStore refuses to start, the bound socket is closed, so the next try can bind the port (kills
    dropping os.close(fd): the port stayed taken by a socket nobody owned until the process exited)."""
    def broken(*a, **kw):
        raise RuntimeError("store refused")
    monkeypatch.setattr(rendezvous.dist, "TCPStore", broken)
    port = free_port()
    with pytest.raises(RuntimeError, match="store refused"):
        rendezvous.open_store(f"tcp://127.0.0.1:{port}", 0, GUARD_S)
    os.close(rendezvous._listening_socket("127.0.0.1", port))


def test_under_torchruns_agent_rank_0_connects_to_the_agents_store(monkeypatch):
    """TORCHELASTIC_USE_AGENT_STORE=True: the agent hosts the store, so rank 0 connects as a client (kills
    dropping `or agent`: rank 0 tried to host a second store on the agent's port and failed to start)."""
    port = free_port()
    host = rendezvous.open_store(f"tcp://127.0.0.1:{port}", 0, GUARD_S)  # the agent's store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    client = rendezvous.open_store(f"tcp://127.0.0.1:{port}", 0, GUARD_S)
    client.set("from-rank-0", b"1")
    assert host.get("from-rank-0") == b"1"


# --- the reachability probe ---


def test_a_refused_probe_is_retried_with_a_bounded_connect_timeout(monkeypatch, clock):
    """A refused connection is tried again until one is accepted (kills the retry test turned around: the first
    refusal ended the pairing, though the two sides of a pair start together); each connect waits at most
    PROBE_TIMEOUT_S however long --dist-timeout-s is (kills passing the whole timeout to one connect)."""
    calls = []

    def connect(addr, timeout):
        calls.append((addr, timeout))
        if len(calls) < 3:
            raise ConnectionRefusedError(111, "Connection refused")
        return SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(rendezvous, "socket", SimpleNamespace(create_connection=connect))
    rendezvous.check_reachable("127.0.0.1", 5, 600.0)
    assert calls == [(("127.0.0.1", 5), rendezvous.PROBE_TIMEOUT_S)] * 3


def test_a_rendezvous_nobody_answers_is_rendezvous_unreachable_at_its_deadline(monkeypatch, clock):
    """Refused until the deadline: RendezvousUnreachable naming the address (kills raising a plain RuntimeError,
    which the decode worker retries as a pairing failure instead of exiting on a wrong --dist-init)."""
    def refuse(addr, timeout):
        raise ConnectionRefusedError(111, "Connection refused")
    monkeypatch.setattr(rendezvous, "socket", SimpleNamespace(create_connection=refuse))
    with pytest.raises(rendezvous.RendezvousUnreachable, match="tcp://127.0.0.1:5 .* within 3 s"):
        rendezvous.check_reachable("127.0.0.1", 5, 3.0)
    assert clock.sleeps >= 2


# --- gloo's address and options ---


def test_the_local_address_is_the_source_address_and_none_for_a_wildcard():
    """Toward 127.0.0.2 this host speaks from 127.0.0.1 (kills returning the rendezvous host itself, an address
    gloo could not bind); a wildcard rendezvous gives None, gloo's own choice (kills dropping the is_unspecified
    check: gloo bound to loopback behind a 0.0.0.0 rendezvous, out of reach of a peer on another host)."""
    assert rendezvous.local_address("127.0.0.2") == "127.0.0.1"
    assert rendezvous.local_address("0.0.0.0") is None


@pytest.fixture
def fake_gloo(monkeypatch):
    """rendezvous.dist with a ProcessGroupGloo whose options and devices are plain records."""
    gloo = SimpleNamespace(_Options=SimpleNamespace, create_device=lambda **kw: ("device", kw),
                           create_default_device=lambda: ("default",))
    monkeypatch.setattr(rendezvous, "dist", SimpleNamespace(ProcessGroupGloo=gloo))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)


def test_gloo_options_carry_the_timeout_and_bind_where_the_rendezvous_says(fake_gloo, monkeypatch):
    """The options carry the given timeout (kills dropping `_timeout`: gloo's default of 30 minutes ruled every
    operation); the device is bound to this host's address toward the rendezvous (kills skipping local_address:
    gloo's default device, whatever the host name resolves to); GLOO_SOCKET_IFNAME, when set, names the
    interfaces (kills ignoring it)."""
    timeout = datetime.timedelta(seconds=7)
    opts = rendezvous.gloo_options("127.0.0.2", timeout)
    assert opts._timeout == timeout
    assert opts._devices == [("device", {"hostname": "127.0.0.1"})]
    assert rendezvous.gloo_options("0.0.0.0", timeout)._devices == [("default",)]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth7")
    assert rendezvous.gloo_options("127.0.0.1", timeout)._devices == [("device", {"interface": "lo"}),
                                                                      ("device", {"interface": "eth7"})]


def test_each_pairing_has_a_prefix_of_its_own():
    """Another epoch or another prefill instance is another prefix (kills leaving the epoch out: a new pairing's
    join found the old pairing's "here" word and went on without its peer)."""
    prefixes = {rendezvous.pairing_prefix(i, e) for i in (1, 2) for e in (0, 1)}
    assert len(prefixes) == 4


# --- the wait for the peer ---


def test_a_join_goes_on_once_the_peer_said_here():
    """The peer's word is under the other rank; this side's own under its rank."""
    store = dist.HashStore()
    store.set("here/1", b"1")
    rendezvous.wait_for_peer(store, 0, GUARD_S, lambda: False)
    assert store.check(["here/0"])


def test_a_join_whose_peer_never_comes_is_abandoned_or_times_out(clock):
    """Alone, an abandoned join raises PairingAbandoned (kills writing this side's word under the peer's rank: it
    found its own word and joined a group nobody else was in; and kills ignoring `abandoned()`: a stopping server
    waited out --dist-timeout-s); not abandoned, it fails at its deadline naming the flag (kills dropping the
    deadline: it waited for ever)."""
    with pytest.raises(rendezvous.PairingAbandoned):
        rendezvous.wait_for_peer(dist.HashStore(), 0, 5.0, lambda: True)
    with pytest.raises(RuntimeError, match=r"within 5 s \(--dist-timeout-s\)"):
        rendezvous.wait_for_peer(dist.HashStore(), 1, 5.0, lambda: False)


@pytest.fixture
def recorded_groups(monkeypatch):
    """join_pair with torch's group constructors replaced by records of their arguments; the wait is skipped."""
    seen: dict = {}

    class NcclOptions:
        _timeout = None

    class Nccl:
        Options = NcclOptions

        def __init__(self, store, rank, size, opts):
            seen["nccl"] = (rank, size, opts._timeout)

        def eager_connect_single_device(self, device):
            seen["eager"] = device

    monkeypatch.setattr(rendezvous, "dist", SimpleNamespace(
        PrefixStore=lambda prefix, store: (prefix, store),
        ProcessGroupGloo=lambda store, rank, size, opts: ("gloo", store, rank, size, opts),
        ProcessGroupNCCL=Nccl))
    monkeypatch.setattr(rendezvous, "wait_for_peer", lambda store, rank, timeout_s, abandoned: None)
    monkeypatch.setattr(rendezvous, "gloo_options", lambda host, timeout: (host, timeout))
    return seen


def test_a_gloo_pair_gets_the_rendezvous_timeout_or_op_timeout_and_the_rendezvous_host(recorded_groups):
    """On CPU a group operation's timeout is the join's timeout (kills swapping it with IDLE_WAIT_S: a week),
    --dist-op-timeout-s overrides it (kills ignoring op_timeout_s), and gloo binds toward the rendezvous host
    (kills passing no host)."""
    cpu = torch.device("cpu")
    got = rendezvous.join_pair(1, "store", "p/", cpu, 7.0, rendezvous_host="127.0.0.1")
    assert got == ("gloo", ("p/", "store"), 1, 2, ("127.0.0.1", datetime.timedelta(seconds=7)))
    got = rendezvous.join_pair(0, "store", "p/", cpu, 7.0, op_timeout_s=3.0, rendezvous_host="127.0.0.1")
    assert got[-1] == ("127.0.0.1", datetime.timedelta(seconds=3))


def test_an_nccl_pair_gets_idle_wait_or_op_timeout_and_connects_at_once(recorded_groups):
    """On CUDA operations get IDLE_WAIT_S, not the join's timeout (kills the swap: the watchdog tore down an idle
    pair after --dist-timeout-s), and the communicator is built at the join (kills skipping
    eager_connect_single_device: the first transfer paid for it)."""
    dev = torch.device("cuda", 0)
    rendezvous.join_pair(0, "store", "p/", dev, 7.0)
    assert recorded_groups["nccl"] == (0, 2, datetime.timedelta(seconds=IDLE_WAIT_S))
    assert recorded_groups["eager"] == dev
    rendezvous.join_pair(0, "store", "p/", dev, 7.0, op_timeout_s=9.0)
    assert recorded_groups["nccl"] == (0, 2, datetime.timedelta(seconds=9))


def test_leaving_an_nccl_pair_aborts_its_group(monkeypatch):
    """leave_pair aborts an NCCL group (kills dropping abort(): a thread blocked on a dead peer stayed blocked)
    and leaves anything else alone."""
    class Nccl:
        aborted = 0

        def abort(self):
            type(self).aborted += 1
    monkeypatch.setattr(dist, "ProcessGroupNCCL", Nccl, raising=False)
    rendezvous.leave_pair(None)
    rendezvous.leave_pair(SimpleNamespace())
    rendezvous.leave_pair(Nccl())
    assert Nccl.aborted == 1


# --- the registry (registry.py) ---


def test_from_proto_maps_each_transport_back_and_nothing_else():
    """Every transport's number maps back to it, the last one too (kills `value < len`), and 0 (unspecified) or
    past the end is None (kills `0 <= value`: an unspecified transport read as fake)."""
    for t in registry.Transport:
        assert registry.Transport.from_proto(t.proto) is t
    assert registry.Transport.from_proto(0) is None
    assert registry.Transport.from_proto(len(registry.Transport) + 1) is None


def test_an_unknown_transport_name_lists_the_known_ones():
    """backend('pigeon') is a ValueError naming every transport (kills dropping the except: the enum's own
    "'pigeon' is not a valid Transport")."""
    with pytest.raises(ValueError, match="unknown transport 'pigeon'; choose one of nccl, gloo, grpc, cuda_ipc, fake"):
        registry.backend("pigeon")


def test_the_servers_cannot_be_given_the_fake_transport():
    """resolve() takes only what --transport accepts (kills letting 'fake' through: a server on an in-process
    link that no peer can reach)."""
    with pytest.raises(ValueError, match="choose one of auto, nccl, gloo, grpc, cuda_ipc"):
        registry.resolve("fake", "cpu")


def test_a_transport_that_meets_by_address_needs_one():
    """A sender link of a non-process-group transport without an address is refused at once (kills checking only
    Rendezvous.ADDRESS: the fake link failed later as 'no fake receiver')."""
    with pytest.raises(ValueError, match="needs the receiver's address"):
        registry.sender_link("fake", "cpu")


def test_each_backends_flags_reach_its_options():
    """--grpc-listener-workers, --dist-op-timeout-s and --ipc-slot-timeout-s set to something else than their
    defaults reach the options (kills dropping each from its backend's flag list: the flag was then refused as
    another backend's, or silently ignored)."""
    assert registry.options_from(DecodeConfig(transport="grpc", grpc_listener_workers=8), "grpc").listener_workers == 8
    assert registry.options_from(PrefillConfig(transport="gloo", dist_op_timeout_s=5.0), "gloo").op_timeout_s == 5.0
    assert registry.options_from(PrefillConfig(transport="cuda_ipc", ipc_slot_timeout_s=7.0),
                                 "cuda_ipc").slot_timeout_s == 7.0


def test_the_data_planes_tls_key_reaches_the_grpc_options(tmp_path):
    """--data-tls-key reaches GrpcOptions.tls_key (kills dropping it from the grpc flag list: the listener got a
    certificate without its key)."""
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("c")
    key.write_text("k")
    config = DecodeConfig(transport="grpc", data_tls_cert=str(cert), data_tls_key=str(key))
    assert registry.options_from(config, "grpc").tls_key == str(key)


def test_a_default_value_given_again_is_no_other_backends_flag():
    """A flag of another backend given its default value (an equal float, not the same object) is accepted (kills
    comparing with `is not`: `--dist-op-timeout-s 0` on a grpc server was refused)."""
    config = PrefillConfig(transport="grpc", dist_op_timeout_s=float("0.0"))
    assert registry.options_from(config, "grpc").channels == 4


# --- the gRPC listener and its landing (grpc/listener.py, grpc/staging.py) ---


def test_a_listener_by_default_is_on_loopback_only():
    """ReceiverLink() listens on 127.0.0.1 (kills a default of 0.0.0.0: the data plane on every interface)."""
    link = ReceiverLink()
    try:
        assert link.address == f"127.0.0.1:{link.port}"
        mine = [a for a in listening(os.getpid()) if a[1] == link.port]
        assert mine and all(a[0] == "127.0.0.1" for a in mine), mine
    finally:
        link.close()


def test_accept_times_out_as_timeout_and_a_closed_link_says_so_every_time():
    """No request within the timeout: TransferError('timeout') (kills 'peer': the receive loop took an idle link
    for a dead one); once closed, every accept says 'receiver link closed' (kills not putting the mark back: the
    second accept waited out its timeout)."""
    link = ReceiverLink()
    expect_error(lambda: link.accept(timeout=0.05), "timeout")
    link.close()
    for _ in range(2):
        kind, got = in_thread(lambda: link.accept(timeout=GUARD_S))
        assert kind == "raised" and isinstance(got, TransferError) and got.cause == "peer", got
        assert "receiver link closed" in str(got)


def test_a_closed_listener_takes_no_new_request():
    """A stream that arrives after close() is refused 'peer' (kills dropping the `_closed` check: a request was
    created and queued on a link nobody accepts from)."""
    link = ReceiverLink()
    link.close()
    head = wire.parse_header(wire.header_message(contract.header(1, 3), link_id=1, seq=0, checksum=Checksum.NONE,
                                                 streams=1, index=0))
    expect_error(lambda: link._attach(head), "peer")
    assert not link._requests


def test_a_listener_on_a_port_already_taken_is_a_value_error():
    """A data-plane address already in use: ValueError 'cannot listen on ADDRESS' (kills re-raising grpc's
    RuntimeError, which the decode worker's start does not report as a bad flag)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        address = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(ValueError, match=f"cannot listen on {address}"):
            ReceiverLink(address)


def test_the_listener_remembers_exactly_its_tombstones():
    """_TOMBSTONES ended requests are remembered, the oldest dropped first (kills an off-by-one that kept one
    fewer)."""
    link = ReceiverLink()
    try:
        for i in range(_TOMBSTONES + 5):
            link._retire((1, i), TransferError("protocol", "ended"))
        assert len(link._requests) == _TOMBSTONES and (1, 5) in link._requests and (1, 4) not in link._requests
    finally:
        link.close()


def test_wait_event_gives_up_when_told_to_stop():
    """A CUDA event that never completes: wait_event returns False once stop() says so (kills dropping the
    stop check: an aborted request's shipping thread polled for ever)."""
    never = SimpleNamespace(query=lambda: False)
    assert in_thread(lambda: staging.wait_event(never, lambda: True)) == ("ok", False)


def test_a_cpu_landing_places_layers_landed_before_and_after_bind():
    """On CPU with a provider's destination: a layer whose bytes were in before accept is placed at bind (kills
    skipping landed layers at bind), one that lands after is placed when it lands (kills skipping delivery after
    bind), and a provider's refusal is returned, not placed (kills dropping the error)."""
    h = contract.header(3, 5)
    want = contract.layers_for(h)
    landing = staging.Landing(h, torch.device("cpu"))
    flat = torch.from_numpy(landing.flat)
    for i in (0, 1):
        flat[i * landing.layer_bytes:(i + 1) * landing.layer_bytes] = torch.stack(want[i]).contiguous().view(-1) \
            .view(torch.uint8)
    landing.land(0)
    dest = [(torch.zeros(h.layer_shape()), torch.zeros(h.layer_shape())) for _ in range(h.num_layers)]
    assert landing.bind(lambda hdr: dest) is None
    landing.land(1)
    for i in (0, 1):
        assert contract.same(dest[i][0], want[i][0]) and contract.same(dest[i][1], want[i][1]), i
    assert not dest[2][0].any()

    def refuse(hdr):
        raise TransferError("protocol", "no room")
    err = staging.Landing(h, torch.device("cpu")).bind(refuse)
    assert isinstance(err, TransferError) and err.cause == "protocol"


# --- cuda_ipc on CPU (messages.py, channel.py, pool.py) ---


def test_a_hello_of_another_role_or_version_is_refused():
    """check_hello compares magic, version and role (kills leaving the role out: a sender talked to a sender;
    and leaving the version out: a peer of another protocol was taken)."""
    ok = msg.Hello(msg.MAGIC, msg.VERSION, msg.ROLE_SENDER, 1, b"GPU-1")
    ipc_channel.check_hello(ok, msg.ROLE_SENDER)
    expect_error(lambda: ipc_channel.check_hello(ok, msg.ROLE_RECEIVER), "protocol")
    other = msg.Hello(msg.MAGIC, msg.VERSION + 1, msg.ROLE_SENDER, 1, b"GPU-1")
    expect_error(lambda: ipc_channel.check_hello(other, msg.ROLE_SENDER), "protocol")


def test_a_handshake_step_times_out_as_timeout_and_refuses_the_wrong_message():
    """expect(): nothing by the deadline is 'timeout' (kills 'protocol'); another message than the step's is
    'protocol' (kills dropping the type check: a Pool was read as a Hello)."""
    a, b = socket.socketpair()
    tx, rx = ipc_channel.Channel(a), ipc_channel.Channel(b)
    try:
        expect_error(lambda: ipc_channel.expect(rx, msg.Ready, time.monotonic(), "ready"), "timeout")
        tx.send(msg.Pool(1, 2, 3))
        expect_error(lambda: ipc_channel.expect(rx, msg.Hello, time.monotonic() + GUARD_S, "hello"), "protocol")
    finally:
        tx.close()
        rx.close()


def test_a_control_address_needs_a_host_and_a_stale_socket_file_is_replaced(tmp_path):
    """tcp://:PORT is refused (kills dropping `not host`: the control channel bound every interface); a file
    left at a unix socket's path is replaced (kills skipping the unlink: the receiver could not start again)."""
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        ipc_channel.listen("tcp://:0")
    path = tmp_path / "s.sock"
    path.write_text("stale")
    sock, address = ipc_channel.listen(f"unix:{path}")
    sock.close()
    assert address == f"unix:{path}"


def test_control_connections_time_out_as_timeout_and_tcp_ones_send_at_once(tmp_path):
    """accept() with no sender by its deadline is 'timeout' (kills 'peer'); connect() to nobody past its deadline
    is 'timeout' (kills dropping the deadline: it retried for ever); TCP control sockets set TCP_NODELAY (kills
    dropping it: every 17-byte 'landed' message waited on Nagle)."""
    listener, address = ipc_channel.listen("tcp://127.0.0.1:0")
    try:
        expect_error(lambda: ipc_channel.accept(listener, time.monotonic()), "timeout")
        kind, got = in_thread(lambda: ipc_channel.connect(f"unix:{tmp_path}/nobody.sock", time.monotonic()))
        assert kind == "raised" and isinstance(got, TransferError) and got.cause == "timeout", got
        out = ipc_channel.connect(address, time.monotonic() + GUARD_S)
        inn = ipc_channel.accept(listener, time.monotonic() + GUARD_S)
        for s in (out, inn):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            s.close()
    finally:
        listener.close()


def test_a_request_of_exactly_a_slot_and_its_events_fits_and_empty_fields_do_not():
    """check_fits: num_layers == max_layers and bytes == slot_bytes fit (kills `>=` in either); a zero field is
    refused (kills `< 0`)."""
    h = contract.header(1, 5)
    check_fits(h, h.total_bytes(), h.num_layers)
    expect_error(lambda: check_fits(contract.header(1, 0), 1 << 20, 64), "protocol")


def test_a_pool_needs_a_slot_and_keeps_its_first_failure():
    """SlotPool(0) is refused (kills `slots < 0`); the first failure is the one waiters see (kills overwriting it
    with a later, secondary one)."""
    with pytest.raises(ValueError):
        SlotPool(0)
    pool = SlotPool(1)
    pool.acquire(1, 0)
    pool.fail(TransferError("peer", "first"))
    pool.fail(TransferError("protocol", "second"))
    err = expect_error(lambda: pool.acquire(2, 0), "peer")
    assert "first" in str(err)


def test_an_early_release_after_the_sender_is_done_marks_nothing_given_up():
    """The receiver releasing early a request whose sender already ended leaves gave_up clear (kills marking it:
    the sender's next request in that slot read the mark as its own abort)."""
    pool = SlotPool(1)
    pool.acquire(7, 0)
    pool.sender_done(0)
    pool.released(0, 7, early=True)
    assert pool.gave_up == [None]


def test_freeing_a_slot_for_another_request_keeps_it_held():
    """HeldSlots.free(slot, other request) is False and the slot stays held (kills comparing the slot only: a late
    release of an old request freed the new one's cache)."""
    held = HeldSlots(1)
    held.hold(0, 5)
    assert not held.free(0, 4)
    assert held.held() == {0: 5}


# --- the fake backend (fake.py) ---


def test_a_closed_fake_link_refuses_at_once():
    """accept on a closed fake receiver link is 'peer' at once (kills waiting out the timeout), and opening a
    sender toward it is 'peer' (kills queueing a request nobody will take)."""
    s_link, r_link = fake.pair()
    r_link.close()
    kind, got = in_thread(lambda: r_link.accept(timeout=GUARD_S))
    assert kind == "raised" and isinstance(got, TransferError) and got.cause == "peer", got
    expect_error(lambda: s_link.open(contract.header(1, 3)), "peer")


def test_a_fake_header_over_the_limit_fails_its_sender_too():
    """A frame the fake receiver refuses (over max_bytes) tells its sender through the back channel (kills dropping
    gave_up.set(): the sender 'succeeded' into a receiver that had refused)."""
    wire = fake.FakeWire()
    s_link, r_link = fake.SenderLink(wire), fake.ReceiverLink(wire, max_bytes=64)
    s = s_link.open(contract.header(1, 3))
    expect_error(lambda: r_link.accept(timeout=GUARD_S), "protocol")
    assert s.status() == TransferState.FAILED


@pytest.mark.parametrize("drop", [0, 2])
def test_a_fake_link_that_drops_layers_delivers_exactly_that_many_and_no_trailer(drop):
    """drop_after_layers=N: layers 0..N-1 arrive, none after, and no trailer, so the receiver times out as a dead
    peer would (kills `<=`: one layer more arrived; kills `<= 0` for off: 0 dropped nothing; kills sending the
    trailer anyway: a protocol failure instead of a timeout)."""
    r_link = registry.receiver_link("fake", "cpu", address=f"fake://drop-{drop}", max_bytes=1 << 20)
    s_link = registry.sender_link("fake", "cpu", FakeOptions(drop_after_layers=drop), address=f"fake://drop-{drop}")
    h = contract.header(1, 3)
    s = s_link.open(h)
    for i, (k, v) in enumerate(contract.layers_for(h)):
        s.send_layer(i, k, v)
    s.finish(timeout=GUARD_S)
    r = r_link.accept(timeout=GUARD_S)
    for i in range(drop):
        r.wait_for_layer(i, timeout=GUARD_S)
    expect_error(lambda: r.wait_for_layer(drop, timeout=0.1), "timeout")


def test_a_fake_frame_with_a_layer_twice_or_missing_at_its_trailer_is_protocol():
    """A layer that arrives twice in an otherwise whole frame (kills dropping the `_landed[tag]` check: the second
    copy overwrote the first and the frame succeeded), or an OK trailer with a layer missing (kills dropping the
    completeness check), fails the receiver as 'protocol'."""
    h = contract.header(1, 3)
    layers = contract.layers_for(h)
    s_link, r_link = fake.pair()
    s = s_link.open(h)
    s.send_layer(0, *layers[0])
    s._messages.put((0, *layers[0]))  # layer 0 again
    for i in range(1, h.num_layers):
        s.send_layer(i, *layers[i])
    s.finish(timeout=GUARD_S)
    r = r_link.accept(timeout=GUARD_S)
    expect_error(lambda: r.finish(timeout=GUARD_S), "protocol")

    s_link, r_link = fake.pair()
    s = s_link.open(h)
    s.send_layer(0, *layers[0])
    s._messages.put((fake._OK, None, None))  # a trailer with layers 1.. missing
    r = r_link.accept(timeout=GUARD_S)
    expect_error(lambda: r.finish(timeout=GUARD_S), "protocol")

def test_aborting_a_finished_fake_receiver_leaves_it_finished():
    """abort() after a successful finish keeps SUCCESS (kills failing it anyway: a late abort turned a delivered
    cache into a failure and told the sender it gave up)."""
    s_link, r_link = fake.pair()
    h = contract.header(1, 3)
    contract.send_all(s_link, h, "cpu")
    r = r_link.accept(timeout=GUARD_S)
    r.finish(timeout=GUARD_S)
    r.abort("late")
    assert r.status() == TransferState.SUCCESS


# --- the xPyD plan (deploy/xpyd_plan.py) ---


def _plan(*argv: str, gpus=lambda: 0):
    return xpyd_plan.plan(xpyd_plan.build_parser().parse_args(list(argv)), gpus=gpus)


def test_port_65535_is_a_port():
    """HOST:65535 is accepted (kills `>= 65535` in split_addr) and a --base-port layout may end at 65535 (kills
    `>= 65535` in Ports.take)."""
    assert xpyd_plan.split_addr("--router-listen", "127.0.0.1:65535") == ("127.0.0.1", 65535)
    assert xpyd_plan.Ports("127.0.0.1", 65535).take() == 65535


def test_auto_devices_deal_the_gpus_on_from_the_first_index():
    """auto: decode workers take the GPUs after the prefill workers' (kills starting every role at GPU 0: a prefill
    and a decode worker shared one GPU while another stood idle)."""
    assert xpyd_plan.deal("--device-decode", "auto", 2, 2, lambda: 4) == ["cuda:2", "cuda:3"]
    assert xpyd_plan.deal("--device-decode", "auto", 2, 3, lambda: 4) == ["cuda:3", "cuda:0"]


def test_the_metrics_ports_may_end_at_65535():
    """--metrics-base-port P with P+N+M == 65535 is accepted (kills an off-by-one refusing it)."""
    children = _plan("--prefill", "1", "--decode", "1", "--device-prefill", "cpu", "--device-decode", "cpu",
                     "--transport", "grpc", "--metrics-base-port", str(65535 - 2))
    assert children[-1].args[children[-1].args.index("--metrics-port") + 1] == "65535"


def test_a_router_port_on_a_rendezvous_port_is_refused():
    """--router-listen on the port the --base-port layout gives a rendezvous is refused (kills checking only the
    workers' doors: the router and a prefill worker's store fought for one port)."""
    with pytest.raises(xpyd_plan.Refused, match="router port 41002"):
        _plan("--prefill", "1", "--decode", "1", "--device-prefill", "cpu", "--device-decode", "cpu",
              "--transport", "gloo", "--base-port", "41000", "--router-listen", "127.0.0.1:41002")


def test_an_own_flag_given_as_flag_equals_value_is_refused():
    """--decode-args '--listen=0.0.0.0:1' is refused like '--listen 0.0.0.0:1' (kills matching the whole
    'NAME=VALUE' word: the worker bound every interface behind the launcher's back)."""
    assert xpyd_plan.own_flag(["--listen=0.0.0.0:1"], "decode") == "--listen"


def test_the_plans_refusals_of_tls_timeouts_and_mixed_devices(tmp_path):
    """A TLS decode worker needs --worker-tls-ca for the router (kills dropping that check); --check-tls-cert
    needs --check-tls-key (kills dropping it); --start-timeout-s 0 is refused (kills `< 0`); auto with cpu and
    cuda workers is refused (kills dropping it: gloo on one side, nccl on the other)."""
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cpu = ("--device-prefill", "cpu", "--device-decode", "cpu")
    with pytest.raises(xpyd_plan.Refused, match="give the router --worker-tls-ca"):
        _plan(*cpu, "--decode-args", "--tls-cert c.pem --tls-key k.pem", "--check-tls-ca", str(ca))
    with pytest.raises(xpyd_plan.Refused, match="go together"):
        _plan(*cpu, "--check-tls-cert", str(ca))
    with pytest.raises(xpyd_plan.Refused, match="--start-timeout-s must be > 0"):
        _plan(*cpu, "--start-timeout-s", "0")
    with pytest.raises(xpyd_plan.Refused, match="both cpu and cuda"):
        _plan("--device-prefill", "cpu", "--device-decode", "cuda:0")


def test_auto_on_gpus_turns_nvlink_multicast_off():
    """--transport auto (nccl on GPUs) sets NCCL_NVLS_ENABLE for every worker as nccl does (kills setting it for
    nccl only)."""
    children = _plan("--device-prefill", "cuda:0", "--device-decode", "cuda:1")
    assert all("NCCL_NVLS_ENABLE" in c.env for c in children if c.role != "router")


def test_a_message_of_an_unknown_kind_fails_its_grpc_request_as_protocol():
    """A data stream carrying a message of no known kind is refused: the sender's call fails naming it and the
    request fails 'protocol' (kills skipping it: the stream went on as if nothing had come)."""
    link = ReceiverLink()
    h = contract.header(4, 3)
    head = wire.header_message(h, link_id=1, seq=0, checksum=Checksum.NONE, streams=1, index=0)
    try:
        with grpc.insecure_channel(link.address) as ch:
            call = ch.stream_unary(wire.PUSH_PATH).future(iter([head, bytes((99, 0, 0))]), timeout=GUARD_S)
            r = link.accept(timeout=GUARD_S)
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=GUARD_S)
        assert "unknown message kind 99" in info.value.details(), info.value.details()
        expect_error(lambda: r.finish(timeout=GUARD_S), "protocol")
    finally:
        link.close()


def test_closing_a_grpc_listener_fails_its_requests_in_flight_as_closed():
    """close() fails every request still arriving with 'receiver link closed' (kills skipping them: a consumer
    waiting on one was told only later, and as a lost sender)."""
    link = ReceiverLink()
    h = contract.header(5, 3)
    head = wire.header_message(h, link_id=1, seq=0, checksum=Checksum.NONE, streams=1, index=0)
    hold = threading.Event()

    def stream():
        yield head
        hold.wait(GUARD_S)
    try:
        with grpc.insecure_channel(link.address) as ch:
            call = ch.stream_unary(wire.PUSH_PATH).future(stream(), timeout=GUARD_S)
            r = link.accept(timeout=GUARD_S)
            link.close()
            err = expect_error(lambda: r.finish(timeout=GUARD_S), "peer")
            assert "receiver link closed" in str(err), err
            hold.set()
            call.cancel()
    finally:
        hold.set()
        link.close()
