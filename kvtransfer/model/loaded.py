"""A model on its device: which device (`pick_device`), which dtype (`resolve_dtype`), and the loaded model with
its cache geometry (`load` -> LoadedModel).

Why together: both workers and the bench resolve the device and dtype alike and build the same geometry from the
same spec, or their caches would not match byte for byte (the handshake refuses a mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtransfer.determinism import enable_deterministic
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec, load_model


def pick_device(name: str, flag: str = "--device") -> torch.device:
    """The device a server or bench runs on, always with an index on CUDA.

    Why the index: `torch.cuda.set_device` (the scheduler and receive threads call it) refuses an index-less
    `cuda`, and a worker thread that dies at start leaves a server that answers health but serves nothing.
    A CUDA index that does not exist is refused here, naming the flag (the servers exit 2).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {name}: no CUDA device here; use {flag} cpu")
        count = torch.cuda.device_count()
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= count:
            raise ValueError(f"{flag} {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        torch.cuda.set_device(dev)
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """--dtype auto: bfloat16 on CUDA (the kernels and published checkpoints), float32 on CPU (bit-exact against
    the HF forward, which the CPU tests rely on). Both workers resolve it alike on like devices; the handshake
    refuses a mismatch, naming --dtype."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: torch.nn.Module
    geometry: CacheGeometry
    device: torch.device


def load(spec: ModelSpec, device: torch.device, deterministic: bool) -> LoadedModel:
    if deterministic:
        enable_deterministic()
    model = load_model(spec, device)
    return LoadedModel(spec, model, CacheGeometry.from_config(model.config, spec.torch_dtype), device)
