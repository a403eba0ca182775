"""What the subcommands share: list flags, the default device, and the Job each run hands to bench.cli.

Why a module of its own: bench/cli.py imports every run (its one table of subcommands) and nothing
imports cli.py, so what the runs share lives below both of them, here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

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


CUDA_TRANSPORTS = ("nccl", "cuda_ipc")


def check_devices(devices: dict[str, str | None], transport: str | None = None) -> None:
    """A run's devices (flag -> device, None: not used) and its transport, checked before any server starts: a
    usage error in one line (bench.cli: exit 2), not a server's traceback after seconds of other work. Each CUDA
    device named must exist here; nccl and cuda_ipc need CUDA."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for flag, device in devices.items():
        if device is None or device == "auto":
            continue
        d = torch.device(device)
        if d.type == "cuda" and (d.index or 0) >= count:
            raise ValueError(f"{flag} {device}: this machine has {count} CUDA device{'s' if count != 1 else ''}"
                             + ("" if count else " (no CUDA here: use cpu)"))
    if transport in CUDA_TRANSPORTS and not count:
        raise ValueError(f"--transport {transport} needs CUDA devices, and this machine has none: use gloo or grpc")
