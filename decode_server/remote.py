"""One request's remote prefill: ask the prefill worker, wait for the cache, classify what went wrong.

Why the classification: the --on-failure policy applies to failures of the peer or of the
data plane (a dead or unpaired peer, a lost connection, an aborted or corrupt transfer, a
peer slower than --peer-timeout-s), never to what the request itself got wrong (those keep
their own status). The remote wait is bounded by --peer-timeout-s as well as the request's
deadline, so that a stalled peer still leaves time to recompute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvtransfer.status import transfer_status
from kvtransfer.transport import TransferError
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
    layers: list  # [(k, v)] per layer, on the device
    t_sent: float  # perf_counter: Prefill call made
    t_first: float  # first token known
    t_ready: float  # whole cache on the device
    release: Callable[[], None]  # call when the request is over: its receive buffers are let go


async def remote_prefill(pairing, request, rid: int, deadline: float, metadata, destination, lease) -> Remote:
    """Prefill `request` on the peer as request `rid`, its cache landing in `destination` (per layer (k, v) views
    of the request's pool slot, held by `lease` while a frame lands); raises PeerFailure or RequestError."""
    c = pairing.config
    if not pairing.up:
        raise PeerFailure("peer_down", S.UNAVAILABLE,
                          f"the prefill worker at {c.prefill_addr} is unavailable: {pairing.why_down()}")
    loop, n = pairing.loop, len(request.token_ids)
    peer_deadline = min(deadline, time.perf_counter() + c.peer_timeout_s)
    by_peer = peer_deadline < deadline  # which bound a timeout hits: the peer's, or the request's own
    exp = loop.expect(rid, n, destination, lease)
    arrived = False
    try:
        t_sent = time.perf_counter()
        resp = await pairing.stub.Prefill(
            pb.PrefillRequest(request_id=rid, token_ids=request.token_ids, mode=request.mode,
                              return_logits_digest=request.return_logits_digest),
            timeout=max(peer_deadline - t_sent, 0.001), metadata=metadata)
        t_first = time.perf_counter()
        layers = await asyncio.wait_for(asyncio.wrap_future(exp.future), max(peer_deadline - t_first, 0.001))
        arrived = True
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == S.DEADLINE_EXCEEDED and by_peer:
            raise PeerFailure("peer_timeout", S.UNAVAILABLE, f"the prefill worker did not answer within "
                              f"--peer-timeout-s {c.peer_timeout_s:g} s") from None
        if code in PEER_CODES:
            raise PeerFailure("peer_error", code, f"the prefill worker at {c.prefill_addr} failed the request "
                              f"({code.name}: {e.details()})") from None
        raise RequestError(code, f"prefill worker: {e.details()}") from None
    except TransferError as e:
        raise PeerFailure(f"transfer_{e.cause}", transfer_status(e), f"cache transfer: {e}") from None
    except asyncio.TimeoutError:
        if by_peer:
            raise PeerFailure("peer_timeout", S.UNAVAILABLE, "the cache did not arrive from the prefill worker "
                              f"within --peer-timeout-s {c.peer_timeout_s:g} s") from None
        raise RequestError(S.DEADLINE_EXCEEDED, "the cache did not arrive before the deadline") from None
    finally:
        if not arrived:  # failed, timed out or cancelled: a late frame is drained and dropped
            loop.forget(rid)
            loop.release(exp)
    return Remote(resp, layers, t_sent, t_first, max(exp.t_ready, t_first), lambda: loop.release(exp))
