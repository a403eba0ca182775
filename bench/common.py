"""What the subcommands share: list flags, the default device, and the Job each run hands to bench.cli.

Why a module of its own: bench/cli.py imports every run (its one table of subcommands) and nothing
imports cli.py, so what the runs share lives below both of them, here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.model.loaded import pick_device

Step = Callable[[str], None]  # called once per finished step with a short description (the progress bar)


@dataclass(frozen=True)
class Job:
    """A subcommand's run, built from its flags by its module's `job(args)` (a ValueError there is a usage
    error): `steps` sizes the progress bar, `run(step)` measures and returns the result dict."""
    steps: int
    run: Callable[[Step], dict]


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def default_device() -> str:
    """The servers' own rule for --device auto (cuda with its index when there is one, else cpu)."""
    return str(pick_device("auto"))
