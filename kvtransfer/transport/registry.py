"""The one way to build a link: a transport name -> its backend descriptor, the module imported lazily.

Why: servers, bench and the contract harness build links here and nowhere else, so no code
outside this module tests transport names. A descriptor says how the pair meets
(`Rendezvous`: a process group joined at start, an address the decode side announces at
the handshake, or in-process), whether it needs CUDA, its options dataclass and which
server config fields fill that dataclass (a field of another backend than the chosen one,
set to anything but its default, is refused). Lazy import: the gRPC path never imports
torch.distributed, the CPU path never touches CUDA.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, fields

from kvtransfer.transport.base import ReceiverLink, SenderLink
from kvtransfer.transport.options import DistOptions, FakeOptions, GrpcOptions, IpcOptions


class Transport(enum.StrEnum):
    """Values are the names on the command line; `proto` is kvtransfer.proto's `Transport`."""
    NCCL = "nccl"
    GLOO = "gloo"
    GRPC = "grpc"
    CUDA_IPC = "cuda_ipc"
    FAKE = "fake"

    @property
    def proto(self) -> int:
        return list(Transport).index(self) + 1  # TRANSPORT_NCCL = 1, ... (0: unspecified)

    @classmethod
    def from_proto(cls, value: int) -> "Transport | None":
        return list(cls)[value - 1] if 1 <= value <= len(cls) else None


class Rendezvous(enum.Enum):
    PROCESS_GROUP = "process_group"  # both join a two-rank group at start (rendezvous.py); rebuilt per pairing
    ADDRESS = "address"              # the decode side listens and announces its address at the handshake
    IN_PROCESS = "in_process"        # tests: both links in one process


@dataclass(frozen=True)
class Backend:
    name: Transport
    module: str
    rendezvous: Rendezvous
    needs_cuda: bool
    options: type
    flags: tuple[tuple[str, str], ...]  # (server config field, options field)


_DIST_FLAGS = (("layers_per_message", "layers_per_message"), ("dist_op_timeout_s", "op_timeout_s"))
_GRPC_FLAGS = (("grpc_channels", "channels"), ("grpc_chunk_bytes", "chunk_bytes"), ("checksum", "checksum"),
               ("grpc_abort_cancel_s", "abort_cancel_s"), ("grpc_listener_workers", "listener_workers"),
               ("data_tls_ca", "tls_ca"), ("data_tls_cert", "tls_cert"), ("data_tls_key", "tls_key"))
_IPC_FLAGS = (("ipc_slots", "slots"), ("ipc_slot_timeout_s", "slot_timeout_s"))

BACKENDS: dict[Transport, Backend] = {b.name: b for b in (
    Backend(Transport.NCCL, "kvtransfer.transport.dist.backend", Rendezvous.PROCESS_GROUP, True, DistOptions, _DIST_FLAGS),
    Backend(Transport.GLOO, "kvtransfer.transport.dist.backend", Rendezvous.PROCESS_GROUP, False, DistOptions, _DIST_FLAGS),
    Backend(Transport.GRPC, "kvtransfer.transport.grpc.backend", Rendezvous.ADDRESS, False, GrpcOptions,
            _GRPC_FLAGS),
    Backend(Transport.CUDA_IPC, "kvtransfer.transport.cuda_ipc.backend", Rendezvous.ADDRESS, True, IpcOptions, _IPC_FLAGS),
    Backend(Transport.FAKE, "kvtransfer.transport.fake", Rendezvous.IN_PROCESS, False, FakeOptions, ()),
)}
SERVER_TRANSPORTS = ("auto", "nccl", "gloo", "grpc", "cuda_ipc")  # what --transport accepts


def backend(name: str | Transport) -> Backend:
    try:
        return BACKENDS[Transport(name)]
    except ValueError:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(t.value for t in Transport)}") from None


def resolve(name: str, device_type: str) -> Backend:
    """--transport (auto: nccl on CUDA, gloo on CPU) -> its backend, refused when it needs CUDA and there is none."""
    if name not in SERVER_TRANSPORTS:
        raise ValueError(f"--transport {name!r}: choose one of {', '.join(SERVER_TRANSPORTS)}")
    if name == "auto":
        name = "nccl" if device_type == "cuda" else "gloo"
    b = backend(name)
    if b.needs_cuda and device_type != "cuda":
        raise ValueError(f"--transport {name} needs CUDA devices; use gloo or grpc on CPU")
    return b


def options_from(config, transport: str):
    """The chosen backend's options from a server config; a field of another backend set to anything but its
    default is refused with the flag named ("auto" counts as nccl/gloo)."""
    chosen = backend("gloo" if transport == "auto" else transport)
    mine = {f for f, _ in chosen.flags}
    defaults = {f.name: f.default for f in fields(config)}
    owners: dict[str, list[str]] = {}
    for other in BACKENDS.values():
        for field, _ in other.flags:
            owners.setdefault(field, []).append(other.name.value)
    for field, names in owners.items():
        if field not in mine and field in defaults and getattr(config, field) != defaults[field]:
            raise ValueError(f"--{field.replace('_', '-')} is a {'/'.join(names)} option; this server runs "
                             f"--transport {transport}")
    return chosen.options(**{o: getattr(config, f) for f, o in chosen.flags if f in defaults})


def sender_link(name: str | Transport, device, options=None, *, address: str = "", **kw) -> SenderLink:
    """The prefill side's link; `address`: what the decode side announced (Rendezvous.ADDRESS)."""
    b = backend(name)
    if b.rendezvous is not Rendezvous.PROCESS_GROUP and not address:
        raise ValueError(f"transport {b.name} needs the receiver's address (the decode side sends it at the handshake)")
    return importlib.import_module(b.module).sender_link(device, options or b.options(), address=address, **kw)


def receiver_link(name: str | Transport, device, options=None, *, address: str = "", max_bytes: int = 64 << 30,
                  max_layers: int = 4096, **kw) -> ReceiverLink:
    """The decode side's link; it listens at `address` (Rendezvous.ADDRESS); process groups must be joined."""
    b = backend(name)
    return importlib.import_module(b.module).receiver_link(device, options or b.options(), address=address,
                                                           max_bytes=max_bytes, max_layers=max_layers, **kw)
