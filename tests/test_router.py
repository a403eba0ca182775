"""kvtransfer-router (issue #28, part 3) in real processes on CPU: two colocated `tiny` decode workers behind the
router, driven by many clients at once.

What each test shows: a 64-client load answered with the tokens the engine makes alone, spread over both workers,
every response naming its worker; bad input coming back as the worker said it, not retried; no healthy worker
refused at once; the OpenAI front working over the router; a skewed load (a few long generations among many
short ones) placed by least_loaded on the worker with the least load it saw, each time, so the long ones split,
where round robin stacks them (the imbalance over time is printed and written as JSON, not asserted: a bench
figure); a worker killed mid-load failing only its own streams (the ones not started yet retried elsewhere),
nothing hanging, the worker rejoining after its restart; a conversation's next turn sent back to the worker whose
prefix cache holds it, unless that worker is too loaded; a request a full worker refused retried on the other
worker, never on the one that refused it (its own workers, one at --max-inflight 1).

Why one fleet for most tests: each process start costs seconds of a shared CPU; the workers (prefix cache off, so
every answer is the engine's alone) and the least_loaded router are started once per module, and the kill test,
which restarts a worker, runs last of those that use them. The affinity test starts its own workers (prefix cache
on). Every call has a deadline; waits poll with one.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure.launch import free_port, stop, wait_serving
from bench.measure.router_skew import SHORT_NEW, run_skew, skew_requests, until_idle
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.apifront import api_front, request
from support.enginekit import engine_generate
from support.faultkit import Half, scrape

S = grpc.StatusCode
KEY = "kvt-worker"
DEADLINE_S = 30.0
START_S = 120.0
WORKER_ARGS = ["--colocated", "--model", "tiny", "--dtype", "float32", "--log-level", "INFO", "--max-inflight", "128"]
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Fleet:
    workers: list[Half]
    addrs: list[str]
    router: Half
    router_addr: str
    metrics_port: int

    def log_text(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {h.logs[-1]}\n{h.log_text()[-tail:]}" for h in [*self.workers, self.router])

    def metrics(self) -> dict:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")


def worker(log_dir, prefix_cache: bool = False) -> tuple[Half, str]:
    addr = f"127.0.0.1:{free_port()}"
    h = Half("decode_server", [*WORKER_ARGS, "--listen", addr, *([] if prefix_cache else ["--no-prefix-cache"])],
             str(log_dir))
    h.start()
    return h, addr


def router(log_dir, workers: list[str], *args) -> tuple[Half, str, int]:
    addr, mport = f"127.0.0.1:{free_port()}", free_port()
    h = Half("router", ["--listen", addr, "--metrics-port", str(mport), "--log-level", "INFO",
                        *[a for w in workers for a in ("--worker", w)], *args], str(log_dir))
    h.start()
    return h, addr, mport


def total(m: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))


def health(addr: str) -> int | None:
    try:
        with grpc.insecure_channel(addr) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


@dataclass
class Outcome:
    tokens: list[int]
    code: grpc.StatusCode
    details: str
    initial: str | None  # kvt-worker, initial metadata
    trailing: str | None  # kvt-worker, trailing metadata
    seconds: float
    timing: pb.Timing | None


async def call(stub, ids: list[int], n: int, timeout: float = DEADLINE_S) -> Outcome:
    t0 = time.monotonic()
    c = stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=n), timeout=timeout)
    tokens, timing, code, details = [], None, S.OK, ""
    try:
        async for m in c:
            tokens.append(m.token_id)
            if m.HasField("timing"):
                timing = m.timing
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details()
    initial = dict(await c.initial_metadata() or ()).get(KEY)
    trailing = dict(await c.trailing_metadata() or ()).get(KEY)
    return Outcome(tokens, code, details, initial, trailing, time.monotonic() - t0, timing)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router")
    halves, addrs = zip(*[worker(log_dir) for _ in range(2)], strict=True)
    r, raddr, mport = router(log_dir, list(addrs))
    f = Fleet(list(halves), list(addrs), r, raddr, mport)
    try:
        for h, a in zip(halves, addrs, strict=True):
            wait_serving(a, [h.proc], START_S)
        wait_serving(raddr, [r.proc], 30)
        yield f
    except Exception as e:
        raise RuntimeError(f"{e}\n{f.log_text()}") from e
    finally:
        stop([h.proc for h in [*f.workers, f.router]])


@pytest.fixture(scope="module")
def pool(tiny_fp32) -> list[tuple[list[int], int, list[int]]]:
    """32 (prompt, max_new_tokens, the engine's tokens for it alone), prompts of 8..132 tokens."""
    out = []
    for i in range(32):
        ids, n = prompt(100 + i, 8 + 4 * i), 4 + i % 13
        out.append((ids, n, engine_generate(tiny_fp32, ids, n)[0]))
    return out


def test_a_64_client_load_is_spread_and_every_answer_is_right_and_named(fleet, pool):
    async def load():
        async with grpc.aio.insecure_channel(fleet.router_addr) as ch:
            stub = pbg.DecodeStub(ch)

            async def client(c: int) -> list[tuple[Outcome, list[int]]]:
                got = []
                for k in range(2):
                    ids, n, want = pool[(2 * c + k) % len(pool)]
                    got.append((await call(stub, ids, n), want))
                return got
            got = [x for xs in await asyncio.gather(*[client(c) for c in range(64)]) for x in xs]
            return got, await stub.Load(pb.LoadRequest(), timeout=5), await stub.Info(pb.InfoRequest(), timeout=5)

    got, load, info = asyncio.run(load())
    bad = [(o.code.name, o.details) for o, want in got if o.code != S.OK or o.tokens != want]
    assert not bad, f"{len(bad)} of {len(got)} wrong, e.g. {bad[:3]}\n{fleet.log_text()}"
    assert all(o.initial == o.trailing and o.initial in fleet.addrs for o, _ in got), {o.initial for o, _ in got}
    per_worker = {a: sum(o.initial == a for o, _ in got) for a in fleet.addrs}
    assert min(per_worker.values()) >= 32, per_worker  # both workers served a fair share of the 128
    m = fleet.metrics()
    assert {a: total(m, "kvt_router_routed_total", worker=a) for a in fleet.addrs} == per_worker
    assert total(m, "kvt_router_failed_total") == 0 and total(m, "kvt_router_requests_total", outcome="OK") >= 128
    assert load.serving and info.model == "tiny" and info.vocab_size == 512 and info.prefix_block_tokens == 0


def test_bad_input_comes_back_as_the_worker_said_it_and_is_not_retried(fleet):
    req = pb.GenerateRequest(token_ids=[5, 6, 10**6], max_new_tokens=3)

    async def both():
        async with grpc.aio.insecure_channel(fleet.addrs[0]) as w, grpc.aio.insecure_channel(fleet.router_addr) as r:
            direct = await call(pbg.DecodeStub(w), list(req.token_ids), 3)
            return direct, await call(pbg.DecodeStub(r), list(req.token_ids), 3)

    before = fleet.metrics()
    direct, routed = asyncio.run(both())
    after = fleet.metrics()
    assert direct.code == S.INVALID_ARGUMENT and "outside the vocabulary" in direct.details
    assert (routed.code, routed.details) == (direct.code, direct.details)
    assert routed.trailing in fleet.addrs and routed.initial is None and routed.tokens == []
    for name in ("kvt_router_routed_total", "kvt_router_failed_total"):  # one attempt, on one worker
        assert total(after, name) - total(before, name) == 1, name
    assert total(after, "kvt_router_retried_total") == total(before, "kvt_router_retried_total")


def test_no_healthy_worker_is_refused_at_once_saying_so(tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    r, addr, _ = router(tmp_path, [dead])
    try:
        deadline = time.monotonic() + 30
        while health(addr) is None and time.monotonic() < deadline:
            assert r.proc.poll() is None, r.log_text()
            time.sleep(0.1)
        assert health(addr) == health_pb2.HealthCheckResponse.NOT_SERVING

        async def one():
            async with grpc.aio.insecure_channel(addr) as ch:
                return await call(pbg.DecodeStub(ch), [1, 2, 3], 2, timeout=10)
        got = asyncio.run(one())
        assert got.code == S.UNAVAILABLE and "no healthy decode worker" in got.details and dead in got.details
        assert got.seconds < 5
    finally:
        stop([r.proc])


def test_the_openai_front_works_over_the_router(fleet, pool, tmp_path):
    ids, n, want = pool[3]
    with api_front(str(tmp_path / "api.log"), fleet.router_addr) as url:
        status, body = request("POST", f"{url}/v1/completions", {
            "model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=60)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == want


PLACED = re.compile(r"DEBUG kvtransfer\.router (\d+) \+ (\d+) tokens to (\S+) \((\w+)\); loads before: (.*)$")


def placements(log: str) -> list[dict]:
    """Each placement a DEBUG router logged, in order: the request's tokens, where it went, why, and the load of
    every healthy worker it compared (router/placement.py's `choose`)."""
    out = []
    for line in log.splitlines():
        if hit := PLACED.search(line):
            loads = {a: int(n) for a, n in (x.rsplit(" ", 1) for x in hit.group(5).split(", "))}
            out.append({"prompt": int(hit.group(1)), "new": int(hit.group(2)), "to": hit.group(3),
                        "reason": hit.group(4), "loads": loads})
    return out


def test_a_skewed_load_is_placed_by_load_with_least_loaded_where_round_robin_stacks_it(fleet, tmp_path,
                                                                                       record_property):
    """What placement decides, on any machine however loaded: each request is sent once the one before has its
    first token (run_skew in_order), so both routers see the same arrival order. Round robin takes the workers in
    turn: the 4 long requests (arrival positions 0, 2, 4, 6) all land on one worker. least_loaded (its own router
    here, at DEBUG, which logs every placement with the loads it compared) sends every request to the worker with
    the least load it saw (on an idle machine that splits the long ones 2/2; how they split depends on how fast
    each worker drains, so it is printed, not asserted). The imbalance sampled over time (bench/measure/
    router_skew.py's figures: they depend on each worker's speed, which a busy machine makes unequal) is printed
    and written as JSON, not asserted; bench/results/router-skew-cpu-2026-12-02 measures it on an idle machine."""
    rr, rr_addr, _ = router(tmp_path, fleet.addrs, "--policy", "round_robin")
    ll, ll_addr, _ = router(tmp_path, fleet.addrs, "--log-level", "DEBUG")  # least_loaded, its default
    try:
        for h, a in ((rr, rr_addr), (ll, ll_addr)):
            wait_serving(a, [h.proc], 30)
        runs = {}
        for name, addr in (("round_robin", rr_addr), ("least_loaded", ll_addr)):
            asyncio.run(until_idle(addr))
            runs[name] = asyncio.run(run_skew(addr, fleet.addrs, in_order=True))  # placed in arrival order
        log = ll.log_text()
    finally:
        stop([rr.proc, ll.proc])
    figures = {name: {"figures": r["figures"], "placed": r["placed"], "seconds": r["seconds"]}
               for name, r in runs.items()}
    (tmp_path / "router-skew.json").write_text(json.dumps(figures, indent=1))
    record_property("router_skew", figures)
    print(f"ROUTER_SKEW {json.dumps(figures)}")
    for name, r in runs.items():
        assert r["codes"] == ["OK"], (name, r["codes"])
    # round robin: the workers in turn, whatever their load; so the long requests (even positions) stack on one
    went = [r["worker"] for r in runs["round_robin"]["results"]]
    assert went[0] != went[1] and all(w == went[i % 2] for i, w in enumerate(went)), went
    assert sorted(p["long"] for p in runs["round_robin"]["placed"].values()) == [0, 4], figures
    # least_loaded: every request to a worker whose load, as the router saw it then, was the least of the two
    sent = [(len(ids), n) for ids, n in skew_requests()]
    seen = placements(log)
    assert [(p["prompt"], p["new"]) for p in seen] == sent, (seen, log[-3000:])
    assert [r["worker"] for r in runs["least_loaded"]["results"]] == [p["to"] for p in seen], seen
    not_least = [p for p in seen if p["reason"] != "load" or set(p["loads"]) != set(fleet.addrs)
                 or p["loads"][p["to"]] > min(p["loads"].values())]
    assert not not_least, not_least
    # How the longs split follows from those loads, which depend on each worker's speed (2/2 on an idle machine, 3/1
    # seen in a fresh-clone CI run: a worker drained its long one before the next arrived): printed, not asserted.
    # The bench's count of where each long went must be the router's own placements.
    longs = Counter(p["to"] for p in seen if p["new"] > SHORT_NEW)
    assert {w: p["long"] for w, p in runs["least_loaded"]["placed"].items() if p["long"]} == dict(longs), figures


def test_a_killed_worker_fails_only_its_own_streams_nothing_hangs_and_it_rejoins(fleet, pool):
    victim, vaddr = fleet.workers[1], fleet.addrs[1]
    before = fleet.metrics()
    served_after_kill = []

    async def load():
        results: list[tuple[Outcome, list[int]]] = []
        killed = asyncio.Event()
        end = [float("inf")]
        async with grpc.aio.insecure_channel(fleet.router_addr) as ch, grpc.aio.insecure_channel(vaddr) as vch:
            stub = pbg.DecodeStub(ch)

            async def client(c: int) -> None:
                i = c
                while time.monotonic() < end[0]:
                    ids, n, want = pool[i % len(pool)]
                    i += 7
                    results.append((await call(stub, ids, n), want))

            async def killer() -> None:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # the victim holds running streams and waiting requests
                    load = await pbg.DecodeStub(vch).Load(pb.LoadRequest(), timeout=5)
                    if load.running_requests >= 4 and load.waiting_requests >= 1:
                        break
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(victim.kill)
                killed.set()
                end[0] = time.monotonic() + 2.0
                served_after_kill.append(await asyncio.to_thread(health, fleet.router_addr))
            await asyncio.gather(killer(), *[client(c) for c in range(64)])
        return results

    results = asyncio.run(load())
    fails = [o for o, _ in results if o.code != S.OK]
    oks = [(o, want) for o, want in results if o.code == S.OK]
    assert not [o for o in results if o[0].seconds >= DEADLINE_S - 1 or o[0].code == S.DEADLINE_EXCEEDED]  # no hang
    wrong = [o.tokens for o, want in oks if o.tokens != want]
    assert not wrong, f"{len(wrong)} wrong answers\n{fleet.log_text()}"
    assert all(o.initial == o.trailing and o.initial in fleet.addrs for o, _ in oks)
    # only streams the victim had started fail, each saying which worker failed; nothing failed before a token
    # (those were retried on the survivor)
    odd = [(o.code.name, o.details, o.initial, len(o.tokens)) for o in fails
           if not (o.code == S.UNAVAILABLE and o.initial == o.trailing == vaddr and o.tokens
                   and f"decode worker {vaddr} failed after {len(o.tokens)} tokens" in o.details)]
    assert not odd, f"{odd[:5]}\n{fleet.log_text()}"
    after = fleet.metrics()
    retried = total(after, "kvt_router_retried_total", worker=vaddr) - total(before, "kvt_router_retried_total",
                                                                              worker=vaddr)
    assert fails and retried >= 1, (len(fails), retried)  # the kill caught streams and waiting requests
    assert served_after_kill == [SERVING] and health(fleet.router_addr) == SERVING
    assert total(after, "kvt_router_worker_up", worker=vaddr) == 0

    victim.start()  # the same address
    wait_serving(vaddr, [victim.proc], START_S)
    t_up = time.monotonic()

    async def until_routed_to_victim() -> float:
        async with grpc.aio.insecure_channel(fleet.router_addr) as ch:
            stub = pbg.DecodeStub(ch)
            while time.monotonic() - t_up < 10:
                got = await call(stub, [7, 8, 9], 2, timeout=10)
                assert got.code == S.OK, got
                if got.initial == vaddr:
                    return time.monotonic() - t_up
                await asyncio.sleep(0.05)
        raise AssertionError(f"the restarted worker got no request within 10 s\n{fleet.log_text()}")
    rejoined_s = asyncio.run(until_routed_to_victim())
    print(f"ROUTER_KILL {len(results)} requests, {len(fails)} failed mid-stream, {retried:.0f} retried, "
          f"rejoined {rejoined_s:.2f} s after serving")


def test_a_conversation_goes_back_to_the_worker_holding_its_prefix_unless_too_loaded(tmp_path):
    halves, addrs = zip(*[worker(tmp_path, prefix_cache=True) for _ in range(2)], strict=True)
    r, raddr, mport = router(tmp_path, list(addrs), "--affinity-slack-tokens", "1000")
    everyone = [*halves, r]
    try:
        for h, a in zip(halves, addrs, strict=True):
            wait_serving(a, [h.proc], START_S)
        wait_serving(raddr, [r.proc], 30)

        async def conversation(seed: int, background_prompt: int) -> tuple[Outcome, Outcome]:
            """Turn 1, then a long request straight to turn 1's worker (so the router sees it busier than the
            other by its footprint), then turn 2 through the router."""
            async with grpc.aio.insecure_channel(raddr) as ch:
                stub = pbg.DecodeStub(ch)
                ids = prompt(seed, 40)
                first = await call(stub, ids, 8)
                assert first.code == S.OK and first.initial in addrs, first
                async with grpc.aio.insecure_channel(first.initial) as wch:
                    bg = pbg.DecodeStub(wch).Generate(pb.GenerateRequest(
                        token_ids=prompt(seed + 1, background_prompt), max_new_tokens=600), timeout=DEADLINE_S)
                    await bg.read()  # its first token: it runs
                    deadline = time.monotonic() + 10
                    # the router saw it: more than turn 1's 8 tokens left to make (a report still showing turn 1
                    # running, one poll late on a loaded machine, once let turn 2 be placed before bg was seen)
                    while (await stub.Load(pb.LoadRequest(), timeout=5)).remaining_tokens <= 8:
                        assert time.monotonic() < deadline, "the router's load view never showed the request"
                        await asyncio.sleep(0.05)
                    second = await call(stub, ids + first.tokens + prompt(seed + 2, 12), 8)
                    bg.cancel()
            return first, second

        # 40 + 600 tokens (< the 1000 slack) on turn 1's worker: turn 2 still goes there, and reuses its cache
        first, second = asyncio.run(conversation(1, 40))
        assert second.code == S.OK and second.initial == first.initial, (first.initial, second.initial)
        assert second.timing.reused_tokens >= 40 and second.timing.reuse_tier == pb.CACHE_TIER_DEVICE, second.timing
        m = scrape(f"http://127.0.0.1:{mport}/metrics")
        assert total(m, "kvt_router_affinity_hits_total", worker=first.initial) == 1
        asyncio.run(until_idle(raddr))
        # 1000 + 600 on it (over the slack): turn 2 goes to the other worker, which prefills it whole
        first, second = asyncio.run(conversation(5, 1000))
        assert second.code == S.OK and second.initial in addrs and second.initial != first.initial
        assert second.timing.reused_tokens == 0
        m = scrape(f"http://127.0.0.1:{mport}/metrics")
        assert total(m, "kvt_router_affinity_skipped_total", worker=first.initial) == 1
    except Exception as e:
        raise AssertionError(f"{e}\n" + "\n".join(h.log_text()[-3000:] for h in everyone)) from e
    finally:
        stop([h.proc for h in everyone])


def test_the_worker_file_is_read_at_start_and_checked_line_by_line(tmp_path):
    from router.config import RouterConfig

    f = tmp_path / "workers.txt"
    f.write_text("# the fleet\n127.0.0.1:7001\n\n  127.0.0.1:7002   # the new one\n")
    assert RouterConfig(worker=("127.0.0.1:7000",), worker_file=str(f)).workers() == (
        "127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002")
    assert RouterConfig(worker_file=str(f)).workers() == ("127.0.0.1:7001", "127.0.0.1:7002")  # no --worker needed
    for text, says in (("127.0.0.1:7001\nnot-an-address\n", ":2:"), ("127.0.0.1:7001\n127.0.0.1:7001\n", "twice"),
                       ("# nobody\n", "at least one decode worker")):
        f.write_text(text)
        with pytest.raises(ValueError, match=says):
            RouterConfig(worker_file=str(f))
    with pytest.raises(ValueError, match="cannot read it"):
        RouterConfig(worker_file=str(tmp_path / "missing.txt"))


LONG_NEW = 400  # tokens: decoding long enough on the CPU to be removed from the file while it runs


def test_sighup_reads_the_worker_file_again(fleet, tmp_path):
    """A router over --worker-file: a worker added to the file and SIGHUP takes requests; one removed takes no new
    request while its request in flight finishes OK; a file that does not parse, or lists nobody, changes nothing;
    the removed worker listed again takes requests again."""
    import signal

    a, b = fleet.addrs
    f = tmp_path / "workers.txt"
    f.write_text(f"{a}\n")
    r, addr, _ = router(tmp_path, [], "--worker-file", str(f))

    def hup(text: str, log_says: str) -> None:
        f.write_text(text)
        seen = r.log_text().count(log_says)
        r.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while r.log_text().count(log_says) == seen:
            assert time.monotonic() < deadline and r.proc.poll() is None, r.log_text()[-3000:]
            time.sleep(0.05)

    async def served(n: int) -> list[str]:
        async with grpc.aio.insecure_channel(addr) as ch:
            outs = [await call(pbg.DecodeStub(ch), [5, 6, 7], 2) for _ in range(n)]
        assert all(o.code == S.OK for o in outs), [(o.code, o.details) for o in outs]
        return [o.trailing for o in outs]

    try:
        wait_serving(addr, [r.proc], 30)
        assert set(asyncio.run(served(4))) == {a}
        hup(f"{a}\n{b}  # added\n", "SIGHUP: --worker-file read again")
        deadline = time.monotonic() + 20  # b takes requests once a poll finds it serving
        while b not in asyncio.run(served(2)):
            assert time.monotonic() < deadline, r.log_text()[-3000:]

        async def remove_one_while_it_serves() -> tuple[Outcome, str, list[str]]:
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = pbg.DecodeStub(ch)
                c = stub.Generate(pb.GenerateRequest(token_ids=[9, 8, 7], max_new_tokens=LONG_NEW), timeout=60)
                w = dict(await c.initial_metadata())[KEY]  # placed, its first token out
                other = b if w == a else a
                await asyncio.to_thread(hup, f"{other}\n", "SIGHUP: --worker-file read again")
                after = [(await call(stub, [5, 6, 7], 2)).trailing for _ in range(4)]
                tokens, code = [], S.OK
                try:
                    tokens = [m.token_id async for m in c]
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                return Outcome(tokens, code, "", w, None, 0.0, None), other, after

        long, other, after = asyncio.run(remove_one_while_it_serves())
        assert set(after) == {other}  # the removed worker takes no new request
        assert long.code == S.OK and len(long.tokens) == LONG_NEW, (long.code, len(long.tokens))  # ran to its end
        for text in ("127.0.0.1:1\nno-port-here\n", "# nobody\n"):  # nothing changes; it keeps serving
            hup(text, "SIGHUP: ")
            assert "the workers stay" in r.log_text()
            assert set(asyncio.run(served(2))) == {other}
        hup(f"{a}\n{b}\n", "SIGHUP: --worker-file read again")  # the removed one back: a new worker again
        deadline = time.monotonic() + 20
        while set(asyncio.run(served(2))) != {a, b}:
            assert time.monotonic() < deadline, r.log_text()[-3000:]
        assert r.proc.poll() is None
    finally:
        stop([r.proc])


def test_a_request_a_full_worker_refused_is_retried_on_another_worker_never_the_same(tmp_path):
    """A worker at its --max-inflight refuses at once (RESOURCE_EXHAUSTED, which leaves it healthy); the router
    retries the request once, on a worker it has not tried. Set up so that the full worker still looks the least
    loaded when the retry is placed: it runs one request of 3 + 3500 tokens (sent to it directly, so it is full),
    the other worker one of 90 + 4000 placed by the router. A retry that went back to the worker already tried
    would be refused again, and the request would fail."""
    full_addr = f"127.0.0.1:{free_port()}"
    args = [a for a in WORKER_ARGS if a not in ("--max-inflight", "128")]
    full = Half("decode_server", [*args, "--max-inflight", "1", "--listen", full_addr, "--no-prefix-cache"],
                str(tmp_path))
    full.start()
    roomy, roomy_addr = worker(tmp_path)
    r, raddr, mport = router(tmp_path, [full_addr, roomy_addr])
    everyone = [full, roomy, r]
    try:
        for h, a in ((full, full_addr), (roomy, roomy_addr), (r, raddr)):
            wait_serving(a, [h.proc], START_S)

        async def scenario() -> tuple[Outcome, bool]:
            async with grpc.aio.insecure_channel(full_addr) as fch, grpc.aio.insecure_channel(raddr) as rch:
                stub = pbg.DecodeStub(rch)
                hold = pbg.DecodeStub(fch).Generate(pb.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=3500),
                                                    timeout=120)
                await hold.read()  # it runs: the full worker is at its one request
                deadline = time.monotonic() + 20
                while (await stub.Load(pb.LoadRequest(), timeout=5)).running_requests < 1:  # the router saw it
                    assert time.monotonic() < deadline, "the router's load view never showed the request"
                    await asyncio.sleep(0.05)
                big = stub.Generate(pb.GenerateRequest(token_ids=prompt(11, 90), max_new_tokens=4000), timeout=120)
                placed = dict(await big.initial_metadata())[KEY]
                assert placed == roomy_addr, placed  # by load: the full worker held 3503 tokens, the other none
                got = await call(stub, [9, 8, 7], 2)  # the full worker looks the least loaded now (3503 < 4090)
                running = not hold.done() and not big.done()  # both still held their workers throughout
                hold.cancel()
                big.cancel()
                return got, running
        got, running = asyncio.run(scenario())
        assert running
        assert got.code == S.OK and got.initial == got.trailing == roomy_addr, (got.code, got.details, got.initial)
        assert len(got.tokens) == 2
        m = scrape(f"http://127.0.0.1:{mport}/metrics")  # tried first on the full worker, refused there, once
        assert total(m, "kvt_router_failed_total", worker=full_addr, code="RESOURCE_EXHAUSTED") == 1
        assert total(m, "kvt_router_retried_total", worker=full_addr) == 1
    except Exception as e:
        raise AssertionError(f"{e}\n" + "\n".join(h.log_text()[-3000:] for h in everyone)) from e
    finally:
        stop([h.proc for h in everyone])
