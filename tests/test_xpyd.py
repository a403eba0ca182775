"""2 prefill x 2 decode workers behind kvtransfer-router (issue #28) in real processes on CPU, over gloo and gRPC.

What each test shows, per transport:
- a 64-client load through the router: every request completes with the tokens the engine makes alone (exact
  mode: `tiny` in float32, the prefix cache off so every prompt crosses a link), and both decode workers and
  both prefill workers take a share (each decode worker pairs with both prefill workers, each prefill worker
  serves both decode workers);
- kill -9 one prefill worker and one decode worker mid-load: the only failures are streams the dead decode
  worker had started (each naming it); requests whose prefill worker died are tried on the other prefill worker
  (by the decode worker) or on the other decode worker (by the router); every answer that completes is right;
  nothing hangs; after both restart (same addresses), both decode workers are paired with both prefill workers
  again within a few seconds and the router sends to the restarted decode worker again.
And, gloo only, with processes of its own (one prefill worker, one decode worker whose second --prefill-addr is
down): peer choice never sends a request to a peer that is down.

Why one fleet per transport for both tests: each process start costs seconds of a shared CPU. The kill test
restarts what it kills, and runs last.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import grpc
import pytest

from bench.measure.launch import free_port, stop, wait_serving
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.enginekit import engine_generate
from support.faultkit import Half, scrape

S = grpc.StatusCode
KEY = "kvt-worker"
DEADLINE_S = 30.0
START_S = 120.0
REJOIN_S = 15.0  # a restarted worker paired again with every peer, after it serves
COMMON = ["--model", "tiny", "--dtype", "float32", "--log-level", "INFO"]


@dataclass
class Fleet:
    transport: str
    prefill: list[Half]
    prefill_addrs: list[str]
    prefill_metrics: list[int]
    decode: list[Half]
    decode_addrs: list[str]
    decode_metrics: list[int]
    router: Half
    router_addr: str

    def halves(self) -> list[Half]:
        return [*self.prefill, *self.decode, self.router]

    def log_text(self, tail: int = 2500) -> str:
        return "\n".join(f"--- {h.logs[-1]}\n{h.log_text()[-tail:]}" for h in self.halves() if h.logs)

    def peers_up(self) -> list[float]:
        """kvt_peer_up of each decode worker, then each prefill worker (None: its metrics do not answer)."""
        out = []
        for port in [*self.decode_metrics, *self.prefill_metrics]:
            try:
                out.append(scrape(f"http://127.0.0.1:{port}/metrics").get(("kvt_peer_up", ()), None))
            except OSError:
                out.append(None)
        return out

    def prefills_done(self) -> list[float]:
        """Requests each prefill worker answered OK (its kvt_requests_total{outcome="OK"})."""
        return [scrape(f"http://127.0.0.1:{p}/metrics").get(("kvt_requests_total", (("outcome", "OK"),)), 0.0)
                for p in self.prefill_metrics]


def _fleet(transport: str, log_dir) -> Fleet:
    p_addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    inits = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    p_metrics, d_metrics = [free_port() for _ in range(2)], [free_port() for _ in range(2)]
    prefill = [Half("prefill_server", [*COMMON, "--transport", transport, "--listen", a, "--dist-init", i,
                                       "--metrics-port", str(m)], str(log_dir))
               for a, i, m in zip(p_addrs, inits, p_metrics, strict=True)]
    d_addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    decode = [Half("decode_server", [*COMMON, "--transport", transport, "--listen", a,
                                     "--prefill-addr", ",".join(p_addrs), "--dist-init", ",".join(inits),
                                     "--data-listen", "127.0.0.1:0", "--no-prefix-cache", "--max-inflight", "128",
                                     "--max-batch", "64",  # the survivor alone holds all 64 clients: no slot wait
                                     "--metrics-port", str(m)], str(log_dir))
              for a, m in zip(d_addrs, d_metrics, strict=True)]
    r_addr = f"127.0.0.1:{free_port()}"
    router = Half("router", ["--listen", r_addr, "--log-level", "INFO",
                             *[x for a in d_addrs for x in ("--worker", a)]], str(log_dir))
    return Fleet(transport, prefill, p_addrs, p_metrics, decode, d_addrs, d_metrics, router, r_addr)


@pytest.fixture(scope="module", params=["gloo", "grpc"])
def fleet(request, tmp_path_factory):
    f = _fleet(request.param, tmp_path_factory.mktemp(f"xpyd-{request.param}"))
    try:
        for h in f.halves():
            h.start()
        for h, a in zip(f.decode, f.decode_addrs, strict=True):
            wait_serving(a, [h.proc], START_S)
        wait_serving(f.router_addr, [f.router.proc], 30)
        wait_until(lambda: f.peers_up() == [2, 2, 2, 2], 60, "every pair up", f)
        yield f
    except Exception as e:
        raise RuntimeError(f"{e}\n{f.log_text()}") from e
    finally:
        stop([h.proc for h in f.halves() if h.proc is not None])


@pytest.fixture(scope="module")
def pool(tiny_fp32) -> list[tuple[list[int], int, list[int]]]:
    """24 (prompt, max_new_tokens, the engine's tokens for it alone), prompts of 8..100 tokens."""
    out = []
    for i in range(24):
        rng = random.Random(300 + i)
        ids, n = [rng.randrange(3, 512) for _ in range(8 + 4 * i)], 4 + i % 11
        out.append((ids, n, engine_generate(tiny_fp32, ids, n)[0]))
    return out


def wait_until(check, timeout: float, what: str, fleet: Fleet) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"not {what} within {timeout} s: peers up {fleet.peers_up()}\n{fleet.log_text()}")


@dataclass
class Outcome:
    tokens: list[int]
    code: grpc.StatusCode
    details: str
    worker: str | None  # kvt-worker, trailing metadata
    seconds: float
    started: float  # time.monotonic() when it was sent


async def call(stub, ids: list[int], n: int) -> Outcome:
    t0 = time.monotonic()
    c = stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=n), timeout=DEADLINE_S)
    tokens, code, details = [], S.OK, ""
    try:
        async for m in c:
            tokens.append(m.token_id)
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details()
    return Outcome(tokens, code, details, dict(await c.trailing_metadata() or ()).get(KEY), time.monotonic() - t0,
                   t0)


def test_a_64_client_load_is_right_and_uses_every_worker(fleet, pool):
    before = fleet.prefills_done()

    async def load():
        async with grpc.aio.insecure_channel(fleet.router_addr) as ch:
            stub = pbg.DecodeStub(ch)

            async def client(c: int):
                return [(await call(stub, *pool[(2 * c + k) % len(pool)][:2]), pool[(2 * c + k) % len(pool)][2])
                        for k in range(2)]
            return [x for xs in await asyncio.gather(*[client(c) for c in range(64)]) for x in xs]

    got = asyncio.run(load())
    bad = [(o.code.name, o.details) for o, want in got if o.code != S.OK or o.tokens != want]
    assert not bad, f"{len(bad)} of {len(got)} wrong, e.g. {bad[:3]}\n{fleet.log_text()}"
    per_decode = {a: sum(o.worker == a for o, _ in got) for a in fleet.decode_addrs}
    per_prefill = [b - a for a, b in zip(before, fleet.prefills_done(), strict=True)]
    print(f"XPYD {fleet.transport}: 128 requests, per decode worker {list(per_decode.values())}, "
          f"per prefill worker {per_prefill}")
    assert min(per_decode.values()) >= 32, per_decode
    assert min(per_prefill) >= 16 and sum(per_prefill) == 128, per_prefill


def test_kill_9_a_prefill_and_a_decode_worker_mid_load(fleet, pool):
    p_victim, d_victim, d_addr = fleet.prefill[1], fleet.decode[1], fleet.decode_addrs[1]

    killed_at = [float("inf")]

    async def load():
        results: list[tuple[Outcome, list[int]]] = []
        end = [time.monotonic() + 30]
        async with grpc.aio.insecure_channel(fleet.router_addr) as ch:
            stub = pbg.DecodeStub(ch)

            async def client(c: int) -> None:
                i = c
                while time.monotonic() < end[0]:
                    ids, n, want = pool[i % len(pool)]
                    i += 5
                    results.append((await call(stub, ids, n), want))

            async def killer() -> None:
                await asyncio.sleep(1.5)  # the load is under way on every worker
                await asyncio.to_thread(p_victim.kill)
                await asyncio.to_thread(d_victim.kill)
                killed_at[0] = time.monotonic()
                end[0] = killed_at[0] + 3.0  # the survivors keep serving meanwhile
            await asyncio.gather(killer(), *[client(c) for c in range(64)])
        return results

    results = asyncio.run(load())
    assert not [o for o, _ in results if o.seconds >= DEADLINE_S - 1 or o.code == S.DEADLINE_EXCEEDED]  # no hang
    oks = [(o, want) for o, want in results if o.code == S.OK]
    wrong = [o.tokens for o, want in oks if o.tokens != want]
    assert not wrong, f"{len(wrong)} wrong answers\n{fleet.log_text()}"
    fails = [o for o, _ in results if o.code != S.OK]
    odd = [(o.code.name, o.details, o.worker, len(o.tokens)) for o in fails
           if not (o.code == S.UNAVAILABLE and o.worker == d_addr and o.tokens)]
    assert not odd, f"{len(odd)} of {len(fails)} failures not a started stream of the killed decode worker: " \
                    f"{odd[:5]}\n{fleet.log_text()}"
    after = [o for o, _ in results if o.started > killed_at[0] + 1.0]  # sent once the kills were seen
    late = [o for o in after if o.code != S.OK]
    assert after and not late and len(oks) > len(fails), (len(after), late[:3], len(oks), len(fails))

    p_victim.start()  # the same addresses, rendezvous and metrics ports
    d_victim.start()
    wait_serving(d_addr, [d_victim.proc], START_S)
    t_up = time.monotonic()
    rejoin_s = wait_until(lambda: fleet.peers_up() == [2, 2, 2, 2], REJOIN_S, "every pair up again", fleet)

    async def until_routed_to_victim() -> float:
        async with grpc.aio.insecure_channel(fleet.router_addr) as ch:
            stub = pbg.DecodeStub(ch)
            while time.monotonic() - t_up < REJOIN_S:
                ids, n, want = pool[0]
                got = await call(stub, ids, n)
                assert got.code == S.OK and got.tokens == want, got
                if got.worker == d_addr:
                    return time.monotonic() - t_up
                await asyncio.sleep(0.05)
        raise AssertionError(f"the restarted decode worker got no request\n{fleet.log_text()}")
    routed_s = asyncio.run(until_routed_to_victim())
    print(f"XPYD_KILL {fleet.transport}: {len(results)} requests, {len(fails)} failed mid-stream on the killed "
          f"decode worker, every pair up {rejoin_s:.1f} s and the restarted decode worker routed to {routed_s:.1f} s "
          "after it served")


def test_a_peer_that_is_down_is_never_chosen(tmp_path, pool):
    """Peer choice skips a prefill worker that is down (never paired, or its pairing lost), rather than sending a
    request there to fail and be retried: a decode worker paired with one live prefill worker, its second
    --prefill-addr one nobody listens on. Every request goes straight to the live one: all answered right, no
    remote prefill failure counted, the live prefill worker serving each. A choice that took the dead peer (its
    load is 0, as the idle live one's) would send every other request there first."""
    p_addr, init, p_metrics, d_metrics = (f"127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                                          free_port(), free_port())
    dead, dead_init = f"127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    d_addr = f"127.0.0.1:{free_port()}"
    prefill = Half("prefill_server", [*COMMON, "--transport", "gloo", "--listen", p_addr, "--dist-init", init,
                                      "--metrics-port", str(p_metrics)], str(tmp_path))
    decode = Half("decode_server", [*COMMON, "--transport", "gloo", "--listen", d_addr, "--prefill-addr",
                                    f"{p_addr},{dead}", "--dist-init", f"{init},{dead_init}", "--data-listen",
                                    "127.0.0.1:0", "--no-prefix-cache", "--metrics-port", str(d_metrics)],
                  str(tmp_path))
    halves = [prefill, decode]
    try:
        for h in halves:
            h.start()
        wait_serving(d_addr, [decode.proc], START_S)
        d_url, p_url = f"http://127.0.0.1:{d_metrics}/metrics", f"http://127.0.0.1:{p_metrics}/metrics"
        assert scrape(d_url).get(("kvt_peer_up", ())) == 1  # one of its two peers

        async def run() -> list[Outcome]:
            async with grpc.aio.insecure_channel(d_addr) as ch:
                return [await call(pbg.DecodeStub(ch), ids, n) for ids, n, _ in pool[:6]]
        got = asyncio.run(run())
        assert [(o.code, o.tokens) for o in got] == [(S.OK, want) for _, _, want in pool[:6]], \
            [(o.code.name, o.details) for o in got]
        failures = {k: v for k, v in scrape(d_url).items() if k[0] == "kvt_failures_total"}
        assert not any(failures.values()), failures
        assert scrape(p_url).get(("kvt_requests_total", (("outcome", "OK"),))) == 6
        assert "trying another prefill worker" not in decode.log_text()
    except Exception as e:
        raise AssertionError(f"{e}\n" + "\n".join(h.log_text()[-3000:] for h in halves if h.logs)) from e
    finally:
        stop([h.proc for h in halves if h.proc is not None])
