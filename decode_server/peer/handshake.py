"""The handshake with the prefill worker: wait for it, refuse it unless it holds the same model and layout.

Why apart: the decode server handshakes at start (a refusal there ends the process with
the reason) and again after every failure (a refusal there keeps it NOT_SERVING and
retrying), and both must check the same things.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvtransfer.rpc.compat import mismatch, relayed
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

log = logging.getLogger("kvtransfer.decode")


class HandshakeRefused(SystemExit):
    """The peer refused to pair (another model, layout or token): a configuration error."""


class HandshakeTimedOut(HandshakeRefused):
    """The peer did not answer (or could not be paired with) in time: it may still come up."""


WAIT_LOG_S = 10.0  # while the peer does not answer: one log line this often
RETRY_PAUSE_S = 0.2  # between two handshakes that failed


async def handshake(stub: pbg.PrefillStub, compat: pb.Compat, transport, timeout_s: float,
                    max_receive_bytes: int = 0, metadata=None, data_address: str = "",
                    instance_id: int = 0, peer: str = "", quiet: bool = False) -> pb.HandshakeResponse:
    """Wait up to `timeout_s` for the prefill peer (at `peer`, for the logs) to answer; raises HandshakeRefused.
    `quiet`: the answer logged at DEBUG (a retry whose failure was logged already)."""
    start = time.monotonic()
    deadline, next_log = start + timeout_s, start + WAIT_LOG_S
    where = f"the prefill worker at {peer} (--prefill-addr)"
    request = pb.HandshakeRequest(compat=compat, transport=transport.proto, max_receive_bytes=max_receive_bytes,
                                  data_address=data_address, instance_id=instance_id)
    while True:
        try:
            resp = await stub.Handshake(request, timeout=max(min(10.0, deadline - time.monotonic()), 0.1),
                                        wait_for_ready=True, metadata=metadata)
            break
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                raise HandshakeRefused(f"{where} refused the handshake: {relayed(e.details() or '')}") from None
            now = time.monotonic()
            if now > deadline:
                raise HandshakeTimedOut(f"{where} did not answer the handshake within {timeout_s:g} s "
                                       f"(--handshake-timeout-s): {e.code().name} {e.details()}") from None
            if now >= next_log:
                log.info("waiting for %s: %.0f s so far, giving up after %g s (--handshake-timeout-s)", where,
                         now - start, timeout_s)
                next_log = now + WAIT_LOG_S
            await asyncio.sleep(min(RETRY_PAUSE_S, max(deadline - now, 0)))  # a refusal (stopping) comes at once
    problem = mismatch(compat, resp.compat, here="this decode worker", peer="prefill worker")
    if problem:
        raise HandshakeRefused(f"refused {where}: {problem}")
    log.log(logging.DEBUG if quiet else logging.INFO, "handshake ok: %s %s fingerprint %s", resp.compat.model,
            resp.compat.dtype, resp.compat.weights_fingerprint)
    return resp
