"""Deterministic mode for verification runs.

Why: on H200 decode logits from the same cache differ run to run at >= 4k tokens in the
default mode. Bit-identical comparisons need deterministic kernels; timings must not use
them (docs/architecture.md, "Exactness and determinism": never mix the two in one figure).
"""

from __future__ import annotations

import os

import torch


def enable_deterministic() -> None:
    """Call before the first CUDA matmul in the process."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def sync(device: torch.device | str) -> None:
    """Wait for all work on `device` (no-op on CPU); call before every timer."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
