"""Transport backends behind one interface (base.py), built by name through one registry (registry.py).

Why lazy: the gRPC path never imports NCCL code and the CPU path never touches CUDA; no
transport module imports transformers (layout.py holds the memory views they share).
"""

from __future__ import annotations

from kvtransfer.transport.base import (
                   Cause,
                   Destination,
                   DestinationProvider,
                   KVReceiver,
                   KVSender,
                   ReceiverLink,
                   SenderLink,
                   TransferError,
                   TransferHeader,
                   TransferState,
                   fresh_destination,
)

__all__ = ["Cause", "Destination", "DestinationProvider", "KVReceiver", "KVSender", "ReceiverLink", "SenderLink",
           "TransferError", "TransferHeader", "TransferState", "fresh_destination"]
