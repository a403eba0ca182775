"""The one transfer interface: per request a sender and a receiver (five verbs), per connection a link.

Why this small: every backend (fake, nccl/gloo, grpc, cuda_ipc) implements exactly these and
passes the same contract suite; the sender's state machine is sender.py, the header and
destinations header.py, failure causes errors.py, the wire frame frames.py, memory views
layout.py, building links registry.py. State is an ordered enum, so the worst of many is `min()`.
The receiving side decides where layers land: `accept` takes a destination provider.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

# the interface's vocabulary: defined beside it, imported from here as before
from kvtransfer.transport.errors import Cause, TransferError  # noqa: F401
from kvtransfer.transport.header import Destination, DestinationProvider, TransferHeader, fresh_destination  # noqa: F401


class TransferState(enum.IntEnum):
    FAILED = 0
    WAITING = 2  # opened/accepted, nothing moved yet
    TRANSFERRING = 3
    SUCCESS = 4


class KVSender(ABC):
    """Prefill side of one request. `send_layer` must not block the compute stream."""
    header: TransferHeader

    @abstractmethod
    def send_layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None: ...
    @abstractmethod
    def finish(self, timeout: float | None = None) -> None:
        """Block until every layer has left (or raise TransferError)."""

    @abstractmethod
    def abort(self, reason: str) -> None: ...
    @abstractmethod
    def status(self) -> TransferState: ...


class KVReceiver(ABC):
    """Decode side of one request: layers land in the destination its link's `accept` was given."""
    header: TransferHeader

    @abstractmethod
    def wait_for_layer(self, layer_idx: int, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    @abstractmethod
    def finish(self, timeout: float | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Block until every layer has landed; return them in layer order (or raise TransferError)."""

    @abstractmethod
    def abort(self, reason: str) -> None: ...
    @abstractmethod
    def status(self) -> TransferState: ...


class SenderLink(ABC):
    """Prefill side of one connection; `open` starts one request's transfer."""
    survives_failed_request: ClassVar[bool]  # after one request fails, the link still carries the next
    abort_reaches_sender: ClassVar[bool]  # its receiver's abort fails the sender (False: the frame drains)

    @abstractmethod
    def open(self, header: TransferHeader) -> KVSender: ...
    @abstractmethod
    def close(self) -> None: ...


class ReceiverLink(ABC):
    """Decode side of one connection; `accept` yields the next request's receiver, its header checked."""
    survives_failed_request: ClassVar[bool]
    abort_reaches_sender: ClassVar[bool]  # a receiver's abort fails its sender (False: the frame is drained)
    address: str = ""  # what the prefill side connects to ("" for process-group links)

    @abstractmethod
    def accept(self, timeout: float | None = None, destinations: DestinationProvider | None = None) -> KVReceiver:
        """None: the backend's own fresh memory (cuda_ipc: views into its receive slot)."""

    @abstractmethod
    def close(self) -> None: ...

    def inflight(self) -> int:
        """Requests holding receive memory before `accept` hands them out (leak checks)."""
        return 0
