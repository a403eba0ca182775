"""`kvtransfer-bench serve --multi-turn` against an in-process stand-in decode server with a fake prefix cache:
each turn resends the conversation so far, the baseline pass sets skip_prefix_cache and the reuse pass does not,
the figures are what the server reported, and a failed turn ends its conversation."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
from collections import Counter

import grpc
import pytest

from bench.cli import main
from bench.measure.multiturn_stats import BUCKETS, length_bucket
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

VOCAB, BLOCK = 1000, 4
N, TURNS, USER, OUT, CONC = 3, 4, 5, 3, 2  # conversations, turns, user tokens a turn, answer tokens, in flight
ARGS = ["--vocab-size", str(VOCAB), "--num-prompts", str(N), "--turns", str(TURNS), "--user-len", str(USER),
        "--output-len", str(OUT), "--input-len", "20", "--input-len-range", "0.5", "--concurrency", str(CONC)]


class FakeDecode(pbg.DecodeServicer):
    """Keeps every finished request's prompt + answer. A prompt reuses its longest common prefix with a kept one
    (whole BLOCKs; none with skip_prefix_cache, unless `honour_skip` is off), from the device on even turns and
    reloaded from the host on odd ones; its turn is 1 + that of the kept sequence it starts with whole (1: none).
    Answers are a function of the prompt. `fail_turn`: the first reuse-pass request of that turn streams one
    token, then ends RESOURCE_EXHAUSTED."""

    def __init__(self, fail_turn: int | None = None, honour_skip: bool = True, max_seq_len: int = 1 << 16):
        self.requests: list[dict] = []  # in arrival order: what was asked and what was reported
        self.kept: dict[tuple, tuple[int, bool]] = {}  # prompt + answer -> (its turn, its skip_prefix_cache)
        self.fail_turn, self.honour_skip, self.max_seq_len = fail_turn, honour_skip, max_seq_len
        self.in_flight = self.max_in_flight = 0

    async def Info(self, request, context):
        return pb.InfoResponse(model="fake", vocab_size=VOCAB, context_length=self.max_seq_len,
                               max_seq_len=self.max_seq_len, max_prompt_tokens=self.max_seq_len, max_new_tokens=64,
                               prefix_block_tokens=BLOCK)

    async def Generate(self, request, context):
        ids = list(request.token_ids)
        parent = max((s for s in self.kept if tuple(ids[:len(s)]) == s), key=len, default=())
        turn = self.kept[parent][0] + 1 if parent else 1
        common = max((next((i for i, (a, b) in enumerate(zip(s, ids)) if a != b), min(len(s), len(ids)))
                      for s in self.kept), default=0)
        reuse = not (request.skip_prefix_cache and self.honour_skip) and common >= BLOCK
        tier = (pb.CACHE_TIER_DEVICE if turn % 2 == 0 else pb.CACHE_TIER_HOST) if reuse else pb.CACHE_TIER_NONE
        reused = common // BLOCK * BLOCK if reuse else 0
        rec = {"ids": ids, "skip": request.skip_prefix_cache, "max_new_tokens": request.max_new_tokens,
               "stop_on_eos": request.stop_on_eos, "turn": turn, "parent": parent, "reused": reused, "tier": tier,
               "reload": 64.0 * reused if tier == pb.CACHE_TIER_HOST else 0.0, "answer": []}
        self.requests.append(rec)
        fail = turn == self.fail_turn and not request.skip_prefix_cache
        self.fail_turn = None if fail else self.fail_turn
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for i in range(request.max_new_tokens):
                if fail and i == 1:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake: no room")
                rec["answer"].append((sum(ids) + 7 * i) % VOCAB)
                last = i == request.max_new_tokens - 1
                timing = pb.Timing(first_token_ms=1.0, total_ms=2.0, mode=pb.MODE_COLOCATED, reused_tokens=reused,
                                   reuse_tier=tier, reload_bytes=rec["reload"]) if last else None
                yield pb.GenerateResponse(token_id=rec["answer"][-1], index=i, timing=timing,
                                          finish_reason=pb.FINISH_REASON_LENGTH if last else None)
            self.kept[tuple(ids + rec["answer"])] = (turn, request.skip_prefix_cache)
        finally:
            self.in_flight -= 1


@contextlib.contextmanager
def serving(servicer: FakeDecode):
    """The servicer on a grpc.aio server at 127.0.0.1:<free port>, on an event loop of its own thread (the bench
    runs its own loop in this one); yields the address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        pbg.add_DecodeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def bench(addr: str, capsys, *extra: str) -> tuple[int, dict, str]:
    """The CLI in this process: exit status, the result (the last stdout line) and the rest of stdout."""
    rc = main(["serve", "--multi-turn", "--addr", addr, *ARGS, *extra])
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1]), "\n".join(out[:-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One clean run with --out, shared by the tests that read it: (fake, result, out dir)."""
    out = tmp_path_factory.mktemp("multiturn")
    fake, printed = FakeDecode(), io.StringIO()
    with serving(fake) as addr, contextlib.redirect_stdout(printed):
        rc = main(["serve", "--multi-turn", "--addr", addr, *ARGS, "--out", str(out)])
    result = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert rc == 0 and result["ok"], (result["failures"], result["passes"]["reuse"]["errors"])
    return fake, result, out


def passes(requests: list[dict]) -> dict[str, list[dict]]:
    """The fake's requests (after any warm-up) by pass."""
    return {"baseline": [r for r in requests if r["skip"]], "reuse": [r for r in requests if not r["skip"]]}


def test_each_turn_resends_the_conversation(run):
    fake = run[0]
    by_pass = passes(fake.requests[1:])
    assert fake.requests[0]["skip"] and len(fake.requests) == 1 + 2 * N * TURNS  # warm-up + two full passes
    skips = [r["skip"] for r in fake.requests[1:]]
    assert skips == [True] * (N * TURNS) + [False] * (N * TURNS)  # the baseline pass first, then reuse on
    assert all(r["max_new_tokens"] == OUT and not r["stop_on_eos"] for r in fake.requests)
    assert fake.max_in_flight <= CONC
    for name, reqs in by_pass.items():
        assert Counter(r["turn"] for r in reqs) == dict.fromkeys(range(1, TURNS + 1), N), name
        for r in reqs:
            if r["turn"] == 1:
                assert 10 <= len(r["ids"]) <= 30 and max(r["ids"]) < VOCAB
                continue
            parent = next(p for p in reqs if tuple(p["ids"] + p["answer"]) == r["parent"])  # same pass
            assert r["ids"][:len(r["parent"])] == parent["ids"] + parent["answer"]  # prompt + answer as streamed
            assert len(r["ids"]) == len(parent["ids"]) + OUT + USER and max(r["ids"]) < VOCAB
    firsts = {tuple(r["ids"]) for reqs in by_pass.values() for r in reqs if r["turn"] == 1}
    assert len(firsts) == 2 * N  # each pass its own conversations: the reuse pass never meets the baseline's


def test_figures_are_what_the_server_reported(run):
    fake, result, _ = run
    for name, reqs in passes(fake.requests[1:]).items():
        p = result["passes"][name]
        later = [r for r in reqs if r["turn"] >= 2]
        assert p["completed"] == N * TURNS and p["failed"] == 0 and p["total_output_tokens"] == N * TURNS * OUT
        assert [t["completed"] for t in p["ttft_by_turn"]] == [N] * TURNS and p["ttft_turns_2plus"]["completed"] == len(later)
        assert all(0 < t["median_ttft_ms"] <= t["p99_ttft_ms"] for t in p["ttft_by_turn"])
        hits = {"device": 0, "host": 0, "none": 0}
        for r in later:
            hits[{pb.CACHE_TIER_DEVICE: "device", pb.CACHE_TIER_HOST: "host", pb.CACHE_TIER_NONE: "none"}[r["tier"]]] += 1
        assert p["hits_by_tier"] == hits
        assert p["reused_tokens"]["sum"] == sum(r["reused"] for r in later)
        assert p["reload_bytes"]["sum"] == sum(r["reload"] for r in later)
        cells = p["ttft_by_tier_and_length"]
        assert {t: sum(c["count"] for c in b.values()) for t, b in cells.items()} == p["hits_by_tier"]
        assert sorted(r["input_len"] for r in p["requests"]) == sorted(len(r["ids"]) for r in reqs)
    base, reuse = result["passes"]["baseline"], result["passes"]["reuse"]
    assert base["hits_by_tier"] == {"device": 0, "host": 0, "none": N * (TURNS - 1)}
    assert base["reused_tokens"]["sum"] == 0 and base["skip_prefix_cache"] and not reuse["skip_prefix_cache"]
    assert reuse["hits_by_tier"] == {"device": 2 * N, "host": N, "none": 0}  # turns 2 and 4 device, 3 host
    assert reuse["reused_tokens"]["mean_per_turn"] == pytest.approx(reuse["reused_tokens"]["sum"] / (N * (TURNS - 1)))
    h = result["headline"]
    assert h["ttft_p50_turns_2plus_baseline_over_reuse"] == pytest.approx(
        base["ttft_turns_2plus"]["median_ttft_ms"] / reuse["ttft_turns_2plus"]["median_ttft_ms"])
    assert h["output_throughput_reuse_over_baseline"] == pytest.approx(
        reuse["output_throughput"] / base["output_throughput"])


def test_result_and_report_written(run):
    _, result, out = run
    assert json.loads((out / "result.json").read_text())["passes"]["reuse"]["hits_by_tier"] == \
        result["passes"]["reuse"]["hits_by_tier"]
    report = (out / "report.md").read_text()
    for title in ("Multi-turn serving", "Headline", "TTFT by turn (ms) -- reuse on",
                  "TTFT by where the prefix came from, per prompt length -- reuse off (baseline)"):
        assert title in report, title
    assert "| device hit | " in report and "| host reload | " in report and "| recompute | " in report


def test_a_failed_turn_ends_its_conversation(capsys):
    fake = FakeDecode(fail_turn=2)
    with serving(fake) as addr:
        rc, r, printed = bench(addr, capsys, "--warmup", "0")
    base, reuse = r["passes"]["baseline"], r["passes"]["reuse"]
    assert rc == 1 and not r["ok"] and any("RESOURCE_EXHAUSTED" in f for f in r["failures"])
    assert base["completed"] == N * TURNS and base["failed"] == 0
    assert reuse["failed"] == 1 and reuse["failed_by_code"] == {"RESOURCE_EXHAUSTED": 1}
    assert reuse["conversations_failed"] == 1 and reuse["abandoned"] == TURNS - 2
    assert reuse["completed"] == N * TURNS - (TURNS - 1)
    seen = Counter(q["turn"] for q in passes(fake.requests)["reuse"])
    assert seen == {1: N, 2: N, 3: N - 1, 4: N - 1}  # the failed conversation sent no third turn
    printed = " ".join(printed.split())  # the terminal's tables wrap their titles
    assert "TTFT by where the prefix came from" in printed and "CHECK FAILED" in printed  # printed, no --out


def test_the_servers_word_is_checked(capsys):
    """A baseline turn that reuses fails the run; a first turn that reuses (the server still holds an earlier run
    with the same --seed) is a warning; a load over the server's limits fails before a turn is sent."""
    fake = FakeDecode(honour_skip=False)
    with serving(fake) as addr:
        rc, r, _ = bench(addr, capsys, "--warmup", "0")
        assert rc == 1 and any("though every request set skip_prefix_cache" in f for f in r["failures"])
    fake = FakeDecode()
    with serving(fake) as addr:
        rc, r, _ = bench(addr, capsys, "--warmup", "0")
        assert rc == 0 and not r["warnings"]
        rc, r, _ = bench(addr, capsys, "--warmup", "0")  # again, same seed: the fake still holds the first run's
        assert rc == 0 and any("first turns reused" in w for w in r["warnings"])
        assert r["passes"]["reuse"]["turn1_reused_tokens"] > 0 and r["passes"]["baseline"]["turn1_reused_tokens"] == 0
    fake = FakeDecode(max_seq_len=40)
    with serving(fake) as addr:
        rc, r, _ = bench(addr, capsys)
    assert rc == 1 and "over the server's max_seq_len of 40" in r["failures"][0] and not fake.requests


@pytest.mark.parametrize("extra, message", [
    (["--api", "http://127.0.0.1:8000"], "--multi-turn with --api is not supported yet"),
    (["--request-rate", "5"], "--multi-turn with --request-rate is not supported yet"),
    (["--turns", "0"], "--turns and --user-len must be >= 1"),
    (["--user-len", "0"], "--turns and --user-len must be >= 1"),
    (["--model", "tiny", "--input-len", "1000", "--turns", "5", "--user-len", "800"], "over tiny's context of 4096"),
])
def test_bad_flag_combinations(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--multi-turn", "--addr", "127.0.0.1:1", "--vocab-size", "512", "--input-len", "16", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_turns_without_multi_turn_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--addr", "127.0.0.1:1", "--vocab-size", "512", "--turns", "3"])
    assert e.value.code == 2 and "add --multi-turn" in capsys.readouterr().err


def test_length_buckets():
    assert [length_bucket(n) for n in (0, 1023, 1024, 2047, 2048, 3072, 4095, 8191, 8192, 32767, 32768, 10**6)] == [
        "<1k", "<1k", "1-2k", "1-2k", "2-3k", "3-4k", "3-4k", "6-8k", "8-16k", "16-32k", "32k+", "32k+"]
    assert BUCKETS == ("<1k", "1-2k", "2-3k", "3-4k", "4-6k", "6-8k", "8-16k", "16-32k", "32k+")
