"""A Generate call its client cancels mid-decode: the one way tests end a request from the client's side.

Why a helper: the block-accounting tests (test_paged_servers.py, test_preempt_servers.py) each need a request
cancelled once it streams, and the call's shape (a raw stub, cancel after the n-th message) is the same.
"""

from __future__ import annotations

import grpc

from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg


async def cancel_after(addr: str, ids: list[int], max_new_tokens: int, after: int = 3) -> str:
    """Send a colocated Generate and cancel it after `after` messages: "CANCELLED", or "OK" if it ended first."""
    async with grpc.aio.insecure_channel(addr) as ch:
        call = pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=max_new_tokens,
                                                              mode=pb.MODE_COLOCATED))
        got = 0
        async for _ in call:
            got += 1
            if got == after:
                call.cancel()
                return "CANCELLED"
        return "OK"
