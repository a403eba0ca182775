"""The pair through its own lifecycle (CPU, gloo, real processes): failed and abandoned pairings, one decode
worker per prefill worker, configs that cannot work refused at start, and stops that are graceful and prompt.

Why these: each was a way to wedge or kill a pair that the request-level tests never took. A pairing the
decode side abandons must leave the prefill worker ready for the next decode worker; a stop must free the
process (and its ports) within its grace, whatever the other side is doing.

Why some tests share servers: each start is ~10 s of a CI core. A test that only needs a serving default pair,
or a prefill worker no decode worker ever paired with, takes the module's (`Shared`, started at first use, and
again if a test left it dead or not serving); a test that ends it takes it for good, and the next one starts a
fresh one. What each test reads of a shared server's log is what it wrote after the test began.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from contextlib import contextmanager

import grpc
import pytest
import torch

from bench.measure.launch import stop, wait_serving
from decode_server.client import generate
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec
from kvtransfer.rpc.compat import local_compat
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.faultkit import SERVING, Half, Pair

PROMPT = [5, 6, 7, 8]
EXIT_S = 2.0  # a stopped process is gone within this after its grace


def serves(pair: Pair, timeout: float = 60) -> list[int]:
    out = asyncio.run(generate(pair.addr, PROMPT, 4, timeout=timeout))
    assert out["timing"]["mode"] in ("layerwise", "bulk"), out["timing"]
    return out["tokens"]


def exits(half: Half, timeout: float) -> int:
    return half.proc.wait(timeout=timeout)


def port_free(addr: str) -> bool:
    """Whether a restarted server could bind `addr` (as gRPC does: SO_REUSEADDR, so TIME_WAIT does not count)."""
    host, port = addr.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
            return True
        except OSError:
            return False


def raw_handshake(prefill_addr: str, compat: pb.Compat) -> pb.HandshakeResponse:
    """A handshake nobody follows up (no liveness watch, no join): a decode worker that died right after it."""
    async def call():
        async with grpc.aio.insecure_channel(prefill_addr) as ch:
            return await pbg.PrefillStub(ch).Handshake(
                pb.HandshakeRequest(compat=compat, transport=pb.TRANSPORT_GLOO, instance_id=12345), timeout=120,
                wait_for_ready=True)
    return asyncio.run(call())


@pytest.fixture(scope="module")
def compat(tiny_fp32) -> pb.Compat:
    return local_compat(ModelSpec("tiny"), tiny_fp32, CacheGeometry.from_config(tiny_fp32.config, torch.float32),
                        False)


class Shared:
    """One server set for several tests: `get()` the running one (a fresh one first, or when `usable` says the last
    is not), `take()` it to end it (the next `get` starts a fresh one)."""

    def __init__(self, start, usable):
        self.start, self.usable, self.current, self.made = start, usable, None, []

    def get(self) -> Pair:
        if self.current is not None and not self.usable(self.current):
            self.current.close()
            self.current = None
        if self.current is None:
            self.current = self.start()
            self.made.append(self.current)
        return self.current

    def take(self) -> Pair:
        pair, self.current = self.get(), None
        return pair

    def close(self) -> None:
        for pair in self.made:
            pair.close()


def alive(half: Half) -> bool:
    return half.proc is not None and half.proc.poll() is None


@pytest.fixture(scope="module")
def serving_pair(tmp_path_factory):
    """A default pair, serving."""
    def start() -> Pair:
        pair = Pair(tmp_path_factory.mktemp("pair"))
        pair.start()
        return pair
    shared = Shared(start, lambda p: alive(p.prefill) and alive(p.decode) and p.health() == SERVING)
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def lone_prefill(tmp_path_factory):
    """A prefill worker no decode worker has paired with (--dist-timeout-s 60: a join it starts stays in progress);
    the decode workers the tests start against it fail before pairing."""
    def start() -> Pair:
        pair = Pair(tmp_path_factory.mktemp("lone"), prefill_args=["--dist-timeout-s", "60"])
        pair.prefill.start()
        pair.wait_line(pair.prefill, "prefill server ready")
        return pair
    shared = Shared(start, lambda p: alive(p.prefill))
    yield shared
    shared.close()


def another_decode(pair: Pair, log_dir, args=None) -> Half:
    """A decode worker for `pair`'s prefill worker on ports of its own (`args`: the pair's decode arguments, or
    these), its log under `log_dir`."""
    args = list(pair.decode.args if args is None else args)
    args[args.index("--listen") + 1] = f"127.0.0.1:{_free()}"
    args[args.index("--metrics-port") + 1] = str(_free())
    return Half("decode_server", args, str(log_dir))


def log_size(half: Half) -> int:
    return len(half.log_text())


@contextmanager
def started(half: Half):
    """`half` started, and stopped at the end whatever happened (a refused worker has exited by then)."""
    half.start()
    try:
        yield half
    finally:
        stop([half.proc])


def test_an_abandoned_pairing_leaves_the_prefill_worker_ready_for_the_next(tmp_path, compat):
    """Two handshakes whose decode worker never joins, then a real decode worker: each newer pairing makes the
    prefill's join of the older one give way, and the real one pairs at its first try (a failed join once left
    torch's group count advanced on one side only, and every later join waited under another key)."""
    with Pair(tmp_path, prefill_args=["--dist-timeout-s", "5"], decode_args=["--dist-timeout-s", "30"]) as pair:
        pair.prefill.start()
        raw_handshake(pair.prefill_addr, compat)
        raw_handshake(pair.prefill_addr, compat)
        pair.wait_line(pair.prefill, "pairing epoch 1 abandoned before the decode peer joined (superseded by epoch 2)")
        pair.wait_line(pair.prefill, "pairing epoch 2 failed: the peer did not join the process group within 5 s")
        pair.decode.start()
        pair.wait_health(SERVING, 120)
        assert len(serves(pair)) == 4
        assert "pairing failed" not in pair.decode.log_text(), pair.log_text()


def test_pending_pairings_are_capped_and_a_decode_worker_gone_frees_its_place(tmp_path, compat):
    """Decode workers that watch and handshake but never join hold a join thread each (until --dist-timeout-s): at
    most --max-pending-pairings (2 here) at once. A third worker is refused RESOURCE_EXHAUSTED naming the flag; a
    pending one may handshake again; a watcher that leaves gives its place to the refused one. Without the cap, a
    caller without the token held ~1,000 threads (docs/security.md)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtransfer.rpc.server import DECODE_INSTANCE_KEY, WATCH_KEY

    with Pair(tmp_path, prefill_args=["--max-pending-pairings", "2", "--dist-timeout-s", "60"]) as pair:
        pair.prefill.start()
        pair.wait_line(pair.prefill, "prefill server ready")

        async def scenario():
            async with grpc.aio.insecure_channel(pair.prefill_addr) as ch:
                stub, health = pbg.PrefillStub(ch), health_pb2_grpc.HealthStub(ch)
                watches = {i: health.Watch(health_pb2.HealthCheckRequest(service=""),
                                           metadata=((DECODE_INSTANCE_KEY, f"{i:x}"), (WATCH_KEY, f"w{i}")))
                           for i in (11, 12, 13)}  # each handshake names its watch, as a decode worker's does
                for w in watches.values():
                    await w.read()  # open: the worker counts it

                def handshake(i):
                    return stub.Handshake(pb.HandshakeRequest(compat=compat, transport=pb.TRANSPORT_GLOO,
                                                              instance_id=i), timeout=30,
                                          metadata=((WATCH_KEY, f"w{i}"),))
                await handshake(11)
                await handshake(12)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await handshake(13)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
                assert "--max-pending-pairings" in refused.value.details()
                await handshake(11)  # a pending pair may pair again (its new epoch supersedes the old)
                watches[12].cancel()  # decode worker 12 is gone: its join gives way, and its place with it
                deadline = time.monotonic() + 20
                while True:
                    try:
                        return await handshake(13)
                    except grpc.aio.AioRpcError as e:
                        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.1)
        assert asyncio.run(scenario()).epoch == 4, pair.prefill.log_text()[-3000:]
        assert "pairing failed" not in pair.prefill.log_text()


def test_a_decode_worker_checks_its_rendezvous_flag_before_the_handshake(tmp_path, lone_prefill):
    """--dist-init env:// without MASTER_ADDR/MASTER_PORT: exit 2 at start naming the flag; the prefill worker
    never saw a handshake."""
    pair = lone_prefill.get()
    before = log_size(pair.prefill)
    args = [a if not a.startswith("tcp://") else "env://" for a in pair.decode.args]
    with started(another_decode(pair, tmp_path, args)) as decode:
        assert exits(decode, 150) == 2
    assert "--dist-init env:// needs MASTER_ADDR" in decode.log_text()
    assert "handshake from decode instance" not in pair.prefill.log_text()[before:]


def test_a_warm_up_over_the_receive_limit_is_refused_at_start(tmp_path, lone_prefill):
    """A decode worker whose limit (--max-prompt-tokens 100) is below the prefill worker's warm-up (128 tokens)
    exits 2 at the handshake. (The prefill worker's own such limit: test_the_cli_refuses_before_any_server_runs.)"""
    pair = lone_prefill.get()
    with started(another_decode(pair, tmp_path, [*pair.decode.args, "--max-prompt-tokens", "100"])) as decode:
        assert exits(decode, 150) == 2
    text = decode.log_text()
    assert "--warmup-tokens" in text and "receive limit of 102400 bytes" in text, text[-2000:]


def test_a_second_decode_worker_pairs_too_and_the_first_is_undisturbed(tmp_path, serving_pair):
    """One prefill worker, two decode workers (its own pair each: a process group each over gloo): both serve the
    same tokens; the second one's stop ends its pair only, and the first keeps serving."""
    pair = serving_pair.get()
    first = serves(pair)
    other = another_decode(pair, tmp_path)
    addr = other.args[other.args.index("--listen") + 1]
    with started(other):
        wait_serving(addr, [other.proc], timeout=60)
        out = asyncio.run(generate(addr, PROMPT, 4, timeout=60))
        assert out["tokens"] == first and out["timing"]["mode"] in ("layerwise", "bulk"), out
        assert serves(pair) == first and pair.health() == SERVING
    assert serves(pair) == first and pair.health() == SERVING
    log = pair.prefill.log_text()
    assert "paired with decode instance" in log
    # each decode worker named its liveness watch (peer_health.py: an old stream's close is not it leaving)
    assert "its liveness watch" in log and "no liveness watch named" not in log


def _free() -> int:
    from bench.measure.launch import free_port
    return free_port()


def test_sigterm_to_the_prefill_mid_request_finishes_it_and_frees_the_process(tmp_path):
    """The prefill worker holds a transfer for 2 s (fault injection) when SIGTERM comes: the request completes,
    the prefill accepts no new handshake while stopping, and it exits 0 right after, its port free. SIGTERM goes
    once the prefill worker's log says it holds the transfer (a fixed 0.5 s after the call raced a loaded machine's
    warm-up and prefill: SIGTERM came before the hold, so the stall began after it)."""
    with Pair(tmp_path, prefill_args=["--fail-after-layers", "2", "--fail-stall-s", "2"]) as pair:
        pair.start()

        async def scenario():
            call = asyncio.create_task(generate(pair.addr, PROMPT, 4, timeout=60))
            await asyncio.to_thread(pair.wait_line, pair.prefill, "fault injection: holding the transfer")
            t0 = time.monotonic()
            pair.prefill.proc.send_signal(signal.SIGTERM)
            return await call, t0
        out, t0 = asyncio.run(scenario())
        assert len(out["tokens"]) == 4 and out["timing"]["mode"] in ("layerwise", "bulk")
        assert exits(pair.prefill, 20 + EXIT_S) == 0
        assert time.monotonic() - t0 < 2 + 3 + EXIT_S, pair.log_text()  # the stall, a pairing's close, the exit
        assert port_free(pair.prefill_addr)
        assert "pairing epoch 2" not in pair.prefill.log_text()


@pytest.mark.parametrize("first", ["prefill", "decode", "both"])
def test_sigterm_to_both_exits_0_on_both(serving_pair, first):
    """The first of these ends the pair test_a_second_decode_worker_... served on; the others start their own."""
    with serving_pair.take() as pair:
        serves(pair)
        halves = {"prefill": [pair.prefill, pair.decode], "decode": [pair.decode, pair.prefill],
                  "both": [pair.prefill, pair.decode]}[first]
        t0 = time.monotonic()
        for h in halves:
            h.proc.send_signal(signal.SIGTERM)
            if first != "both":
                time.sleep(0.2)
        assert [exits(h, 20 + EXIT_S) for h in halves] == [0, 0], pair.log_text()
        assert time.monotonic() - t0 < 10, pair.log_text()
        assert port_free(pair.addr) and port_free(pair.prefill_addr)
        assert "terminate called" not in pair.log_text()


def test_a_prefill_worker_stopped_during_a_join_exits_at_once(compat, lone_prefill):
    """A join in progress (a handshake whose decode worker never joins, --dist-timeout-s 60) does not hold the
    stopping process: it exits 0 within seconds. (The module's lone prefill worker, which this test ends: its
    earlier refused decode workers may have left an older join, which this handshake supersedes.)"""
    with lone_prefill.take() as pair:
        epoch = raw_handshake(pair.prefill_addr, compat).epoch
        pair.wait_line(pair.prefill, f"joining process group epoch {epoch} ")
        t0 = time.monotonic()
        pair.prefill.proc.send_signal(signal.SIGTERM)
        assert exits(pair.prefill, 30) == 0
        assert time.monotonic() - t0 < 5, pair.prefill.log_text()[-2000:]
        assert port_free(pair.prefill_addr)


def test_a_decode_worker_stopped_while_pairing_exits_at_once(tmp_path):
    """The decode worker waits for a prefill worker that is not there yet (--handshake-timeout-s 120): SIGTERM
    ends it within seconds, exit 0."""
    with Pair(tmp_path, decode_args=["--handshake-timeout-s", "120"]) as pair:
        pair.decode.start()
        pair.wait_line(pair.decode, "NOT_SERVING until paired")
        t0 = time.monotonic()
        pair.decode.proc.send_signal(signal.SIGTERM)
        assert exits(pair.decode, 30) == 0
        assert time.monotonic() - t0 < 5


def test_the_cli_refuses_before_any_server_runs(capsys):
    """A flag combination that cannot work exits 2 naming it, before a model is loaded: a prefill worker whose own
    --max-prompt-tokens 100 is below its warm-up (128 tokens) names both flags. In process, through the flag parsing
    `python -m prefill_server` runs first (kvtransfer.rpc.main.run_main; a real process's exit 2 on a bad flag is
    tests/test_operability.py's): a start costs seconds of a CI core for what the parser decides."""
    from kvtransfer.rpc.configargs import from_args
    from prefill_server.config import PrefillConfig
    with pytest.raises(SystemExit) as e:
        from_args(PrefillConfig, ["--max-prompt-tokens", "100"], "", "kvtransfer-prefill")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--warmup-tokens 128 is over --max-prompt-tokens 100" in err, err
