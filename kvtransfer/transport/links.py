"""Build a server's data-plane link from its settings: one place per role.

Why: the servers speak every transport through the same five verbs; only construction
differs. Process-group transports (nccl, gloo) are joined at start with a rendezvous;
address transports (grpc, cuda_ipc) have the decode side listen and announce its data
address at the handshake, and the prefill side connects to it then (again after a
decode restart, which is how the pair heals).
"""

from __future__ import annotations

import torch

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
        return ReceiverLink(device, peer=0, max_bytes=max_bytes)
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
        return SenderLink(device, peer=1, layers_per_message=layers_per_message)
    if not address:
        raise ValueError(f"transport {transport} needs the decode side's data address (sent at the handshake)")
    if transport == "grpc":
        from .grpc_backend import Checksum, SenderLink
        return SenderLink(address, channels=channels,
                          checksum=Checksum.XXH3_64 if checksum == "xxh3" else Checksum.NONE,
                          connect_timeout_s=connect_timeout_s, credentials=credentials)
    from .cuda_ipc import SenderLink
    return SenderLink(device, address, connect_timeout=connect_timeout_s)
