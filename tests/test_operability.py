"""Operability (issue #15) in real processes on CPU: a graceful stop, one server per port, one outcome per
request, flags checked at start, a decode server that listens while it waits for its peer, and the README's
CPU quickstart run as written (ports aside).

Why one colocated server for three tests: each start costs seconds on a shared CPU; the tests run in file
order and the last one (SIGTERM) ends it. It and the decode server waiting for its peer are forked from the test
worker's fork server (support/forked.py: the server's own flags, signals and exit code, without the seconds of
imports); the README quickstart, the second server on a taken port and the bad flags run `python -m` as written.
"""

from __future__ import annotations

import argparse

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.measure.launch import ROOT, free_port, spawn, stop, wait_serving
from decode_server.client import generate
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support import forked

S = grpc.StatusCode
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GRACE_S = 1.5


def outcomes(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "kvt_requests_total"}


def in_flight(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "kvt_inflight_requests")


async def cancelled_unread(addr: str, mport: int, ids, n: int) -> list[tuple]:
    """n calls never read, cancelled once the server has admitted all of them: a call cancelled before the server
    has it never reaches a handler, so it has no outcome to count (on a loaded machine a fixed sleep races that)."""
    before = await asyncio.to_thread(in_flight, mport)
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.DecodeStub(ch)
        streams = [stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=3000), timeout=30) for _ in range(n)]
        deadline = time.monotonic() + 30
        while (now := await asyncio.to_thread(in_flight, mport)) < before + n and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert now >= before + n, f"the server admitted {now - before} of {n} calls within 30 s"
        for stream in streams:
            stream.cancel()
        return [(S.CANCELLED if stream.cancelled() else S.UNKNOWN, "", 0) for stream in streams]


def health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


async def call(addr: str, ids, new: int, timeout: float = 30, cancel_after: int | None = None):
    """(status, details, tokens read); cancel_after: cancel once that many tokens are in."""
    async with grpc.aio.insecure_channel(addr) as ch:
        stream = pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=new), timeout=timeout)
        got = 0
        try:
            async for _ in stream:
                got += 1
                if cancel_after is not None and got >= cancel_after:
                    stream.cancel()
                    break
            return (S.CANCELLED if stream.cancelled() else S.OK), "", got
        except asyncio.CancelledError:
            return S.CANCELLED, "", got
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", got


def run_exit(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    d = tmp_path_factory.mktemp("colo")
    addr, mport = f"127.0.0.1:{free_port()}", free_port()
    log = str(d / "decode.log")
    proc = forked.spawn("decode_server", ["--colocated", "--device", "cpu", "--listen", addr, "--max-batch", "2",
                                          "--metrics-port", str(mport), "--shutdown-grace-s", str(GRACE_S)], log)
    try:
        wait_serving(addr, [proc], timeout=120)
        yield addr, mport, proc, log
    finally:
        stop([proc])


def test_second_server_on_a_taken_port_exits_2(colocated, tmp_path):
    addr, _, _, _ = colocated
    port = addr.rsplit(":", 1)[1]
    p = run_exit(["-m", "decode_server", "--colocated", "--device", "cpu", "--listen", addr])
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"port {port} is taken" in p.stderr and "--listen" in p.stderr, p.stderr[-2000:]
    assert len(asyncio.run(generate(addr, [1, 2, 3], 2))["tokens"]) == 2  # the first server still has every call


def test_every_request_ends_in_one_outcome(colocated):
    """A mixed run: answered, refused, cancelled (before and mid-stream), past deadlines; the sum matches."""
    addr, mport, _, log = colocated
    before = outcomes(mport)
    ids = [5, 6, 7]

    async def mixed():
        early = await cancelled_unread(addr, mport, ids, 2)                    # CANCELLED, never read
        jobs = [call(addr, ids, 4) for _ in range(4)]                           # OK
        jobs += [call(addr, [], 4), call(addr, [1, 9999], 4)]                   # INVALID_ARGUMENT
        jobs += [call(addr, ids, 3000, cancel_after=3) for _ in range(2)]      # CANCELLED mid-stream
        jobs += [call(addr, ids, 3000, timeout=0.4) for _ in range(2)]         # DEADLINE_EXCEEDED mid-stream
        return [*await asyncio.gather(*jobs), *early]
    results = asyncio.run(mixed())
    assert [r[0] for r in results[:4]] == [S.OK] * 4, results
    sent = len(results)
    deadline = time.monotonic() + 15
    while True:  # a cancelled handler counts when it unwinds: give it a moment
        now = outcomes(mport)
        delta = {k: now.get(k, 0) - before.get(k, 0) for k in now}
        if sum(delta.values()) >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(delta.values()) == sent, delta
    assert delta.get("OK") == 4 and delta.get("INVALID_ARGUMENT") == 2, delta
    assert delta.get("CANCELLED", 0) + delta.get("DEADLINE_EXCEEDED", 0) == 6, delta
    assert delta.get("CANCELLED", 0) >= 2 and delta.get("DEADLINE_EXCEEDED", 0) >= 2, delta
    text = open(log).read()
    assert "Traceback" not in text, text[-3000:]  # e.g. a status sent after gRPC already ended the call


def test_sigterm_drains_then_exits_0(colocated):
    """Short requests finish; long ones (and one waiting for a slot) end UNAVAILABLE; exit 0 within the grace."""
    addr, _, proc, log = colocated

    async def scenario():
        long_ = [asyncio.ensure_future(call(addr, [1, 2, 3], 4000, timeout=60)) for _ in range(2)]
        await asyncio.sleep(0.5)  # both slots taken
        waiting = asyncio.ensure_future(call(addr, [4, 5, 6], 4, timeout=60))  # waits for a slot
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        probe = await asyncio.to_thread(health, addr)
        refused = await call(addr, [1, 2], 2)
        results = await asyncio.gather(*long_, waiting)
        code = await asyncio.to_thread(proc.wait, GRACE_S + 15)
        return probe, refused, results, code, time.monotonic() - t0

    probe, refused, results, code, took = asyncio.run(scenario())
    text = open(log).read()
    assert probe == NOT_SERVING, text[-3000:]
    assert refused[0] == S.UNAVAILABLE and "shutting down" in refused[1], refused
    for status, details, got in results:
        assert status == S.UNAVAILABLE and "server shutting down" in details, (status, details, got)
    assert code == 0, text[-3000:]
    assert took < GRACE_S + 10, took
    assert "Traceback" not in text, text[-3000:]
    stopped = [line for line in text.splitlines() if "stopped on SIGTERM" in line]
    assert len(stopped) == 1 and "3 requests in flight, 0 finished, 3 ended UNAVAILABLE" in stopped[0], stopped


def readme_block(marker: str) -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split(f"<!-- {marker}", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.strip()]


def as_module(line: str, ports: dict[str, str]) -> tuple[str, list[str]]:
    """`.venv/bin/kvtransfer-decode ARGS` -> ("decode_server", ARGS with this test's free ports)."""
    for old, new in ports.items():
        line = line.replace(old, new)
    argv = shlex.split(line)
    module = {"kvtransfer-prefill": "prefill_server", "kvtransfer-decode": "decode_server",
              "kvtransfer-client": "decode_server.client"}[os.path.basename(argv[0])]
    return module, argv[1:]


def test_readme_cpu_quickstart_pair_then_sigterm(tmp_path):
    """The README's CPU pair as written; a second prefill on its port exits 2; SIGTERM stops both with 0."""
    ports = {p: str(free_port()) for p in ("29500", "50061", "50051")}
    (prefill, p_args), (decode, d_args), (client, c_args) = [as_module(x, ports) for x in readme_block("cpu-quickstart:")]
    procs = [spawn(prefill, p_args, str(tmp_path / "prefill.log")), spawn(decode, d_args, str(tmp_path / "decode.log"))]
    try:
        wait_serving(f"127.0.0.1:{ports['50051']}", procs, timeout=180)
        out = run_exit(["-m", client, *c_args])
        assert out.returncode == 0 and '"tokens": [' in out.stdout, out.stderr
        again = run_exit(["-m", prefill, *[a if a != f"tcp://127.0.0.1:{ports['29500']}" else
                                           f"tcp://127.0.0.1:{free_port()}" for a in p_args]])
        assert again.returncode == 2 and f"port {ports['50061']} is taken" in again.stderr, again.stderr[-2000:]
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=30) == 0
    finally:
        stop(procs)
    for name in ("prefill", "decode"):
        text = open(tmp_path / f"{name}.log").read()
        assert f"{name} server stopped on SIGTERM" in text and "Traceback" not in text, text[-3000:]


def test_readme_cpu_quickstart_colocated():
    lines = readme_block("cpu-quickstart-colocated")
    assert any("--colocated" in x for x in lines) and any("kvtransfer-client" in x for x in lines)
    for line in lines:  # each line's flags parse (the pair test above runs the same programs)
        module, argv = as_module(line, {})
        if module == "decode_server":
            from decode_server.config import DecodeConfig
            from kvtransfer.rpc.configargs import from_args
            assert from_args(DecodeConfig, argv, "").colocated


def test_decode_listens_and_waits_for_its_peer(tmp_path):
    """No prefill worker: the port answers NOT_SERVING at once, the log names the address and flag about
    every 10 s, and the handshake timeout exits 2 naming --prefill-addr and --handshake-timeout-s."""
    addr, peer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = str(tmp_path / "decode.log")
    proc = forked.spawn("decode_server", ["--device", "cpu", "--listen", addr, "--prefill-addr", peer,
                                          "--dist-init", f"tcp://127.0.0.1:{free_port()}",
                                          "--handshake-timeout-s", "11"], log)
    try:
        status, deadline = None, time.monotonic() + 60
        while status is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = health(addr)
            except grpc.RpcError:
                time.sleep(0.2)
        assert status == NOT_SERVING, open(log).read()[-3000:]
        assert proc.wait(timeout=60) == 2
    finally:
        stop([proc])
    text = open(log).read()
    assert f"waiting for the prefill worker at {peer} (--prefill-addr)" in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "cannot start" in last and peer in last and "--prefill-addr" in last and "--handshake-timeout-s" in last
    assert "Traceback" not in text


BAD_FLAGS = [
    ("decode_server", ["--device", "tpu"], "--device"),
    ("decode_server", ["--log-level", "LOUD"], "--log-level"),
    ("decode_server", ["--request-timeout-s", "-1"], "--request-timeout-s"),
    ("decode_server", ["--dist-init", "garbage://x"], "--dist-init"),
    ("decode_server", ["--prefill-addr", "nonsense::::"], "--prefill-addr"),
    ("decode_server", ["--listen", "127.0.0.1:70000"], "--listen"),
    ("decode_server", ["--listen", ":-1"], "--listen"),
    ("decode_server", ["--max-batch", "x"], "--max-batch"),
    ("prefill_server", ["--listen", "127.0.0.1:65536"], "--listen"),
    ("prefill_server", ["--device", "tpu"], "--device"),
    ("prefill_server", ["--dist-init", "tcp://host"], "--dist-init"),
    ("prefill_server", ["--shutdown-grace-s", "-1"], "--shutdown-grace-s"),
    ("decode_server.client", ["--ids", "1,2", "--max-new-tokens", "-1"], "--max-new-tokens"),
    ("decode_server.client", ["--ids", f"1,{2**63}"], "--ids"),
    ("decode_server.client", ["--ids", "1", "--addr", "nonsense::::"], "--addr"),
    ("bench.cli", ["serve", "--concurrency", "x"], "--concurrency"),
    # a device this machine lacks: one line before any server starts (a traceback after ~20 s of runs, before)
    ("bench.cli", ["ttft", "--prefill-device", "cuda:99"], "--prefill-device cuda:99"),
    ("bench.cli", ["interference", "--device", "cuda:99", "--streams", "1", "--arrivals", "64"], "--device cuda:99"),
    ("bench.cli", ["offload", "--peer-device", "cuda:99", "--lengths", "16"], "--peer-device cuda:99"),
]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("run", ["ttft", "interference"])
def test_a_cuda_transport_without_cuda_is_a_usage_error(run, capsys):
    from bench.cli import main
    with pytest.raises(SystemExit) as e:
        extra = ["--device", "cpu", "--streams", "1", "--arrivals", "64"] if run == "interference" else []
        main([run, "--transport", "cuda_ipc", *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--transport cuda_ipc needs CUDA" in err, err


@pytest.mark.parametrize("module,argv,flag", BAD_FLAGS, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_flag_exits_2_naming_it(module, argv, flag, capsys):
    """In-process (`main(argv)`); the first case of each program also runs as a real process below."""
    import importlib
    main = importlib.import_module(f"{module}.__main__" if module.endswith("_server") else module).main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_bad_flags_in_real_processes():
    for module, argv, flag in (BAD_FLAGS[0], BAD_FLAGS[12]):  # a server and the client (each start costs seconds)
        p = run_exit(["-m", module, *argv])
        err = p.stderr.strip()
        assert p.returncode == 2 and len(err.splitlines()) == 1 and flag in err and "Traceback" not in err, err


def test_every_flag_has_help_and_default():
    from api_server.config import ApiConfig
    from decode_server.config import DecodeConfig
    from kvtransfer.rpc.configargs import Parser, add_arguments
    from prefill_server.config import PrefillConfig
    from router.config import RouterConfig
    for cls in (DecodeConfig, PrefillConfig, ApiConfig, RouterConfig):
        parser = Parser(prog="x")
        add_arguments(parser, cls)
        text = " ".join(parser.format_help().split())
        flags = parser._actions[1:]
        assert len(flags) == len(cls.__dataclass_fields__)
        shown = [a for a in flags if a.help != argparse.SUPPRESS]  # the test-only fault flags are hidden
        assert {a.dest for a in flags} - {a.dest for a in shown} <= {"fail_scheduler_after_steps", "fail_after_layers",
                                                                       "fail_stall_s", "fail_requests"}
        for action in shown:
            assert action.help and len(action.help) > 8, action.dest
        for action in flags:
            assert cls.__dataclass_fields__[action.dest].metadata["help"], action.dest
        # every default shown once, but an empty string's ("(default: )" says nothing; --help said so on 14 flags)
        assert text.count("(default:") == len([a for a in shown if a.default != "" or "(default" in a.help])
        assert "(default: )" not in text
    for name in ("max_batch", "max_seq_len", "cuda_graphs", "prefill_chunk", "admission_wait_s",
                 "stream_buffer_tokens", "shutdown_grace_s"):
        assert DecodeConfig.__dataclass_fields__[name].metadata["help"], name


BENCH_OUTPUTS = {"report.md"}  # written under --out, not shipped


def test_no_references_to_files_outside_the_repo():
    texts = {"README.md": open(os.path.join(ROOT, "README.md")).read()}
    from bench.cli import build_parser
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        texts[f"kvtransfer-bench {name} --help"] = sub.format_help()
    for where, text in texts.items():
        for ref in set(re.findall(r"[\w./-]+\.md\b", text)) - BENCH_OUTPUTS:
            path = ref
            assert os.path.exists(os.path.join(ROOT, path)) or os.path.exists(os.path.join(ROOT, "docs", path)), \
                f"{where} names {ref}, which is not in the repository"


def test_k8s_manifest_stops_gracefully():
    """The pair's pod stops the decode server first (it drains, still prefilling what it admitted), then the prefill
    worker: a native sidecar (an init container restarted Always) gets its SIGTERM after the main containers exit,
    so the period must hold both graces, one after the other."""
    import yaml
    text = open(os.path.join(ROOT, "deploy", "k8s", "pair.yaml")).read()
    spec = next(yaml.safe_load_all(text))["spec"]["template"]["spec"]
    sidecars = {c["name"]: c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"}
    assert list(sidecars) == ["prefill"] and [c["name"] for c in spec["containers"]] == ["decode"], spec
    graces = [float(c["command"][c["command"].index("--shutdown-grace-s") + 1])
              for c in (sidecars["prefill"], spec["containers"][0])]
    assert sum(graces) + 5 <= spec["terminationGracePeriodSeconds"], (spec["terminationGracePeriodSeconds"], graces)
    assert spec["containers"][0]["readinessProbe"] == {"grpc": {"port": 50051}, "periodSeconds": 2,
                                                       "failureThreshold": 1}


def test_readme_demo_output_is_what_demo_prints():
    """The README's demo block: the title and columns `kvtransfer-bench demo` prints, from the demo's own config."""
    from dataclasses import asdict
    from unittest import mock

    from bench.report.kinds import tables_for
    from bench.runs import demo, ttft
    with mock.patch.object(ttft, "job_for", side_effect=lambda cfg: cfg):
        cfg = asdict(demo.job(None))
    tables = tables_for({"kind": "ttft", "ok": True, "config": cfg, "rows": [], "links": {}, "verified": True,
                         "bytes_per_token": 1024})
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("<!-- demo-output -->", 1)[1].split("```", 2)[1]
    assert tables[0].title in block
    header = next(line for line in block.splitlines() if "tokens" in line and "mode" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")] == tables[0].headers
    rows = [line for line in block.splitlines() if line.startswith("│")]
    assert {(r.split("│")[1].strip(), r.split("│")[2].strip()) for r in rows[:4]} == \
        {(str(n), m) for n in cfg["lengths"] for m in cfg["modes"]}
