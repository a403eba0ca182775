"""Build a server's data-plane link from its settings: one place per role.

Why: the servers speak every transport through the same five verbs; only construction
differs. Process-group transports (nccl, gloo) are joined at start with a rendezvous;
address transports (grpc, cuda_ipc) have the decode side listen and announce its data
address at the handshake, and the prefill side connects to it then (again after a
decode restart, which is how the pair heals). Process-group transports heal by joining
a fresh group per pairing (rendezvous.py).
"""

from __future__ import annotations

import torch

from .base import TransferState

PROCESS_GROUP = ("nccl", "gloo")
ADDRESSED = ("grpc", "cuda_ipc")
TRANSPORTS = ("auto", *PROCESS_GROUP, *ADDRESSED)


def resolve(transport: str, device: torch.device) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"--transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if transport == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if transport == "nccl" and device.type != "cuda":
        raise ValueError("--transport nccl needs a CUDA device; use gloo on CPU")
    if transport == "cuda_ipc" and device.type != "cuda":
        raise ValueError("--transport cuda_ipc needs CUDA devices in one box; use gloo or grpc on CPU")
    return transport


def receiver_link(transport: str, device: torch.device, max_bytes: int, data_listen: str, slot_bytes: int,
                  slots: int, num_layers: int, credentials=None):
    """The decode side's link (process-group transports must be joined before)."""
    if transport in PROCESS_GROUP:
        from .dist import ReceiverLink
        return ReceiverLink(device, peer=0, max_bytes=max_bytes, group=_this_group())
    if transport == "grpc":
        from .grpc_listener import ReceiverLink
        link = ReceiverLink(address=data_listen, device=device, max_bytes=max_bytes, credentials=credentials)
        link.survives_errors = True  # one request's failure leaves the listener usable
        return link
    from .ipc_receiver import ReceiverLink
    return ReceiverLink(device, data_listen if data_listen.startswith(("unix:", "tcp://")) else
                        f"tcp://{data_listen}", slot_bytes=min(slot_bytes, max_bytes), slots=slots,
                        max_layers=num_layers)


def sender_link(transport: str, device: torch.device, address: str, layers_per_message: int = 1,
                channels: int = 4, checksum: str = "xxh3", connect_timeout_s: float = 60.0, credentials=None):
    """The prefill side's link; `address` is what the decode side announced (address transports)."""
    if transport in PROCESS_GROUP:
        from .dist import SenderLink
        return SenderLink(device, peer=1, layers_per_message=layers_per_message, group=_this_group())
    if not address:
        raise ValueError(f"transport {transport} needs the decode side's data address (sent at the handshake)")
    if transport == "grpc":
        from .grpc_backend import Checksum, SenderLink
        return SenderLink(address, channels=channels,
                          checksum=Checksum.XXH3_64 if checksum == "xxh3" else Checksum.NONE,
                          connect_timeout_s=connect_timeout_s, credentials=credentials)
    from .cuda_ipc import SenderLink
    return SenderLink(device, address, connect_timeout=connect_timeout_s)


def _this_group():
    """The current default group itself, not "whatever group is default when used": a thread of an old
    pairing that wakes up after a re-pairing must fail, not receive from (or send to) the new group."""
    import torch.distributed as dist
    return dist.group.WORLD


def inflight_receivers(link) -> int:
    """Requests a receiver link holds buffers for before the receive loop takes them (gRPC: streams that
    arrived and were not yet finished; the process-group links allocate only inside the loop). For leak checks."""
    requests = getattr(link, "_requests", None)
    if requests is None:
        return 0
    from .grpc_receiver import GrpcReceiver
    with link._lock:
        return sum(isinstance(r, GrpcReceiver) and r.status() not in (TransferState.SUCCESS, TransferState.FAILED)
                   for r in requests.values())
