"""`kvtransfer-bench demo`: the disaggregated pair on CPU (gloo) beside colocated, tiny preset.

Why a subcommand of its own: the product in one minute with no flags to choose; it is `ttft` at one
fixed config (`config()`), reported the same way.
"""

from __future__ import annotations

import argparse

from bench.common import Job
from bench.runs import ttft

HELP = "the disaggregated pair on CPU (gloo) beside colocated, tiny preset"
DESCRIPTION = None


def config() -> ttft.TtftConfig:
    return ttft.TtftConfig(model="tiny", dtype="float32", lengths=(64, 1024), runs=5, warmup=2, decode_tokens=8,
                           prefill_device="cpu", decode_device="cpu")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="write result.json and report.md in this directory")


def job(args: argparse.Namespace) -> Job:
    return ttft.job_for(config())
