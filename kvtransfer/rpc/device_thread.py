"""The prefill worker's device thread: one thread owns the device's compute.

Why one thread: requests are serialized on the device and the CUDA context is set once, on that thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def gpu_executor(device: torch.device, name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread has `device` as its current CUDA device."""
    init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)
