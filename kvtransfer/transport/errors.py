"""Why a transfer failed: one cause per failure, whatever the backend.

Why beside base.py: every layer raises these (transports, both servers); kvtransfer.transport.status
maps each cause to the gRPC status a request ends with, and docs/errors.md lists them.
"""

from __future__ import annotations

import enum


class Cause(enum.StrEnum):
    """Why a transfer failed; kvtransfer.transport.status maps each to the gRPC status a request ends with."""
    ABORTED = "aborted"      # one side gave up (abort, or the receiver let go)
    TIMEOUT = "timeout"      # a deadline passed
    PEER = "peer"            # the other side or the connection is gone
    PROTOCOL = "protocol"    # a frame or a call that breaks the contract
    DATA_LOSS = "data_loss"  # bytes arrived corrupted (checksum)


class TransferError(RuntimeError):
    def __init__(self, cause: Cause | str, message: str):
        self.cause = Cause(cause)
        super().__init__(f"{self.cause.value}: {message}")


class TlsRefused(TransferError):
    """The data plane's TLS handshake failed (a certificate that does not name the address, or another CA): no retry
    can heal it, so the pairing that met it is refused, not retried."""

    def __init__(self, message: str):
        super().__init__(Cause.PEER, message)
