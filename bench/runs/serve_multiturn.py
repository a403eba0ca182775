"""`kvtransfer-bench serve --multi-turn`: what the decode server's prefix cache buys a chat, reuse off against on.

Why a run of its own: `serve`'s independent random prompts share no prefix, so a prefix cache never shows there.
Here `--num-prompts` conversations of `--turns` turns resend their history (the driver:
bench/measure/conversations.py), and one run makes two passes of that load against the same server: first the
baseline, every request with skip_prefix_cache (the whole prompt prefilled; the server still keeps each request's
cache), then reuse on. Two separate runs would put restarts and warm-ups into the ratio; two passes of one run
differ by the flag only. Each pass draws its own conversations (seeds (seed, pass, conversation)), so what the
reuse pass reuses is its own earlier turns, never the baseline's. A turn 1 that reuses anything means the server
still holds conversations of an earlier run with the same --seed (a warning: the reuse figures are then too
good); a baseline turn that reuses is a failed check (the server ignored skip_prefix_cache). The server's Info is
read first: a load over its vocabulary or limits fails before a turn is sent. Figures: multiturn_stats.py;
tables: bench/report/multiturn.py.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import asdict, dataclass

import grpc

from bench.common import Job, Step
from bench.measure.conversations import Load, conversation_rng, first_prompt, one_turn, run_pass, server_info
from bench.measure.multiturn_stats import BUCKETS, headline, pass_figures
from bench.runs.serve_config import MAX_PROMPTS, ServeConfig
from decode_server.client import MODES
from kvtransfer.model.spec import load_config
from proto import kvtransfer_pb2_grpc as pbg

TURNS = 6
USER_LEN = 256
PASSES = (("baseline", True), ("reuse", False))  # (name, skip_prefix_cache), in the order they run


@dataclass(frozen=True)
class MultiTurnConfig:
    serve: ServeConfig  # the conversations (num_prompts), first prompts, answers, concurrency, mode, budgets
    turns: int = TURNS
    user_len: int = USER_LEN

    def __post_init__(self):
        s = self.serve
        unsupported = (("--api", s.api, "it needs gRPC's skip_prefix_cache and Timing: send to --addr"),
                       ("--request-rate", math.isfinite(s.request_rate),
                        "a conversation sends its next turn when the previous one ended, --concurrency at a time"),
                       ("--long-share", s.long_share > 0, "the first prompts come from --input-len(-range)"),
                       ("--server-metrics", s.server_metrics, "it reads no server metrics"))
        for flag, given, why in unsupported:
            if given:
                raise ValueError(f"--multi-turn with {flag} is not supported yet ({why}): drop {flag}")
        if self.turns < 1 or self.user_len < 1:
            raise ValueError(f"--turns and --user-len must be >= 1 (got {self.turns} and {self.user_len})")
        if s.num_prompts * self.turns > MAX_PROMPTS:
            raise ValueError(f"--num-prompts x --turns is {s.num_prompts * self.turns} requests a pass, over "
                             f"{MAX_PROMPTS}: fewer conversations or turns")
        context = getattr(load_config(s.model), "max_position_embeddings", None) if s.model else None
        if context is not None and self.longest() > context:
            raise ValueError(f"a conversation's last turn reaches {self.longest()} tokens (prompt + answer), over "
                             f"{s.model}'s context of {context}: lower --turns, --user-len, --input-len or "
                             f"--output-len")

    def longest(self) -> int:
        """The last turn's prompt plus its answer, for the longest first prompt."""
        s = self.serve
        return s.short_lengths()[1] + (self.turns - 1) * (s.output_len + self.user_len) + s.output_len

    def load(self, pass_no: int, skip_prefix_cache: bool) -> Load:
        s = self.serve
        return Load(conversations=s.num_prompts, turns=self.turns, first_len=s.short_lengths(),
                    user_len=self.user_len, output_len=s.output_len, vocab_size=s.vocab_size,
                    seed=(s.seed, pass_no), skip_prefix_cache=skip_prefix_cache, mode=MODES[s.mode],
                    concurrency=s.concurrency, timeout_s=s.timeout_s, max_duration_s=s.max_duration_s)


def preflight(cfg: MultiTurnConfig, info: dict) -> list[str]:
    """What the server's Info says this load cannot do: each stops the run before a turn is sent (0: not said)."""
    if "error" in info:
        return []
    s, longest, out = cfg.serve, cfg.longest(), []
    if info["vocab_size"] and s.vocab_size > info["vocab_size"]:
        out.append(f"token ids drawn from a vocabulary of {s.vocab_size}, over the server's {info['vocab_size']}: "
                   f"give --vocab-size {info['vocab_size']} or the server's --model")
    for key, n, what in (("max_seq_len", longest, "prompt + answer"),
                         ("max_prompt_tokens", longest - s.output_len, "prompt"),
                         ("max_new_tokens", s.output_len, "answer (--output-len)")):
        if info[key] and n > info[key]:
            out.append(f"a conversation's last turn reaches {n} tokens ({what}), over the server's {key} of "
                       f"{info[key]}: lower --turns, --user-len, --input-len or --output-len")
    return out


async def drive(cfg: MultiTurnConfig, step: Step, metadata) -> tuple[dict, list[dict], list[str]]:
    """Info, warm-up, then the passes in PASSES order on one channel: (info, each pass's run, failures)."""
    async with grpc.aio.insecure_channel(cfg.serve.addr) as channel:
        stub = pbg.DecodeStub(channel)
        info = await server_info(stub, metadata, cfg.serve.timeout_s)
        if failures := preflight(cfg, info):
            return info, [], failures
        warm = cfg.load(len(PASSES), skip_prefix_cache=True)  # prompts of no pass's conversations
        for i in range(cfg.serve.warmup):
            w = await one_turn(stub, first_prompt(conversation_rng(warm, i), warm), warm, cfg.serve.timeout_s,
                               metadata)
            step(f"warm-up {i + 1}")
            if w["code"]:
                return info, [], [f"warm-up request failed: {w['code']}: {w['error']}"]
        runs = []
        for n, (name, skip) in enumerate(PASSES):
            runs.append(await run_pass(stub, cfg.load(n, skip), metadata, lambda text, name=name: step(
                f"{name} {text}")))
        return info, runs, []


def run_multiturn(cfg: MultiTurnConfig, step: Step = lambda _: None, metadata=None) -> dict:
    """`metadata`: call metadata such as the bearer token (kept out of the result)."""
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        info, runs, failures = runner.run(drive(cfg, step, metadata))
    warnings = []
    if "error" in info:
        warnings.append(f"Info failed ({info['error']}): the server's limits and prefix cache were not checked")
    elif not info["prefix_block_tokens"]:
        warnings.append("the server reports no prefix cache (Info.prefix_block_tokens 0): reuse on prefills too")
    passes = {}
    for n, ((name, skip), run) in enumerate(zip(PASSES, runs)):
        p = passes[name] = {"skip_prefix_cache": skip, "seed": [cfg.serve.seed, n]} | pass_figures(run, cfg.turns)
        if p["failed"]:
            failures.append(f"{name}: {p['failed']} requests failed, ending their conversations: "
                            f"{p['failed_by_code']}")
        if p["not_sent"]:
            failures.append(f"{name}: {p['not_sent']} turns not sent: the {cfg.serve.max_duration_s:g} s budget "
                            f"ran out")
        if skip and p["reused_tokens"]["sum"]:
            failures.append(f"{name}: the server reused {p['reused_tokens']['sum']} prompt tokens though every "
                            f"request set skip_prefix_cache")
        if p["turn1_reused_tokens"]:
            warnings.append(f"{name}: first turns reused {p['turn1_reused_tokens']} tokens: the server holds "
                            f"conversations of an earlier run with --seed {cfg.serve.seed}; run with another --seed")
    config = asdict(cfg.serve) | {"request_rate": "inf", "multi_turn": True, "turns": cfg.turns,
                                  "user_len": cfg.user_len}
    return {"kind": "serve_multiturn", "ok": not failures, "failures": failures, "warnings": warnings,
            "config": config, "server": info, "num_conversations": cfg.serve.num_prompts,
            "max_concurrency": cfg.serve.concurrency, "length_buckets": list(BUCKETS), "passes": passes,
            "headline": headline(passes["baseline"], passes["reuse"]) if len(passes) == len(PASSES) else None}


def total_steps(cfg: MultiTurnConfig) -> int:
    return cfg.serve.warmup + len(PASSES) * cfg.serve.num_prompts * cfg.turns


def job(args: argparse.Namespace, serve: ServeConfig, metadata) -> Job:
    """`serve --multi-turn`'s job (bench/runs/serve.py dispatches here); a ValueError is a usage error."""
    if not args.multi_turn:
        raise ValueError("--turns and --user-len shape the conversations of --multi-turn: add --multi-turn or "
                         "drop them")
    cfg = MultiTurnConfig(serve, turns=getattr(args, "turns", TURNS), user_len=getattr(args, "user_len", USER_LEN))
    return Job(total_steps(cfg), lambda step: run_multiturn(cfg, step, metadata))
