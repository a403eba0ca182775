"""Whether a request's tokens depend on what runs beside it: the same prompts served twice, in two orders.

Why: `--batch-invariant` (docs/batch-invariance.md) claims that a request's logits, and so its greedy tokens and its
seeded draws, are the same bits whatever batch it rides in; a test shows it for a few requests, this shows it under
a serving load. Pass 1 sends `serve`'s prompts (the same lengths, ids and seed) in their order, pass 2 the same
prompts in a shuffled order, each pass at most `concurrency` in flight, so every request's steps have other sizes,
members and prompt chunks beside it. The first `--seeded` prompts are sampled (temperature, top_p, seed 1000 + i,
as OpenAI's `seed`), the rest greedy. Reported: how many of each kind gave the same tokens in both passes (and the
same logits digest at every step), where the first differing token is, and each pass's throughput. A server
without the mode is the control: there the neighbours change tokens. Its price (tok/s, ITL, the decode step) is
`serve` and `decode` run with the mode on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc
import numpy as np

from bench.common import Job, Step
from bench.measure.serve_doors import stream_record
from bench.runs.serve_config import ServeConfig
from bench.runs.serve_load import make_prompts
from decode_server.client import MODES
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

SEED_BASE = 1000  # the i-th seeded request's seed


def requests(cfg: ServeConfig, seeded: int, temperature: float, top_p: float, skip: bool
             ) -> list[pb.GenerateRequest]:
    """serve's prompts as requests: the first `seeded` sampled with seed SEED_BASE + i, the rest greedy; each asks
    its logits digest per step."""
    out = []
    for i, ids in enumerate(make_prompts(cfg)):
        req = pb.GenerateRequest(token_ids=ids, max_new_tokens=cfg.output_len, mode=MODES[cfg.mode],
                                 return_logits_digest=True, skip_prefix_cache=skip)
        if i < seeded:
            req.sampling.CopyFrom(pb.Sampling(temperature=temperature, top_p=top_p, seed=SEED_BASE + i))
        out.append(req)
    return out


async def one_pass(addr: str, reqs: list[pb.GenerateRequest], order: list[int], concurrency: int, timeout: float,
                   step: Step, name: str) -> tuple[list[dict], float]:
    """Every request, in `order`, at most `concurrency` in flight; -> records by request index, seconds."""
    limit = asyncio.Semaphore(concurrency)
    records: list[dict] = [{} for _ in reqs]  # by request index, filled as each ends

    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pbg.DecodeStub(channel)

        async def send(i: int) -> None:
            async with limit:
                records[i] = await stream_record(stub, reqs[i], timeout, None, digests=True)
                step(f"{name} ({records[i]['code'] or 'ok'})")

        start = time.perf_counter()
        await asyncio.gather(*(send(i) for i in order))
        return records, time.perf_counter() - start


def compare(a: dict, b: dict) -> dict:
    """One request's two records: same tokens, same digests, the first differing token (None: none)."""
    ta, tb = a["tokens"], b["tokens"]
    first = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if first is None and len(ta) != len(tb):
        first = min(len(ta), len(tb))
    return {"tokens_equal": first is None, "digests_equal": a.get("digests") == b.get("digests"),
            "first_difference": first}


def summarize(cfg: ServeConfig, seeded: int, passes: list[tuple[list[dict], float]], order: list[int]) -> dict:
    (one, _), (two, _) = passes
    failed = [i for i in range(len(one)) if one[i]["code"] or two[i]["code"]]
    rows = {i: compare(one[i], two[i]) for i in range(len(one)) if i not in failed}
    kinds = {}
    for kind, idx in (("seeded", range(seeded)), ("greedy", range(seeded, len(one)))):
        done = [i for i in idx if i in rows]
        diffs = [rows[i]["first_difference"] for i in done if not rows[i]["tokens_equal"]]
        kinds[kind] = {"requests": len(idx), "compared": len(done),
                       "tokens_equal": sum(rows[i]["tokens_equal"] for i in done),
                       "digests_equal": sum(rows[i]["digests_equal"] for i in done),
                       "first_difference_median": float(np.median(diffs)) if diffs else None}
    failures = [f"{len(failed)} requests failed in a pass (e.g. {one[failed[0]]['code'] or two[failed[0]]['code']})"
                ] if failed else []
    tokens = [sum(len(r["tokens"]) for r in p) for p, _ in passes]
    reused = [sum(r["timing"].reused_tokens for r in p if r.get("timing") is not None) for p, _ in passes]
    return {"kind": "invariance", "ok": not failures, "failures": failures,
            "config": {"addr": cfg.addr, "num_prompts": cfg.num_prompts, "concurrency": cfg.concurrency,
                       "input_len": cfg.input_len, "input_len_range": cfg.input_len_range,
                       "output_len": cfg.output_len, "seed": cfg.seed, "seeded": seeded, "vocab_size": cfg.vocab_size},
            "kinds": kinds, "failed": len(failed), "second_order_head": order[:16],
            "passes": [{"seconds": t, "output_tokens": n, "output_tok_s": n / t if t else None, "reused_tokens": u}
                       for (_, t), n, u in zip(passes, tokens, reused)]}


def run_invariance(cfg: ServeConfig, seeded: int, temperature: float, top_p: float, skip: bool,
                   step: Step = lambda _: None) -> dict:
    reqs = requests(cfg, seeded, temperature, top_p, skip)
    order = np.random.default_rng([cfg.seed, 4]).permutation(len(reqs)).tolist()
    passes = []
    for name, o in (("pass 1", list(range(len(reqs)))), ("pass 2", order)):
        passes.append(asyncio.run(one_pass(cfg.addr, reqs, o, cfg.concurrency, cfg.timeout_s, step, name)))
    return summarize(cfg, seeded, passes, order)


HELP = "the same prompts served twice in two orders: do a request's tokens depend on its neighbours?"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default="127.0.0.1:50051", help="the decode server (loopback only)")
    p.add_argument("--model", help="the server's --model (preset or local dir): its vocabulary")
    p.add_argument("--vocab-size", type=int, help="token ids uniform in [0, vocab) (or give --model)")
    p.add_argument("--num-prompts", type=int, default=512, help="prompts per pass (default 512)")
    p.add_argument("--concurrency", type=int, default=64, help="most requests in flight (default 64)")
    p.add_argument("--input-len", type=int, default=1024, help="default 1024 (the README's serve workload)")
    p.add_argument("--input-len-range", type=float, default=0.5, help="r: lengths uniform in len*[1-r, 1+r]")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seeded", type=int, default=16, help="the first N prompts sample with seed 1000 + i (default 16)")
    p.add_argument("--temperature", type=float, default=1.0, help="the seeded requests' temperature (default 1)")
    p.add_argument("--top-p", type=float, default=0.9, help="the seeded requests' top_p (default 0.9)")
    p.add_argument("--skip-prefix-cache", action="store_true",
                   help="every request skips the prefix cache (default: pass 2 may reuse pass 1's contexts)")
    p.add_argument("--mode", default="auto", help="auto, layerwise, bulk or colocated")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (serve's) and the second order's")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, s")
    p.add_argument("--out", help="write result.json and report.md in this directory")


def job(args: argparse.Namespace) -> Job:
    if args.concurrency < 1 or not 0 <= args.seeded <= args.num_prompts or args.temperature <= 0:
        raise ValueError("--concurrency >= 1, 0 <= --seeded <= --num-prompts, --temperature > 0")
    cfg = ServeConfig(addr=args.addr, num_prompts=args.num_prompts, concurrency=args.concurrency,
                      input_len=args.input_len, input_len_range=args.input_len_range, output_len=args.output_len,
                      vocab_size=args.vocab_size, model=args.model, mode=args.mode, seed=args.seed,
                      timeout_s=args.timeout, warmup=0)
    return Job(2 * cfg.num_prompts, lambda step: run_invariance(cfg, args.seeded, args.temperature, args.top_p,
                                                                args.skip_prefix_cache, step))
