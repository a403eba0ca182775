"""kvtransfer-router with mTLS and a token on both sides, in real processes (docs/router.md, "Security").

What it shows: a decode worker that requires mTLS and its token is reached by a router that holds a client
certificate and that token (--worker-tls-*, --worker-auth-token-file), while the router's own front door requires
mTLS and another token (--tls-*, --auth-token-file). A caller with both gets the engine's tokens; a caller
presenting the workers' token instead of the front door's is UNAUTHENTICATED (the two are separate trust
relationships); a plaintext caller does not get through; the router keeps serving the right caller after each.
"""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest

from bench.measure.launch import free_port, stop, wait_serving
from kvtransfer.rpc.security import ClientSecurity
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.enginekit import engine_generate
from support.faultkit import Half
from test_security import make_ca, server_tls

S = grpc.StatusCode
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")
IDS, NEW = [5, 6, 7, 8, 9], 6


async def generate(security: ClientSecurity, addr: str) -> tuple[grpc.StatusCode, list[int], str]:
    async with security.channel(addr) as ch:
        call = pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=IDS, max_new_tokens=NEW), timeout=30,
                                           metadata=security.metadata())
        tokens = []
        try:
            async for m in call:
                tokens.append(m.token_id)
        except grpc.aio.AioRpcError as e:
            return e.code(), tokens, e.details() or ""
        return S.OK, tokens, ""


def test_mtls_and_tokens_on_both_sides_of_the_router(tmp_path, tiny_fp32):
    c = make_ca(tmp_path / "ca")
    worker_token, front_token = tmp_path / "worker-token", tmp_path / "front-token"
    worker_token.write_text("worker-side-secret\n")
    front_token.write_text("front-door-secret\n")
    w_addr, r_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    worker = Half("decode_server", ["--colocated", "--model", "tiny", "--dtype", "float32", "--listen", w_addr,
                                    *server_tls(c), "--auth-token-file", str(worker_token)], str(tmp_path))
    router = Half("router", ["--listen", r_addr, "--worker", w_addr, "--worker-tls-ca", c["ca.pem"],
                             "--worker-tls-cert", c["client.pem"], "--worker-tls-key", c["client.key"],
                             "--worker-auth-token-file", str(worker_token), *server_tls(c),
                             "--auth-token-file", str(front_token)], str(tmp_path))
    creds = grpc.ssl_channel_credentials(*(open(c[n], "rb").read() for n in ("ca.pem", "client.key", "client.pem")))
    try:
        worker.start()
        router.start()
        wait_serving(w_addr, [worker.proc], 120, credentials=creds)
        wait_serving(r_addr, [router.proc], 60, credentials=creds)  # its poll of the worker went through mTLS
        right = ClientSecurity(c["ca.pem"], c["client.pem"], c["client.key"], "front-door-secret")
        want = engine_generate(tiny_fp32, IDS, NEW)[0]
        assert asyncio.run(generate(right, r_addr)) == (S.OK, want, ""), router.log_text()[-3000:]
        code, _, details = asyncio.run(generate(ClientSecurity(**{**right.__dict__,
                                                                  "auth_token": "worker-side-secret"}), r_addr))
        assert code == S.UNAUTHENTICATED, (code, details)
        code, _, _ = asyncio.run(generate(ClientSecurity(auth_token="front-door-secret"), r_addr))  # plaintext
        assert code == S.UNAVAILABLE, code
        assert asyncio.run(generate(right, r_addr)) == (S.OK, want, "")
        assert "(mTLS, token required)" in router.log_text() and f"({w_addr}, TLS)" in router.log_text()
    finally:
        stop([h.proc for h in (router, worker) if h.proc is not None])
