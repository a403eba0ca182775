"""`kvtransfer-bench serve` against a real colocated decode server (tiny preset, CPU): every
request completes, nothing fails, and the result carries vLLM's metric names."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from bench.cli import build_parser, main
from bench.measure import roofline
from bench.measure.launch import ROOT, colocated_server
from bench.runs import serve
from bench.runs.serve import METRICS, PERCENTILES, ServeConfig, length_range, make_prompts, sustained
from bench.runs.serve import config as serve_config
from kvtransfer.model.spec import load_config

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
    # a single --concurrency is no sweep; on this CPU-only process the roofline is off, and the report says why
    assert "sweep" not in r and not (tmp_path / "c4").exists()
    assert r["roofline"] == {"on": False, "why": "this bench process sees no CUDA device, and the GEMM rate is "
                             "measured on a GPU only"} and r["of_roofline"] is None
    assert "Compute roofline" in report and "sees no CUDA device" in report


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


FAKE_RATES = {"device": "fake", "rows": 2048, "dtype": "bfloat16", "reps": 7, "calls_per_rep": 10,
              "layer_tflops": 1e-6, "lm_head_tflops": 2e-6,
              "shapes": {"qkv": {"n": 128, "k": 64, "us": 1.0, "tflops": 1e-6}}}


def test_serve_sweeps_concurrencies_against_one_server(server, capsys, tmp_path, monkeypatch):
    """--concurrency 2,4: two runs against the module's server, each in result.json's `sweep`, in the summary (file
    and console) and in OUT/c<N>/; the roofline's figures per run from a stand-in measurement (none runs on CPU)."""
    monkeypatch.setattr(roofline, "cuda_visible", lambda: True)
    monkeypatch.setattr(roofline, "measure_gemm", lambda dims, device: FAKE_RATES)
    rc = main(["serve", "--addr", server.addr, "--model", "tiny", "--concurrency", "2,4", "--num-prompts", "4",
               "--prompts-per-concurrency", "2", "--input-len", "12", "--output-len", "4", "--out", str(tmp_path)])
    console = capsys.readouterr().out.strip().splitlines()
    r = json.loads(console[-1])
    assert "Serving sweep" in "\n".join(console[:-1])  # the summary table on the console
    assert rc == 0 and r["ok"] and r["complete"], r["failures"]
    assert r["concurrencies"] == [2, 4] and [x["max_concurrency"] for x in r["sweep"]] == [2, 4]
    assert [x["num_prompts"] for x in r["sweep"]] == [4, 8]  # max(--num-prompts 4, 2 x concurrency)
    assert [x["completed"] for x in r["sweep"]] == [4, 8] and all(x["ok"] for x in r["sweep"])
    assert [row["max_concurrency"] for row in r["summary"]] == [2, 4]
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert [x["completed"] for x in on_disk["sweep"]] == [4, 8] and on_disk["complete"]
    for c, n in ((2, 4), (4, 8)):
        run = json.loads((tmp_path / f"c{c}" / "result.json").read_text())
        assert run["max_concurrency"] == c and run["completed"] == n and "sweep" not in run
        assert "Serving benchmark" in (tmp_path / f"c{c}" / "report.md").read_text()
    for x, row in zip(r["sweep"], r["summary"]):
        dims = roofline.Dims.of(load_config("tiny"))
        lens = [len(p) for p in make_prompts(ServeConfig(model="tiny", num_prompts=x["num_prompts"], input_len=12))]
        want = roofline.run_figures(FAKE_RATES, dims, lens, 4, x["output_throughput"])
        assert x["roofline_output_tok_s"] == pytest.approx(want["roofline_output_tok_s"])
        assert row["of_roofline"] == pytest.approx(x["output_throughput"] / x["roofline_output_tok_s"])
        assert row["median_ttft_ms"] == x["median_ttft_ms"] and row["p99_itl_ms"] == x["p99_itl_ms"]
    report = (tmp_path / "report.md").read_text()
    summary = report.split("## Serving sweep", 1)[1].split("##", 1)[0]
    rows = [line for line in summary.splitlines() if line.startswith("| 2 |") or line.startswith("| 4 |")]
    assert len(rows) == 2 and "roofline tok/s" in summary and "TTFT p99 ms" in summary
    assert "Compute roofline -- bf16 GEMM rate at 2,048 rows on fake" in report


def test_a_failed_run_does_not_stop_the_sweep(server, capsys, tmp_path, monkeypatch):
    """The first concurrency's run raises: recorded, the next one runs, `ok` is false; result.json is rewritten after
    each run (the second run starts with the first on disk, marked incomplete)."""
    real, on_disk = serve.run_serve, []

    def flaky(cfg, step, metadata):
        if cfg.concurrency == 3:
            raise RuntimeError("boom")
        on_disk.append(json.loads((tmp_path / "result.json").read_text()))
        return real(cfg, step, metadata)

    monkeypatch.setattr(serve, "run_serve", flaky)
    rc, r = run_cli(["serve", "--addr", server.addr, "--model", "tiny", "--concurrency", "3,2", "--num-prompts", "3",
                     "--input-len", "8", "--output-len", "3", "--out", str(tmp_path)], capsys)
    assert rc == 1 and not r["ok"] and r["complete"]
    assert r["failures"] == ["c=3: the run stopped: RuntimeError: boom"]
    assert [x["completed"] for x in r["sweep"]] == [0, 3] and r["sweep"][1]["ok"]
    assert not on_disk[0]["complete"] and [x["max_concurrency"] for x in on_disk[0]["sweep"]] == [3]
    assert "failed: c=3: the run stopped" in (tmp_path / "report.md").read_text()


def test_concurrency_list_and_prompts_per_concurrency():
    args = build_parser().parse_args(["serve", "--model", "tiny", "--concurrency", "64,128,256",
                                      "--prompts-per-concurrency", "8", "--num-prompts", "1000"])
    assert [(c.concurrency, c.num_prompts) for c in serve.configs(args)] == [(64, 1000), (128, 1024), (256, 2048)]
    single = build_parser().parse_args(["serve", "--model", "tiny", "--concurrency", "8"])
    assert [(c.concurrency, c.num_prompts) for c in serve.configs(single)] == [(8, 100)]
    assert serve.configs(build_parser().parse_args(["serve", "--model", "tiny"]))[0].concurrency is None
    for bad in ("0,4", "4,4", "4,x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--concurrency", bad])
    with pytest.raises(ValueError, match="needs K >= 1 and --concurrency"):
        serve.configs(build_parser().parse_args(["serve", "--model", "tiny", "--prompts-per-concurrency", "2"]))


def test_roofline_asked_for_without_a_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--addr", "127.0.0.1:1", "--model", "tiny", "--roofline"])
    assert e.value.code == 2 and "--roofline: this bench process sees no CUDA device" in capsys.readouterr().err


def test_request_flops_of_qwen_by_hand():
    """qwen2.5-7b (hidden 3584, 28 q / 4 kv heads of 128, MLP 18944, 28 layers, vocab 152064), a 1,024-token prompt
    and 128 output tokens: 1,151 tokens fed (the last output token never is)."""
    dims = roofline.Dims.of(load_config("qwen2.5-7b"))
    per_layer = 3584 * 3584 + 2 * 3584 * 512 + 3584 * 3584 + 3 * 3584 * 18944  # q, k, v, o, gate, up, down
    assert per_layer == 233_046_016
    fed = 1024 + 128 - 1
    layers = 2 * per_layer * 28 * fed  # 15.02 TFLOP
    attention = 28 * sum(2 * 2 * 28 * 128 * (t + 1) for t in range(fed))  # QK^T + PV, position t reads t + 1 keys
    lm_head = 2 * 3584 * 152064 * 128  # logits for the 128 rows that pick a token
    got = roofline.request_flops(dims, 1024, 128)
    assert got == {"layers": layers, "attention": attention, "lm_head": lm_head,
                   "total": layers + attention + lm_head}
    assert got["total"] == 15_426_857_205_760
    # the roofline: the FLOPs at the measured rates; layer GEMMs at 700 TFLOP/s, lm_head at 600
    rates = {"layer_tflops": 700.0, "lm_head_tflops": 600.0}
    seconds = (layers + attention) / 700e12 + lm_head / 600e12
    fig = roofline.run_figures(rates, dims, [1024, 1024], 128, 3000.0)
    assert fig["roofline_output_tok_s"] == pytest.approx(128 / seconds)  # ~5,810 tok/s
    assert fig["gemm_tflops"] == pytest.approx(got["total"] / seconds / 1e12)
    assert fig["of_roofline"] == pytest.approx(3000.0 * seconds / 128)
    assert roofline.run_figures(rates, dims, [1000, 1048], 128, None)["of_roofline"] is None
    # prompts of several lengths: the mean of each request's count (attention grows with the square of its length)
    two = roofline.mean_request_flops(dims, [100, 300], 8)
    assert two["attention"] == (roofline.request_flops(dims, 100, 8)["attention"]
                                + roofline.request_flops(dims, 300, 8)["attention"]) / 2


@pytest.mark.gpu
@pytest.mark.skipif(not roofline.cuda_visible(), reason="the GEMM rate is measured on a CUDA device only")
def test_gemm_rate_on_the_gpu():
    dims = roofline.Dims.of(load_config("smollm2-135m"))
    m = roofline.measure_gemm(dims, "cuda")
    assert set(m["shapes"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all(s["us"] > 0 and s["tflops"] > 1 for s in m["shapes"].values())
    assert 0 < m["layer_tflops"] < 5000 and m["lm_head_tflops"] == m["shapes"]["lm_head"]["tflops"]
