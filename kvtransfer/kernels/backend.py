"""Which backend a kernel op runs on: Triton on a CUDA device when triton imports, else the torch reference.

Why a module of its own: every op module (ops.py for the attention, RoPE and norms over the pool, projections.py for
the GEMV and GEMM choices) decides the same way, and the sampler asks the same question; one rule, read by all.
Explicit, never from the environment: in `pick_triton(use_triton, device)`, None means `triton_available(device)`,
True forces Triton (CPU tensors under the Triton interpreter in tests), False the reference. triton is imported
lazily, and only to ask.
"""

from __future__ import annotations

import functools

import torch

from kvtransfer.kernels._checks import require


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def triton_available(device: torch.device | str) -> bool:
    """True when Triton kernels can run on `device`: a CUDA device and an importable triton."""
    return torch.device(device).type == "cuda" and _triton_importable()


def pick_triton(use_triton: bool | None, device: torch.device) -> bool:
    """The op's backend: True for Triton (see the module docstring)."""
    if use_triton is None:
        return triton_available(device)
    if use_triton:
        require(_triton_importable(), "use_triton=True but triton cannot be imported")
    return bool(use_triton)
