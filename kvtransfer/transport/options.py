"""Per-backend options: one frozen dataclass each, validated at construction (no torch, no grpc here).

Why apart from the backends: a server validates its flags at start (and refuses a flag of
a backend it does not run) without importing any backend; the registry maps a server's
config fields to these fields (registry.FLAGS). Every former hidden constant that a
deployment may need to fit is a field here; the rest are named constants with a reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Checksum(enum.IntEnum):
    """Per-layer integrity check on the gRPC data plane; values are kvdata.proto's `Checksum`."""
    NONE = 0
    XXH3_64 = 1


CHECKSUMS = {"xxh3": Checksum.XXH3_64, "none": Checksum.NONE}


@dataclass(frozen=True)
class DistOptions:
    """nccl/gloo. layers_per_message: layers per send (fewer, larger messages). op_timeout_s: how long one
    group operation may take before the group is torn down; 0: a week on NCCL (the next frame's header
    receive stays posted while idle; deadlines and the peer timeout bound transfers), the rendezvous
    timeout on gloo."""
    layers_per_message: int = 1
    op_timeout_s: float = 0.0

    def __post_init__(self):
        if self.layers_per_message < 1:
            raise ValueError("--layers-per-message must be >= 1")
        if self.op_timeout_s < 0:
            raise ValueError("--dist-op-timeout-s must be >= 0 (0: the default)")


@dataclass(frozen=True)
class GrpcOptions:
    """grpc. Sender: `channels` TCP connections, `chunk_bytes` per message, a per-layer `checksum`
    ("xxh3" or "none"); abort_cancel_s: after an abort, how long the streams may take to deliver the
    ABORTED trailer before they are cancelled (a receiver that reads nothing more must not hold the
    sender). Receiver: listener_workers bounds concurrent streams (>= channels x requests in flight).
    TLS (PEM paths, both sides): tls_ca verifies the peer; tls_cert/tls_key are this side's identity."""
    channels: int = 4
    chunk_bytes: int = 4 << 20
    checksum: str = "xxh3"
    abort_cancel_s: float = 5.0
    listener_workers: int = 64
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    corrupt_layer: int = -1  # fault injection (tests): flip a byte of this layer on the wire (-1: off)

    def __post_init__(self):
        if not 1 <= self.channels <= 64:
            raise ValueError("--grpc-channels must be 1..64")
        if not 1 <= self.chunk_bytes <= 64 << 20:
            raise ValueError("--grpc-chunk-bytes must be 1..64 MiB")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"--checksum {self.checksum!r}: choose xxh3 or none")
        if self.abort_cancel_s <= 0 or self.listener_workers < 1:
            raise ValueError("--grpc-abort-cancel-s must be > 0 and --grpc-listener-workers >= 1")


@dataclass(frozen=True)
class IpcOptions:
    """cuda_ipc. Receiver: `slots` receive slots (each one request's cache, held until it is released).
    Sender: slot_timeout_s: how long `open` waits for a free slot before failing with `timeout`.
    local_ops: the in-process CPU stand-in for the CUDA calls (tests only: both links in one process)."""
    slots: int = 2
    slot_timeout_s: float = 30.0
    local_ops: bool = False

    def __post_init__(self):
        if self.slots < 1 or self.slot_timeout_s <= 0:
            raise ValueError("--ipc-slots must be >= 1 and --ipc-slot-timeout-s > 0")


@dataclass(frozen=True)
class FakeOptions:
    drop_after_layers: int = -1  # fault injection: layers after this many never arrive (-1: off)
