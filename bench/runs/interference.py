"""How much a long prefill stalls running decodes: colocated vs chunked vs disaggregated.

Why: the cost side of disaggregation is the TTFT overhead (`ttft`); its benefit is that a long
prompt's prefill no longer runs between the decode steps of everyone else (the
benefit side). Per arm, fresh servers (bench/measure/launch.py) take one warm-up request, then B
streams of C prompt tokens each decode until all of them run; then long prompts arrive, one at
a time (each `gap_s` after the previous one's first token), and optionally as a Poisson stream.
Every token's arrival time is recorded on the client; streams are cancelled `gap_s` after the
last long prompt's first token. Figures (bench/measure/interference_stats.py): streams' ITL p50/p99/max,
per arrival its TTFT, the stall (longest stream ITL overlapping its prefill window) and ITL
inside vs outside windows, goodput against a TTFT and an ITL SLO, and an ITL timeline.
Arms: colocated (`--prefill-chunk 0`), chunked (one per `--chunks` size), disagg (a prefill/decode
pair over `transport`; labelled as sharing one device when both servers are on the same one).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from dataclasses import asdict, dataclass

import grpc
import numpy as np
import torch

from bench.common import Job, Step, check_devices, csv, ints
from bench.measure.interference_stats import arm_figures
from bench.measure.launch import colocated_server, server_pair
from decode_server.client import MODES
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_config
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

ARMS = ("colocated", "chunked", "disagg")
SERVER_MAX_NEW_TOKENS = 4096   # the decode server's default --max-new-tokens
WAIT_S = 600.0                 # longest wait for the streams to run / a long prompt's first token


@dataclass(frozen=True)
class InterferenceConfig:
    model: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"                   # colocated server, and the decode server of the pair
    prefill_device: str | None = None     # the pair's prefill server (None: `device`, one shared device)
    streams: int = 32
    context: int = 1024                   # prompt tokens of each stream
    stream_tokens: int | None = None      # max_new_tokens of each stream (None: min(2048, what fits))
    long_tokens: int = 4                  # max_new_tokens of each long prompt (>= 2: its ITL is judged too)
    arrivals: tuple[int, ...] = (4096, 16384, 32000)  # single long prompts, one at a time
    gap_s: float = 1.0                    # before the first arrival, after each first token (the last: the tail)
    poisson_rate: float = 0.0             # long prompts per second after the single ones (0: off)
    poisson_count: int = 8
    poisson_len: int = 4096
    arms: tuple[str, ...] = ARMS
    chunks: tuple[int, ...] = (512, 2048)  # --prefill-chunk of the chunked arms
    transport: str = "gloo"               # disagg data plane (cuda_ipc for one GPU)
    ttft_slo_ms: float = 5000.0
    itl_slo_ms: float = 100.0
    max_batch: int | None = None          # server pool slots (None: streams + long prompts that may overlap)
    max_seq_len: int | None = None        # tokens per slot (None: the longest request)
    server_args: tuple[str, ...] = ()     # extra decode-server flags, every arm
    seed: int = 0
    log_dir: str | None = None

    def __post_init__(self):
        ModelSpec(self.model, self.dtype)
        ctx = load_config(self.model).max_position_embeddings
        if self.streams < 1 or self.context < 1 or self.long_tokens < 1 or not self.arrivals and not self.poisson:
            raise ValueError("streams, context and long tokens must be >= 1, with arrivals or a Poisson rate")
        if min(self.arrivals, default=1) < 1 or self.poisson_count < 1 or self.poisson_len < 1 or self.poisson_rate < 0:
            raise ValueError("arrival and Poisson lengths and the Poisson count must be >= 1, the rate >= 0")
        if not self.arms or not set(self.arms) <= set(ARMS) or "chunked" in self.arms and not self.chunks:
            raise ValueError(f"arms: a comma list of {', '.join(ARMS)}; chunked needs --chunks")
        if min(self.chunks, default=1) < 1 or self.gap_s <= 0 or min(self.ttft_slo_ms, self.itl_slo_ms) <= 0:
            raise ValueError("chunks >= 1; gap and SLOs > 0")
        longest = max([*self.arrivals, *([self.poisson_len] if self.poisson else [])]) + self.long_tokens
        seq = self.max_seq_len or max(longest, self.context + (self.stream_tokens or 2048))
        tokens = self.stream_tokens or min(2048, SERVER_MAX_NEW_TOKENS, seq - self.context)
        object.__setattr__(self, "stream_tokens", tokens)
        object.__setattr__(self, "max_seq_len", seq)
        object.__setattr__(self, "max_batch", self.max_batch or self.streams + (self.poisson_count if self.poisson
                                                                                else 1))
        if not 1 <= tokens <= SERVER_MAX_NEW_TOKENS:
            raise ValueError(f"stream tokens must be 1..{SERVER_MAX_NEW_TOKENS} (the server's --max-new-tokens)")
        if max(self.context + tokens, longest) > min(seq, ctx):
            raise ValueError(f"context + stream tokens ({self.context + tokens}) and the longest long prompt + "
                             f"long tokens ({longest}) must fit --max-seq-len {seq} and the model's {ctx} positions")
        if self.max_batch < self.streams + 1:
            raise ValueError(f"--max-batch {self.max_batch} < streams + 1: the long prompt would find no slot")

    @property
    def poisson(self) -> bool:
        return self.poisson_rate > 0

    def arm_list(self) -> list[tuple[str, int]]:
        return [(a, c) for a in self.arms for c in (self.chunks if a == "chunked" else (0,))]

    def shared_device(self) -> bool:
        return torch.device(self.prefill_device or self.device) == torch.device(self.device)


def label(cfg: InterferenceConfig, arm: str, chunk: int) -> str:
    if arm == "colocated":
        return "colocated"
    if arm == "chunked":
        return f"colocated chunked {chunk}"
    kind = "GPU" if torch.device(cfg.device).type == "cuda" else torch.device(cfg.device).type.upper()
    return f"disaggregated ({cfg.transport}" + (f", sharing one {kind})" if cfg.shared_device() else ")")


def decode_args(cfg: InterferenceConfig, chunk: int) -> list[str]:
    """The decode server's batching flags for one arm; streams live for the whole arm (the default deadline: 120 s)."""
    return ["--max-batch", str(cfg.max_batch), "--max-seq-len", str(cfg.max_seq_len),
            "--request-timeout-s", f"{2 * WAIT_S:g}",
            *(["--prefill-chunk", str(chunk)] if chunk or "--mixed-prefill" not in cfg.server_args else []),
            *cfg.server_args]


def new_rec(kind: str, ids: list[int]) -> dict:
    return dict(kind=kind, tokens=len(ids), ids=ids, sent=0.0, times=[], code=None, error="", first=asyncio.Event())


async def consume(stub, rec: dict, n: int, mode: str) -> dict:
    """One Generate stream: every token's client arrival time; cancelling the task cancels the call."""
    req = pb.GenerateRequest(token_ids=rec.pop("ids"), max_new_tokens=n, mode=MODES[mode])
    rec["sent"] = time.perf_counter()
    try:
        async for _ in stub.Generate(req, timeout=WAIT_S * 2):
            rec["times"].append(time.perf_counter())
            rec["first"].set()
    except grpc.aio.AioRpcError as e:
        rec["code"], rec["error"] = e.code().name, e.details() or ""
    except asyncio.CancelledError:
        rec["code"] = "CANCELLED_BY_BENCH"
    rec["first"].set()
    return rec


async def first_token(rec: dict, what: str) -> None:
    try:
        await asyncio.wait_for(rec["first"].wait(), WAIT_S)
    except TimeoutError:
        raise RuntimeError(f"{what}: no first token after {WAIT_S:g} s") from None
    if not rec["times"]:
        raise RuntimeError(f"{what} failed: {rec['code']}: {rec['error']}")


async def drive(addr: str, cfg: InterferenceConfig, mode: str, vocab: int, step: Step) -> dict:
    """The client side of one arm: raw per-token times of the streams and the long prompts."""
    prompt = lambda n, seed: random_prompt(vocab, n, seed=cfg.seed * 7919 + seed).view(-1).tolist()  # noqa: E731
    async with grpc.aio.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = pbg.DecodeStub(channel)
        warm = await consume(stub, new_rec("warm-up", prompt(min(cfg.context, 64), 1)), 2, mode)
        if warm["code"]:
            raise RuntimeError(f"warm-up request failed: {warm['code']}: {warm['error']}")
        step("warm-up")
        streams = [new_rec("stream", prompt(cfg.context, 100 + i)) for i in range(cfg.streams)]
        tasks = [asyncio.create_task(consume(stub, r, cfg.stream_tokens, mode)) for r in streams]
        try:
            for i, r in enumerate(streams):
                await first_token(r, f"stream {i}")
            start = max(r["times"][0] for r in streams)
            step("streams running")
            longs, long_tasks = [], []

            async def send(kind: str, n: int) -> dict:
                rec = new_rec(kind, prompt(n, 10_000 + len(longs)))
                longs.append(rec)
                long_tasks.append(asyncio.create_task(consume(stub, rec, cfg.long_tokens, mode)))
                return rec

            await asyncio.sleep(cfg.gap_s)
            for n in cfg.arrivals:
                await first_token(await send("single", n), f"long prompt of {n} tokens")
                step(f"arrival {n}")
                await asyncio.sleep(cfg.gap_s)
            if cfg.poisson:
                waits = np.random.default_rng(cfg.seed).exponential(1 / cfg.poisson_rate, cfg.poisson_count)
                sent = []
                for w in waits:
                    await asyncio.sleep(float(w))
                    sent.append(await send("poisson", cfg.poisson_len))
                for r in sent:
                    await first_token(r, f"Poisson long prompt of {cfg.poisson_len} tokens")
                step("Poisson arrivals")
                await asyncio.sleep(cfg.gap_s)
            stop = time.perf_counter()
            ended = [i for i, r in enumerate(streams) if r["code"] is None and tasks[i].done()]
            if ended:
                raise RuntimeError(f"{len(ended)} streams ended before the run did: raise --stream-tokens "
                                   f"(now {cfg.stream_tokens}) or lower --gap-s")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks)
        await asyncio.wait_for(asyncio.gather(*long_tasks), WAIT_S)
    bad = [r for r in streams + longs if r["code"] not in (None, "CANCELLED_BY_BENCH")]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0]['kind']}: {bad[0]['code']}: {bad[0]['error']}")
    return {"streams": [r["times"] for r in streams], "start": start, "stop": stop,
            "longs": [{k: r[k] for k in ("kind", "tokens", "sent", "times")} for r in longs]}


def run_arm(cfg: InterferenceConfig, arm: str, chunk: int, vocab: int, step: Step) -> dict:
    out = {"arm": arm, "chunk": chunk, "label": label(cfg, arm, chunk), "ok": False}
    try:
        if arm == "disagg":
            servers = server_pair(cfg.log_dir, cfg.model, cfg.dtype, cfg.prefill_device or cfg.device, cfg.device,
                                  decode_args=decode_args(cfg, 0), common_args=["--transport", cfg.transport])
        else:
            servers = colocated_server(cfg.log_dir, cfg.model, cfg.dtype, cfg.device, decode_args(cfg, chunk))
        with servers as srv:
            step(f"{out['label']}: serving")
            try:
                raw = asyncio.run(drive(srv.addr, cfg, "auto" if arm == "disagg" else "colocated", vocab, step))
            except Exception as e:
                dead = [p.args[2:4] for p in srv.procs if p.poll() is not None]
                raise RuntimeError(f"{e}" + (f" (server exited: {dead})\n{srv.log_text()}" if dead else "")) from e
    except Exception as e:  # one arm's failure is reported; the other arms still run
        return out | {"error": f"{type(e).__name__}: {e}"}
    return out | {"ok": True} | arm_figures(raw["streams"], raw["longs"], raw["start"], raw["stop"],
                                            cfg.ttft_slo_ms, cfg.itl_slo_ms, margin_s=cfg.gap_s / 2)


def run_interference(cfg: InterferenceConfig, step: Step = lambda _: None) -> dict:
    vocab = load_config(cfg.model).vocab_size
    arms = [run_arm(cfg, arm, chunk, vocab, step) for arm, chunk in cfg.arm_list()]
    failures = [f"{a['label']}: {a['error'].splitlines()[0]}" for a in arms if not a["ok"]]
    return {"kind": "interference", "bench": "interference", "ok": not failures, "failures": failures,
            "config": asdict(cfg) | {"shared_device": cfg.shared_device()}, "arms": arms,
            "env": {"device_name": torch.cuda.get_device_name(torch.device(cfg.device))
                    if torch.device(cfg.device).type == "cuda" else "cpu"}}


def total_steps(cfg: InterferenceConfig) -> int:
    per_arm = 3 + len(cfg.arrivals) + (1 if cfg.poisson else 0)
    return per_arm * len(cfg.arm_list())


HELP = "how long prefills stall running decodes: colocated, chunked, disagg"
DESCRIPTION = ("Per arm (fresh servers): B streams decode, long prompts arrive; reports the "
               "streams' ITL, the stall per arrival, the long prompts' TTFT and goodput.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset or local dir (default tiny)")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", help="colocated server and the pair's decode server (default cuda:0, else cpu)")
    p.add_argument("--prefill-device", help="the pair's prefill server (default: --device, one shared device)")
    p.add_argument("--streams", type=int, default=32, help="running streams B (default 32)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of each stream (default 1024)")
    p.add_argument("--stream-tokens", type=int, help="max_new_tokens per stream (default min(2048, what fits))")
    p.add_argument("--long-tokens", type=int, default=4, help="max_new_tokens per long prompt (default 4)")
    p.add_argument("--arrivals", type=ints, default=[4096, 16384, 32000],
                   help="single long prompts, one at a time (default 4096,16384,32000)")
    p.add_argument("--gap-s", type=float, default=1.0, help="before the first arrival and after each first token")
    p.add_argument("--poisson-rate", type=float, default=0.0, help="long prompts/s after the single ones (0: off)")
    p.add_argument("--poisson-count", type=int, default=8)
    p.add_argument("--poisson-len", type=int, default=4096)
    p.add_argument("--arms", type=csv, default=list(ARMS), help=f"comma list of {','.join(ARMS)}")
    p.add_argument("--chunks", type=ints, default=[512, 2048], help="--prefill-chunk per chunked arm")
    p.add_argument("--transport", help="disagg data plane (default cuda_ipc on cuda, gloo on cpu)")
    p.add_argument("--ttft-slo-ms", type=float, default=5000.0, help="long prompts' TTFT SLO (default 5000)")
    p.add_argument("--itl-slo-ms", type=float, default=100.0, help="every request's max ITL SLO (default 100)")
    p.add_argument("--max-batch", type=int, help="server slots (default streams + long prompts in flight)")
    p.add_argument("--max-seq-len", type=int, help="tokens per slot (default: the longest request)")
    p.add_argument("--server-args", default="", help="extra decode-server flags, e.g. '--no-cuda-graphs'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", help="server logs here (default a temp dir)")
    p.add_argument("--out", help="write result.json, report.md and interference.png in this directory")


def config(args: argparse.Namespace) -> InterferenceConfig:
    cuda = torch.cuda.is_available()
    device = args.device or ("cuda:0" if cuda else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    return InterferenceConfig(
        model=args.model, dtype=args.dtype or ("bfloat16" if on_gpu else "float32"), device=device,
        prefill_device=args.prefill_device, streams=args.streams, context=args.context,
        stream_tokens=args.stream_tokens, long_tokens=args.long_tokens, arrivals=tuple(args.arrivals),
        gap_s=args.gap_s, poisson_rate=args.poisson_rate, poisson_count=args.poisson_count,
        poisson_len=args.poisson_len, arms=tuple(args.arms), chunks=tuple(args.chunks),
        transport=args.transport or ("cuda_ipc" if on_gpu else "gloo"), ttft_slo_ms=args.ttft_slo_ms,
        itl_slo_ms=args.itl_slo_ms, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
        server_args=tuple(shlex.split(args.server_args)), seed=args.seed, log_dir=args.log_dir)


def job(args: argparse.Namespace) -> Job:
    cfg = config(args)
    check_devices({"--device": cfg.device, "--prefill-device": cfg.prefill_device}, cfg.transport)
    return Job(total_steps(cfg), lambda step: run_interference(cfg, step))
