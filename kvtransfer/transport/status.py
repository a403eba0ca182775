"""The one cause -> gRPC status table: how a failed transfer (TransferError.cause) ends its request.

Why one: the gRPC data plane ends a stream with this status, the prefill server answers
`Prefill` with it and the decode server ends `Generate` with it, and docs/errors.md
documents it; tests/test_status.py checks every row against that document.
"""

from __future__ import annotations

import grpc

from kvtransfer.transport.base import Cause

S = grpc.StatusCode

CAUSE_STATUS: dict[Cause, grpc.StatusCode] = {
    Cause.ABORTED: S.UNAVAILABLE,          # a side gave up: transient, retry
    Cause.TIMEOUT: S.DEADLINE_EXCEEDED,
    Cause.PEER: S.UNAVAILABLE,
    Cause.PROTOCOL: S.INTERNAL,            # a frame that breaks the contract: a bug or a peer past the handshake
    Cause.DATA_LOSS: S.DATA_LOSS,          # a checksum failed
}

# A status that arrived without a typed cause (a gRPC-level failure): the cause it most likely means.
_CAUSE_OF_BARE_STATUS = {S.CANCELLED: Cause.ABORTED, S.DEADLINE_EXCEEDED: Cause.TIMEOUT, S.DATA_LOSS: Cause.DATA_LOSS,
                         S.INVALID_ARGUMENT: Cause.PROTOCOL, S.RESOURCE_EXHAUSTED: Cause.PROTOCOL,
                         S.FAILED_PRECONDITION: Cause.PROTOCOL, S.UNIMPLEMENTED: Cause.PROTOCOL,
                         S.OUT_OF_RANGE: Cause.PROTOCOL, S.INTERNAL: Cause.PROTOCOL}


def transfer_status(e) -> grpc.StatusCode:
    """The gRPC status a failed transfer (TransferError) ends its request with."""
    return CAUSE_STATUS[e.cause]


def cause_of_status(code: grpc.StatusCode) -> Cause:
    return _CAUSE_OF_BARE_STATUS.get(code, Cause.PEER)
