"""Helpers for the bad-input catalogue: raw calls that bypass the stubs, and the outcome of one case.

Why apart from the tests: test_bad_inputs.py and test_security.py run the same kind of
case (a call that must fail with one exact status, then a good request on the same
servers), and a case reads best as one small coroutine in a table.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from bench.measure.launch import ROOT
from decode_server.client import generate
from kvtransfer.rpc.security import ClientSecurity
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

GENERATE = "/kvtransfer.v1.Decode/Generate"
PREFILL = "/kvtransfer.v1.Prefill/Prefill"
HANDSHAKE = "/kvtransfer.v1.Prefill/Handshake"
HEALTH = "/grpc.health.v1.Health/Check"
CORRUPT = b"\xff\xff\xff\xff\x0f"  # field 0x1fffffff.. with wire type 7: not protobuf at all
PLAIN = ClientSecurity()


@dataclass
class Target:
    """The servers a case runs against and how to reach them."""

    addr: str
    prefill_addr: str
    compat: pb.Compat | None = None
    security: ClientSecurity = PLAIN
    log_text: Callable[[], str] = str
    files: dict = field(default_factory=dict)  # certificate files a case may need


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Target], Awaitable]  # raises AioRpcError, or returns (code, details)
    code: grpc.StatusCode
    words: tuple[str, ...]               # the details must contain one of these
    slot_wait_s: float = 0.0             # how long the good request may wait for an in-flight slot


async def outcome(case: Case, t: Target) -> tuple[grpc.StatusCode, str]:
    """(code, details). A call that answers (a response, a stream's messages) ends OK: a wrongly accepted
    case then fails on its status, named as OK, not on unpacking the answer."""
    try:
        got = await case.call(t)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], grpc.StatusCode):
        return got
    return grpc.StatusCode.OK, "" if got is None else f"answered with {type(got).__name__}"


async def raw_unary(t: Target, addr: str, method: str, payload: bytes, timeout: float = 10, metadata=None):
    """Send `payload` bytes as the request of a unary method, no serializer in between."""
    async with t.security.channel(addr) as ch:
        return await ch.unary_unary(method)(payload, timeout=timeout,
                                            metadata=metadata if metadata is not None else t.security.metadata())


async def raw_stream(t: Target, addr: str, method: str, payload: bytes, timeout: float = 10, metadata=None):
    async with t.security.channel(addr) as ch:
        call = ch.unary_stream(method)(payload, timeout=timeout,
                                       metadata=metadata if metadata is not None else t.security.metadata())
        return [m async for m in call]


def gen_request(ids, new: int = 2, mode: int = pb.MODE_AUTO) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=ids, max_new_tokens=new, mode=mode)


async def call_generate(t: Target, req: pb.GenerateRequest, timeout: float = 30, metadata=None):
    async with t.security.channel(t.addr) as ch:
        stream = pbg.DecodeStub(ch).Generate(req, timeout=timeout,
                                             metadata=metadata if metadata is not None else t.security.metadata())
        return [m async for m in stream]


async def call_prefill(t: Target, req: pb.PrefillRequest, timeout: float = 30, metadata=None):
    async with t.security.channel(t.prefill_addr) as ch:
        return await pbg.PrefillStub(ch).Prefill(
            req, timeout=timeout, metadata=metadata if metadata is not None else t.security.metadata())


async def call_handshake(t: Target, req: pb.HandshakeRequest, timeout: float = 10):
    async with t.security.channel(t.prefill_addr) as ch:
        return await pbg.PrefillStub(ch).Handshake(req, timeout=timeout, metadata=t.security.metadata())


def good_request(t: Target, slot_wait_s: float = 0.0) -> dict:
    """A valid request must succeed; waits up to `slot_wait_s` while an in-flight slot frees up."""
    deadline = time.monotonic() + slot_wait_s
    while True:
        try:
            return asyncio.run(generate(t.addr, [5, 6, 7], 2, "auto", timeout=30, security=t.security))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_for_log(t: Target, words: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in t.log_text().splitlines():
            if words in line:
                return line
        time.sleep(0.1)
    return ""


def undocumented(cases: list[Case]) -> list[str]:
    """Names of cases without a row in docs/errors.md (the table must not drift from the tests)."""
    with open(os.path.join(ROOT, "docs", "errors.md")) as f:
        text = f.read()
    return [c.name for c in cases if f"`{c.name}`" not in text]
