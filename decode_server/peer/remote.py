"""How one request's remote prefill can end (DataPlane.remote_prefill): the outcome and the two failure kinds.

Why the classification: the --on-failure policy applies to failures of the peer or of the
data plane (a dead or unpaired peer, a lost connection, an aborted or corrupt transfer, a
peer slower than --peer-timeout-s), never to what the request itself got wrong (those keep
their own status). The remote wait is bounded by --peer-timeout-s as well as the request's
deadline, so that a stalled peer still leaves time to recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from proto import kvtransfer_pb2 as pb

S = grpc.StatusCode
PEER_CODES = {S.UNAVAILABLE, S.INTERNAL, S.UNKNOWN, S.DATA_LOSS, S.ABORTED, S.CANCELLED}


class PeerFailure(Exception):
    """The peer or the data plane failed this request: the policy decides (fail with `code`, or recompute)."""


    def __init__(self, cause: str, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.cause, self.code, self.message = cause, code, message


class RequestError(Exception):
    """The request failed for its own reasons (bad input, a limit, its deadline): it keeps this status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Remote:
    response: pb.PrefillResponse
    t_sent: float  # perf_counter: Prefill call made
    t_first: float  # first token known
    t_ready: float  # whole cache on the device
    release: Callable[[], None]  # call when the request is over: its receive buffers are let go
