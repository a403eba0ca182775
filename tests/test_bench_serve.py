"""`kvtransfer-bench serve` against a real colocated decode server (tiny preset, CPU): every
request completes, nothing fails, and the result carries vLLM's metric names."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from bench.cli import build_parser, main
from bench.measure.launch import ROOT, colocated_server
from bench.runs.serve import METRICS, PERCENTILES, ServeConfig, length_range, make_prompts, sustained
from bench.runs.serve import config as serve_config

VLLM_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput"] + [
    f"{stat}_{m}_ms" for m in METRICS for stat in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with colocated_server(str(tmp_path_factory.mktemp("logs")), "tiny", "float32", "cpu") as srv:
        yield srv


def run_cli(argv, capsys) -> tuple[int, dict]:
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_serve_concurrency(server, capsys, tmp_path):
    rc, r = run_cli(["serve", "--addr", server.addr, "--model", "tiny", "--concurrency", "4", "--num-prompts", "8",
                     "--input-len", "24", "--input-len-range", "0.5", "--output-len", "6", "--out", str(tmp_path)],
                    capsys)
    assert rc == 0 and r["kind"] == "serve" and r["ok"], r["failures"]
    assert set(VLLM_KEYS) <= set(r)
    assert r["completed"] == 8 and r["failed"] == 0 and r["failed_by_code"] == {} and r["not_sent"] == 0
    assert r["total_output_tokens"] == 8 * 6 and r["output_lens"] == [6] * 8
    assert r["total_input_tokens"] == sum(r["input_lens"]) and all(12 <= n <= 36 for n in r["input_lens"])
    assert r["max_concurrency"] == 4 and r["request_rate"] == "inf"
    for m in METRICS:
        assert 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"], m
    assert r["median_ttft_ms"] <= r["median_e2el_ms"]
    assert r["request_throughput"] == pytest.approx(8 / r["duration"])
    report = (tmp_path / "report.md").read_text()
    assert (tmp_path / "result.json").exists() and "TTFT" in report and "sustained" in report
    assert r["sustained_output_throughput"] > 0 and 0 < r["sustained_window_s"] < r["duration"]


def test_serve_through_the_openai_front(server, capsys, tmp_path):
    """`--api URL`: the same prompts through kvtransfer-api (no tokenizer: token ids in and out), every token timed
    and counted as over gRPC; a bad --api is a usage error."""
    from support.apifront import api_front

    with api_front(str(tmp_path / "api.log"), server.addr) as url:
        rc, r = run_cli(["serve", "--api", url, "--model", "tiny", "--concurrency", "4", "--num-prompts", "8",
                         "--input-len", "24", "--input-len-range", "0.5", "--output-len", "6"], capsys)
    assert rc == 0 and r["ok"], (r["failures"], r["errors"])
    assert r["completed"] == 8 and r["failed"] == 0 and r["output_lens"] == [6] * 8
    assert r["config"]["api"] == url and 0 < r["median_itl_ms"] <= r["p99_itl_ms"]
    with pytest.raises(ValueError, match="loopback"):
        ServeConfig(api="http://10.1.2.3:8000", model="tiny")
    with pytest.raises(ValueError, match="--mode"):
        ServeConfig(api="http://127.0.0.1:8000", model="tiny", mode="bulk")


def _req(start: float, *times: float, code=None) -> dict:
    return {"start": start, "times": list(times), "code": code}


def test_sustained_counts_tokens_between_first_resend_and_last_send():
    # two clients: r0 and r1 open at t=0; r2 is the first re-send (t=2.5), r3 the last send (t=3.5)
    sent = [_req(0.0, 1.0, 2.0), _req(0.0, 1.5, 2.0, 2.6, 3.2), _req(2.5, 0.5, 1.0, 1.5), _req(3.5, 0.2)]
    r = sustained(sent, 2)
    # in [2.5, 3.5): r1 at 2.6 and 3.2, r2 at 3.0; the opening burst's tokens before 2.5 and r2's at 3.5, 4.0 are out
    assert r["sustained_window_s"] == pytest.approx(1.0)
    assert r["sustained_output_throughput"] == pytest.approx(3.0)
    failed = [sent[0], {**sent[1], "code": "CANCELLED"}, *sent[2:]]  # a failed request's tokens do not count
    assert sustained(failed, 2)["sustained_output_throughput"] == pytest.approx(1.0)
    assert sustained(sent[:3], 2)["sustained_output_throughput"] is None  # no re-send after the first
    assert sustained(sent, 0)["sustained_output_throughput"] is None  # no concurrency bound (or a request rate)
    burst = [_req(0.0, 0.9), _req(0.0, 0.9), _req(1.0, 0.5), _req(1.0001, 0.5)]  # both re-sends in one burst
    assert sustained(burst, 2)["sustained_output_throughput"] is None  # a degenerate window, not 0 tok/s


def test_serve_poisson_and_failures_by_code(server, capsys):
    rc, r = run_cli(["serve", "--addr", server.addr, "--vocab-size", "512", "--request-rate", "50",
                     "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--warmup", "0"], capsys)
    assert rc == 0 and r["completed"] == 4 and r["request_rate"] == 50.0
    # ids outside the server's vocabulary: every request is refused with INVALID_ARGUMENT, counted by code
    rc, r = run_cli(["serve", "--addr", server.addr, "--vocab-size", "100000", "--num-prompts", "3",
                     "--input-len", "64", "--output-len", "2", "--warmup", "0"], capsys)
    assert rc == 1 and not r["ok"] and r["completed"] == 0
    assert r["failed"] == 3 and r["failed_by_code"] == {"INVALID_ARGUMENT": 3} and r["median_ttft_ms"] is None


def test_serve_config_bounds():
    with pytest.raises(ValueError, match="loopback"):
        ServeConfig(addr="10.0.0.1:50051", vocab_size=512)
    with pytest.raises(ValueError, match="vocab"):
        ServeConfig(addr="127.0.0.1:1")
    cfg = ServeConfig(addr="localhost:1", model="tiny", num_prompts=50, input_len=100, input_len_range=0.2, seed=3)
    prompts = make_prompts(cfg)
    assert cfg.vocab_size == 512 and prompts == make_prompts(cfg)
    assert all(80 <= len(p) <= 120 and 0 <= min(p) and max(p) < 512 for p in prompts)


def readme_bench_line(command: str) -> list[str]:
    """The argv of the README's `kvtransfer-bench COMMAND ...` example (in "## The bench"), comment dropped."""
    text = open(os.path.join(ROOT, "README.md")).read().split("\n## The bench", 1)[1]
    lines = [x for x in text.split("```", 2)[1].splitlines() if x.startswith(f"kvtransfer-bench {command} ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0], comments=True)[1:]


def test_readme_serve_example_is_complete():
    """The README's `serve` line as printed gets past its flags (exit 2 there is a usage error) to the load."""
    args = build_parser().parse_args(readme_bench_line("serve"))
    try:
        cfg = serve_config(args)
    except ValueError as e:
        pytest.fail(f"the README's serve example exits 2: {e}")
    assert cfg.model and cfg.vocab_size >= 1


def test_serve_without_vocabulary_says_what_to_add(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--addr", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "add --model" in err and "--vocab-size" in err, err


def test_a_share_of_long_prompts(server, capsys, tmp_path):
    """--long-share: that share of the prompts drawn from --long-len-range; TTFT and ITL reported apart."""
    rc, r = run_cli(["serve", "--addr", server.addr, "--model", "tiny", "--concurrency", "4", "--num-prompts", "12",
                     "--input-len", "16", "--output-len", "4", "--long-share", "0.5", "--long-len-range", "60,80",
                     "--out", str(tmp_path)], capsys)
    assert rc == 0 and r["ok"], r["failures"]
    split = r["by_length"]
    longs = [n for n in r["input_lens"] if n >= 60]
    assert 0 < len(longs) < 12 and all(n <= 80 for n in longs)
    assert split["long"]["completed"] == len(longs) and split["short"]["completed"] == 12 - len(longs)
    for part in split.values():
        assert 0 < part["median_ttft_ms"] <= part["p99_ttft_ms"] and 0 < part["median_itl_ms"] <= part["p99_itl_ms"]
    assert "Short and long prompts apart" in (tmp_path / "report.md").read_text()


def test_long_prompts_are_drawn_apart_from_the_others():
    base = ServeConfig(addr="localhost:1", vocab_size=512, num_prompts=400, input_len=100, input_len_range=0.2, seed=3)
    plain = make_prompts(base)
    rng = __import__("numpy").random.default_rng(3)  # the draw without long prompts is the one earlier runs made
    assert [len(p) for p in plain] == rng.integers(80, 121, 400).tolist()
    mixed = make_prompts(ServeConfig(**{**base.__dict__, "long_share": 0.1, "long_len": (1000, 2000)}))
    longs = [i for i, p in enumerate(mixed) if len(p) >= 1000]
    assert 20 <= len(longs) <= 60 and all(len(mixed[i]) <= 2000 for i in longs)
    assert all(len(m) == len(p) for i, (m, p) in enumerate(zip(mixed, plain)) if i not in longs)
    assert all(len(p) >= 1000 for p in make_prompts(ServeConfig(**{**base.__dict__, "long_share": 1.0})))
    for bad in ({"long_share": 1.5}, {"long_share": -0.1}, {"long_len": (2000, 1000)}, {"long_len": (0, 10)}):
        with pytest.raises(ValueError, match="--long"):
            ServeConfig(**{**base.__dict__, **bad})
    with pytest.raises(ValueError, match="within the other prompts' lengths"):  # 120 >= 110: a mixed split
        ServeConfig(**{**base.__dict__, "long_share": 0.1, "long_len": (110, 2000)})
    with pytest.raises(ValueError, match="over tiny's context of 4096"):  # 4090 + 16 output tokens
        ServeConfig(addr="localhost:1", model="tiny", long_share=0.1, long_len=(4000, 4090))
    assert length_range("16384,32768") == (16384, 32768)
    with pytest.raises(Exception, match="LO,HI"):
        length_range("16k")


def test_serve_samples_when_told(server, capsys, tmp_path):
    """--temperature/--top-p: every request carries them (gRPC: GenerateRequest.sampling, no seed, so the server
    draws one; HTTP: the body's temperature and top_p), and a sampled run completes as a greedy one does."""
    import asyncio

    from bench.measure import openai_stream, serve_doors

    rc, r = run_cli(["serve", "--addr", server.addr, "--model", "tiny", "--concurrency", "4", "--num-prompts", "6",
                     "--input-len", "16", "--output-len", "5", "--temperature", "1", "--top-p", "0.9",
                     "--out", str(tmp_path)], capsys)
    assert rc == 0 and r["ok"] and r["completed"] == 6 and r["output_lens"] == [5] * 6, r["failures"]
    assert (r["config"]["temperature"], r["config"]["top_p"]) == (1.0, 0.9)
    assert "sampling at temperature 1, top_p 0.9" in (tmp_path / "report.md").read_text()

    sent = []

    class Stub:
        def Generate(self, req, timeout, metadata):  # noqa: N802 (the gRPC method's name)
            sent.append(req)

            async def stream():
                return
                yield
            return stream()

    for temperature in (0.7, 0.0):
        cfg = ServeConfig(model="tiny", temperature=temperature, top_p=0.8)
        asyncio.run(serve_doors.one_request(Stub(), [1, 2], cfg, 5.0, None))
    assert sent[0].HasField("sampling") and not sent[0].sampling.HasField("seed")
    assert sent[0].sampling.temperature == pytest.approx(0.7) and sent[0].sampling.top_p == pytest.approx(0.8)
    assert not sent[1].HasField("sampling")  # greedy: absent, as before the field existed

    bodies = []

    class Response:
        status = 400

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def text(self):
            return "{}"

    class Session:
        def post(self, url, json, headers, timeout):
            bodies.append(json)
            return Response()

    asyncio.run(openai_stream.one_request(Session(), "http://127.0.0.1:1", "m", [1], 4, 5.0, {}, temperature=0.7,
                                          top_p=0.8))
    assert (bodies[0]["temperature"], bodies[0]["top_p"]) == (0.7, 0.8)
    with pytest.raises(ValueError, match="--temperature"):
        ServeConfig(model="tiny", temperature=-1)
    with pytest.raises(ValueError, match="--top-p"):
        ServeConfig(model="tiny", temperature=1, top_p=0)
