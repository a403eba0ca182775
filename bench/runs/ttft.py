"""TTFT overhead of disaggregation: colocated vs prefill/decode pair, layer-wise and bulk.

Why two phases: on GPU, logits are only run-to-run identical in deterministic mode, which
is slower. So equality (cache digest, tokens, every step's logits) is checked in a
deterministic pass, and times come from a separate default-mode pass (never
mix the two in one figure). All times are the servers' own (request in -> event), so
the colocated and disaggregated figures are measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, dataclass

import torch

from bench.common import Job, Step, check_devices, csv, ints
from bench.measure.launch import colocated_server, server_pair
from bench.measure.p2p import cache_patterns, measure_p2p
from bench.measure.stats import median, spread_ms
from decode_server.client import generate
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_config

CHECKS = ("cache_equal", "tokens_equal", "logits_equal", "tokens_equal_timed")  # every one counts in `ok`


@dataclass(frozen=True)
class TtftConfig:
    model: str = "tiny"
    dtype: str = "float32"
    lengths: tuple[int, ...] = (64, 512)
    modes: tuple[str, ...] = ("layerwise", "bulk")
    runs: int = 5
    warmup: int = 2
    decode_tokens: int = 4            # >= 2: the second token is the first decode step
    prefill_device: str = "auto"
    decode_device: str = "auto"
    layers_per_message: int = 1
    transport: str = "auto"           # the pair's data plane: auto (nccl/gloo), grpc, cuda_ipc
    verify: bool = True
    log_dir: str | None = None

    def __post_init__(self):
        ModelSpec(self.model, self.dtype)
        if self.runs < 1 or self.warmup < 0 or self.decode_tokens < 2:
            raise ValueError("runs >= 1, warmup >= 0 and decode_tokens >= 2")
        if not set(self.modes) <= {"layerwise", "bulk"}:
            raise ValueError(f"modes must be layerwise and/or bulk, got {self.modes}")
        ctx = load_config(self.model).max_position_embeddings
        if max(self.lengths) + self.decode_tokens > ctx:
            raise ValueError(f"lengths must leave room for {self.decode_tokens} tokens in the context of {ctx}")


def median_of(samples: list[dict], key: str) -> float:
    return median(s[key] for s in samples)


def stats(samples: list[dict], key: str) -> dict:
    return spread_ms([s[key] for s in samples], scale=1.0) | {"n": len(samples)}


async def _calls(addr: str, ids: list[int], n: int, mode: str, count: int, digest: bool) -> list[dict]:
    return [await generate(addr, ids, n, mode, digest=digest, cache_digest=digest, timeout=600,
                           skip_prefix_cache=True) for _ in range(count)]  # the prefill and the move, every time


def _timed(addr: str, ids, cfg: TtftConfig, mode: str) -> list[dict]:
    out = asyncio.run(_calls(addr, ids, cfg.decode_tokens, mode, cfg.warmup + cfg.runs, False))[cfg.warmup:]
    return [dict(o["timing"], tokens=o["tokens"]) for o in out]


def engine_args(cfg: TtftConfig) -> list[str]:
    """The decode server's KV pool sized for these prompts: 2 slots of the longest prompt + its tokens; whole-prompt
    prefill (--exact): the colocated TTFT is one prefill, and the verification compares bit for bit. `--gemv off`:
    the timed pass's colocated and disaggregated decode servers run the same batch-1 kernels, so their tokens can
    be compared (`auto` times them at each start and may pick differently in each; the first token, and so TTFT,
    comes from the prefill either way)."""
    return ["--max-batch", "2", "--max-seq-len", str(max(cfg.lengths) + cfg.decode_tokens), "--exact",
            "--gemv", "off"]


def verify_pass(cfg: TtftConfig, prompts: dict[int, list[int]], step: Step) -> dict:
    """Deterministic servers: every length and mode byte-equal cache, identical tokens and logits."""
    det = ["--deterministic"]
    ref = {}
    with colocated_server(cfg.log_dir, cfg.model, cfg.dtype, cfg.decode_device, [*det, *engine_args(cfg)]) as colo:
        for n, ids in prompts.items():
            ref[n] = asyncio.run(_calls(colo.addr, ids, cfg.decode_tokens, "colocated", 1, True))[0]
            step(f"verify colocated {n}")
    checks = {}
    with server_pair(cfg.log_dir, cfg.model, cfg.dtype, cfg.prefill_device, cfg.decode_device,
                     prefill_args=["--layers-per-message", str(cfg.layers_per_message)],
                     decode_args=engine_args(cfg), common_args=[*det, "--transport", cfg.transport]) as pair:
        for n, ids in prompts.items():
            for mode in cfg.modes:
                got = asyncio.run(_calls(pair.addr, ids, cfg.decode_tokens, mode, 1, True))[0]
                checks[f"{n}/{mode}"] = compare(got, ref[n], cfg.decode_tokens)
                step(f"verify {mode} {n}")
    return checks


def compare(got: dict, ref: dict, tokens: int) -> dict:
    """Equality checks of a disaggregated answer against the colocated one. A check with nothing to compare
    (a digest missing on either side, fewer tokens than asked for) fails: it proves nothing."""
    def present(d: dict) -> bool:
        return bool(d["cache_digest"]) and len(d["logits_digests"]) == tokens and all(d["logits_digests"])
    both = present(got) and present(ref)
    return {"cache_equal": both and got["cache_digest"] == ref["cache_digest"],
            "tokens_equal": len(got["tokens"]) == tokens and got["tokens"] == ref["tokens"],
            "logits_equal": both and got["logits_digests"] == ref["logits_digests"]}


def run_ttft(cfg: TtftConfig, step: Step = lambda _: None) -> dict:
    config = load_config(cfg.model)
    geom = CacheGeometry.from_config(config, ModelSpec(cfg.model, cfg.dtype).torch_dtype)
    prompts = {n: random_prompt(config.vocab_size, n, seed=n).view(-1).tolist() for n in cfg.lengths}
    checks = verify_pass(cfg, prompts, step) if cfg.verify else {}
    colo = {}
    with colocated_server(cfg.log_dir, cfg.model, cfg.dtype, cfg.decode_device, engine_args(cfg)) as srv:
        for n, ids in prompts.items():
            colo[n] = _timed(srv.addr, ids, cfg, "colocated")
            step(f"colocated {n}")
    disagg = {}
    with server_pair(cfg.log_dir, cfg.model, cfg.dtype, cfg.prefill_device, cfg.decode_device,
                     prefill_args=["--layers-per-message", str(cfg.layers_per_message)],
                     decode_args=engine_args(cfg), common_args=["--transport", cfg.transport]) as pair:
        for n, ids in prompts.items():
            for mode in cfg.modes:
                disagg[(n, mode)] = _timed(pair.addr, ids, cfg, mode)
                step(f"{mode} {n}")
    rows = []
    for n in cfg.lengths:
        c = colo[n]
        ttft_colo = median_of(c, "first_token_ms")
        for mode in cfg.modes:
            d = disagg[(n, mode)]
            ttft = median_of(d, "cache_ready_ms")
            rows.append({
                "length": n, "mode": mode, "cache_bytes": geom.cache_bytes(n),
                "ttft_colo": stats(c, "first_token_ms"), "ttft_disagg": stats(d, "cache_ready_ms"),
                "overhead_ms": ttft - ttft_colo, "overhead_pct": 100 * (ttft - ttft_colo) / ttft_colo,
                "prefill_colo": stats(c, "prefill_ms"), "prefill_disagg": stats(d, "prefill_ms"),
                "prefill_slowdown_pct": 100 * (median_of(d, "prefill_ms") / median_of(c, "prefill_ms") - 1),
                "second_token_colo": stats(c, "second_token_ms"), "second_token_disagg": stats(d, "second_token_ms"),
                "tokens_equal_timed": bool(d) and all(x["tokens"] == c[0]["tokens"] and x["tokens"] for x in d),
                **checks.get(f"{n}/{mode}", {}),
            })
    failures = [f"{r['length']}/{r['mode']}: {k}" for r in rows for k in CHECKS if k in r and not r[k]]
    ok = not failures and (not cfg.verify or len(checks) == len(cfg.lengths) * len(cfg.modes))
    links = raw_links(cfg, geom)
    step("raw link")
    return {"kind": "ttft", "ok": ok, "failures": failures, "config": asdict(cfg),
            "bytes_per_token": geom.bytes_per_token, "verified": cfg.verify, "rows": rows, "links": links}


def raw_links(cfg: TtftConfig, geom: CacheGeometry) -> dict:
    """The limit of the data plane the pair used, measured in the same run, at the largest cache size."""
    nbytes = geom.cache_bytes(max(cfg.lengths))
    if cfg.transport == "grpc":
        from bench.measure.grpc_probe import measure_loopback
        dev = "cuda" if cfg.prefill_device.startswith("cuda") else "cpu"
        r = measure_loopback(nbytes, channels=4, repeats=max(cfg.runs, 3), device=dev)
        return {f"grpc transport ({dev} source)": dict(r["grpc"], pattern=f"{nbytes / 2**20:.0f} MiB, 4 channels"),
                "tcp socket": dict(r["socket"], pattern=f"{nbytes / 2**20:.0f} MiB, 1 connection")}
    if cfg.transport == "cuda_ipc" or cfg.prefill_device == cfg.decode_device != "cpu":
        return {}  # one device: no p2p between two ranks (the link bench measures copies)
    return measure_p2p((cfg.prefill_device, cfg.decode_device), cache_patterns(nbytes, geom.num_layers),
                       cfg.runs, cfg.warmup)


def total_steps(cfg: TtftConfig) -> int:
    n, m = len(cfg.lengths), len(cfg.modes)
    return (n + n * m) * (2 if cfg.verify else 1) + 1


HELP = "TTFT overhead: colocated vs disaggregated (layer-wise and bulk), verified"
DESCRIPTION = ("Starts a colocated decode server and a prefill/decode pair as real processes; "
               "per prompt length reports TTFT, overhead, prefill slowdown and 2nd-token time; "
               "checks cache, tokens and logits equal in a separate deterministic pass.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset or local dir (default tiny)")
    p.add_argument("--lengths", type=ints, default=[64, 512], help="comma list of prompt lengths")
    p.add_argument("--modes", type=csv, default=["layerwise", "bulk"], help="layerwise,bulk")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prefill-device", help="default cuda:0 (cpu without CUDA)")
    p.add_argument("--decode-device", help="default cuda:1 (cpu without CUDA)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=4, help=">= 2 (the second token is a decode step)")
    p.add_argument("--layers-per-message", type=int, default=1)
    p.add_argument("--transport", default="auto", help="auto (nccl on GPUs, gloo on CPU), grpc, cuda_ipc")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="deterministic pass checking cache, tokens and logits (default on)")
    p.add_argument("--log-dir", help="server logs here (default a temp dir)")
    p.add_argument("--out", help="write result.json and report.md in this directory")


def job_for(cfg: TtftConfig) -> Job:
    return Job(total_steps(cfg), lambda step: run_ttft(cfg, step))


def job(args: argparse.Namespace) -> Job:
    cuda = torch.cuda.is_available()
    cfg = TtftConfig(model=args.model, dtype=args.dtype or ("bfloat16" if cuda else "float32"),
                     lengths=tuple(args.lengths), modes=tuple(args.modes), runs=args.runs,
                     warmup=args.warmup, decode_tokens=args.decode_tokens,
                     prefill_device=args.prefill_device or ("cuda:0" if cuda else "cpu"),
                     decode_device=args.decode_device or ("cuda:1" if cuda else "cpu"),
                     layers_per_message=args.layers_per_message, transport=args.transport,
                     verify=args.verify, log_dir=args.log_dir)
    check_devices({"--prefill-device": cfg.prefill_device, "--decode-device": cfg.decode_device}, cfg.transport)
    return job_for(cfg)
