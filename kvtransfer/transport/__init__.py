"""Transport backends, registered by name and imported lazily.

Why lazy: the gRPC path never imports NCCL code and the CPU path never touches CUDA.
Each backend module provides `SenderLink`/`ReceiverLink` classes: a link is one
connection to a peer; `SenderLink.open(header)` starts one request's transfer and
`ReceiverLink.accept()` yields the next request's receiver (its header read first).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .base import KVReceiver, KVSender, TransferError, TransferHeader, TransferState

BACKENDS = {
    "fake": "kvtransfer.transport.fake",
    "nccl": "kvtransfer.transport.dist",  # torch.distributed; NCCL on CUDA
    "gloo": "kvtransfer.transport.dist",  # torch.distributed; gloo on CPU
    "grpc": "kvtransfer.transport.grpc_backend",
    "cuda_ipc": "kvtransfer.transport.cuda_ipc",
}


def load_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


__all__ = ["BACKENDS", "KVReceiver", "KVSender", "TransferError", "TransferHeader", "TransferState", "load_backend"]
