"""kvtransfer-bench: the bench client's command line.

Why this shape: every subcommand is one module under bench/runs/, listed once in `SUBCOMMANDS`,
and each is registered the same way: its `HELP` and `DESCRIPTION`, its flags (`add_arguments(p)`)
and its `job(args)`, which builds the run's config (a frozen dataclass whose ValueError becomes a
usage error) and returns a `bench.common.Job`. `main` runs the job under a progress bar; the run
returns a plain result dict, and `finish` does the rest the same way for all of them: rich tables,
result.json + charts (PNG) + report.md under --out, and the whole result as ONE JSON object on the
last stdout line. The exit status is non-zero when a check failed: the result's `ok` is False and
its `failures` (if any) say why. Nothing imports this module.

Subcommands: offload, ttft, demo, link (raw link speeds), serve (load on a running server), decode
(the batched engine's step time over a (batch, context) grid), interference (long prefills stalling
running decodes).
To add one: write bench/runs/x.py with HELP, DESCRIPTION, add_arguments(p) and job(args) -> Job,
add it to SUBCOMMANDS, and report its result kind in bench/report/x.py (`tables`, optionally `plot`),
listed in `bench.report.kinds.KINDS`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from types import ModuleType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.common import Step
from bench.report.kinds import tables_for
from bench.report.output import json_line, write_outputs
from bench.report.table import print_tables
from bench.runs import decode, demo, interference, invariance, link, offload, serve, ttft
from kvtransfer.rpc.configargs import Parser
from kvtransfer.rpc.stacks import exit_on_sigterm, exit_status

SUBCOMMANDS: dict[str, ModuleType] = {"offload": offload, "ttft": ttft, "demo": demo, "link": link, "serve": serve,
                                      "decode": decode, "interference": interference, "invariance": invariance}


def with_progress(total: int, work: Callable[[Step], dict]) -> dict:
    """Run `work(step)` under a rich progress bar on stderr; `step(text)` advances it by one."""
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("starting", total=total)
        return work(lambda text: bar.update(task, advance=1, description=text))


def finish(args: argparse.Namespace, result: dict) -> int:
    """Tables to stdout, files under --out, then the result as one JSON line (the last stdout line)."""
    tables = tables_for(result)
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 220)
    print_tables(tables, console)
    if getattr(args, "out", None):
        result["outputs"] = write_outputs(args.out, result, tables, args.command_line)
    if not result["ok"]:
        why = "; ".join(result.get("failures", [])) or "a moved or reloaded cache differs from the original"
        console.print(f"CHECK FAILED: {why} (see the tables)", markup=False)
    sys.stdout.write(json_line(result) + "\n")
    sys.stdout.flush()
    return 0 if result["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvtransfer-bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, run in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=run.HELP, description=run.DESCRIPTION)
        run.add_arguments(p)
        p.set_defaults(job=run.job, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself, not a caller's process (a test's): `timeout` gets stacks, then exit 143
        exit_on_sigterm()
        return exit_status(lambda: run(sys.argv[1:]))
    return run(list(argv))


def run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["kvtransfer-bench", *argv])
    try:
        job = args.job(args)
    except ValueError as e:
        args.parser.error(str(e))
    return finish(args, with_progress(job.steps, job.run))


if __name__ == "__main__":
    sys.exit(main())
