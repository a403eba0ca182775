"""TLS, mutual TLS and the shared token on both gRPC services, in real processes.

Why these cases: a secured service is only secured if every way around it is refused
(no token, a wrong token, plaintext, no client certificate, a certificate from another
CA, an untrusted server) while the health service stays open to probes and the servers
keep serving the clients that do hold the right credentials.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2

from decode_server.client import main as client_main
from decode_server.config import DecodeConfig
from kvtransfer.rpc.configargs import one_line
from kvtransfer.rpc.security import ClientSecurity, resolve_token
from prefill_server.config import PrefillConfig
from proto import kvtransfer_pb2 as pb
from support.badinputs import (
    CORRUPT,
    GENERATE,
    HEALTH,
    Case,
    Target,
    call_generate,
    call_prefill,
    gen_request,
    good_request,
    outcome,
    raw_stream,
    raw_unary,
    undocumented,
)
from support.servers import ROOT, colocated_server, server_pair

S = grpc.StatusCode
TOKEN = "s3cret-token-for-tests"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")


def make_ca(out) -> dict[str, str]:
    subprocess.run(["bash", os.path.join(ROOT, "deploy", "make_test_ca.sh"), str(out), "1"], check=True,
                   capture_output=True)
    return {n: str(out / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    token = base / "token"
    token.write_text(TOKEN + "\n")
    return {"ca": make_ca(base / "ca"), "other": make_ca(base / "other"), "token": str(token)}


def full(pki, token=TOKEN) -> ClientSecurity:
    c = pki["ca"]
    return ClientSecurity(c["ca.pem"], c["client.pem"], c["client.key"], token)


def server_tls(c: dict, prefix="--tls") -> list[str]:
    return [f"{prefix}-cert", c["server.pem"], f"{prefix}-key", c["server.key"], f"{prefix}-ca", c["ca.pem"]]


@pytest.fixture(scope="module")
def secure(tmp_path_factory, pki):
    """mTLS + token on both services; the decode server reaches the prefill server the same way."""
    c, tok = pki["ca"], ["--auth-token-file", pki["token"]]
    to_prefill = ["--prefill-tls-ca", c["ca.pem"], "--prefill-tls-cert", c["client.pem"],
                  "--prefill-tls-key", c["client.key"], "--prefill-auth-token-file", pki["token"]]
    creds = grpc.ssl_channel_credentials(*(open(c[n], "rb").read() for n in ("ca.pem", "client.key", "client.pem")))
    with server_pair(tmp_path_factory.mktemp("secure"), prefill_args=[*server_tls(c), *tok],
                     decode_args=[*server_tls(c), *tok, *to_prefill], credentials=creds) as run:
        yield Target(run.addr, run.prefill_addr, security=full(pki), log_text=run.log_text, files=pki)


def without(t: Target, **changes) -> Target:
    return Target(t.addr, t.prefill_addr, security=ClientSecurity(**{**t.security.__dict__, **changes}))


async def health_check(t: Target):
    async with t.security.channel(t.addr) as ch:
        r = await ch.unary_unary(HEALTH, response_deserializer=health_pb2.HealthCheckResponse.FromString)(
            health_pb2.HealthCheckRequest().SerializeToString(), timeout=5)
        return S.OK, health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def other_ca(t: Target, client_cert_from_other: bool) -> Target:
    """A client whose certificate, or whose trust in the server, comes from another CA."""
    ours, other = t.files["ca"], t.files["other"]
    signer = other if client_cert_from_other else ours
    return without(t, tls_ca=(ours if client_cert_from_other else other)["ca.pem"],
                   tls_cert=signer["client.pem"], tls_key=signer["client.key"])


PLAINTEXT = dict(tls_ca="", tls_cert="", tls_key="")
ONE = gen_request([1, 2])

CASES = [
    Case("missing_token", lambda t: call_generate(without(t, auth_token=""), ONE, timeout=5),
         S.UNAUTHENTICATED, ("missing 'authorization: Bearer <token>' metadata",)),
    Case("wrong_token", lambda t: call_generate(without(t, auth_token="nope"), ONE, timeout=5),
         S.UNAUTHENTICATED, ("does not match this server's --auth-token",)),
    Case("prefill_missing_token",
         lambda t: call_prefill(without(t, auth_token=""), pb.PrefillRequest(request_id=5, token_ids=[1]), timeout=5),
         S.UNAUTHENTICATED, ("missing 'authorization: Bearer <token>' metadata",)),
    Case("garbage_without_token", lambda t: raw_stream(without(t, auth_token=""), t.addr, GENERATE, CORRUPT),
         S.UNAUTHENTICATED, ("missing 'authorization: Bearer <token>' metadata",)),
    Case("health_open_without_token", lambda t: health_check(without(t, auth_token="")), S.OK, ("SERVING",)),
    Case("plaintext_to_tls_port", lambda t: call_generate(without(t, **PLAINTEXT), ONE, timeout=5),
         S.UNAVAILABLE, ("Socket closed",)),
    Case("plaintext_to_tls_prefill",
         lambda t: raw_unary(without(t, **PLAINTEXT), t.prefill_addr, HEALTH, b"", timeout=5),
         S.UNAVAILABLE, ("Socket closed",)),
    Case("no_client_certificate", lambda t: call_generate(without(t, tls_cert="", tls_key=""), ONE, timeout=5),
         S.UNAVAILABLE, ("Socket closed",)),
    Case("client_cert_from_other_ca", lambda t: call_generate(other_ca(t, True), ONE, timeout=5),
         S.UNAVAILABLE, ("Socket closed",)),
    Case("server_not_trusted", lambda t: call_generate(other_ca(t, False), ONE, timeout=5),
         S.UNAVAILABLE, ("CERTIFICATE_VERIFY_FAILED",)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_secure_pair_refuses(secure, case):
    code, details = asyncio.run(outcome(case, secure))
    assert code == case.code, f"{case.name}: {code} {details!r}"
    assert any(w in details for w in case.words), f"{case.name}: {details!r} names none of {case.words}"
    assert len(good_request(secure)["tokens"]) == 2


def test_cases_are_documented():
    assert not undocumented(CASES), "docs/errors.md lacks rows for these cases"


def test_client_cli_speaks_tls_and_token(secure, pki, capsys):
    c = pki["ca"]
    tls = ["--addr", secure.addr, "--tls-ca", c["ca.pem"], "--tls-cert", c["client.pem"], "--tls-key", c["client.key"]]
    client_main([*tls, "--auth-token-file", pki["token"], "--ids", "1,2,3", "--max-new-tokens", "3"])
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]) == 3
    with pytest.raises(SystemExit) as e:
        client_main([*tls, "--ids", "1,2,3"])
    assert e.value.code == 1 and "UNAUTHENTICATED" in capsys.readouterr().err


def test_token_never_logged(secure):
    text = secure.log_text()
    assert TOKEN not in text and "auth_token_file=" in text


def test_decode_refuses_prefill_with_other_token(tmp_path, pki):
    """A decode server holding the wrong control-plane token stops at the handshake and says why."""
    with server_pair(tmp_path, prefill_args=["--auth-token", TOKEN],
                     decode_args=["--prefill-auth-token", "another-secret"], wait=False) as run:
        run.procs[1].wait(timeout=120)
        assert run.procs[1].returncode != 0
        assert "does not match this server's --auth-token" in run.log_text()


def test_tls_without_client_certificates_and_inline_token(tmp_path, pki):
    """Server-only TLS (no --tls-ca): any client that trusts the CA and holds the token gets in."""
    c = pki["ca"]
    args = ["--tls-cert", c["server.pem"], "--tls-key", c["server.key"], "--auth-token", TOKEN]
    with colocated_server(tmp_path, args=args, wait_credentials=grpc.ssl_channel_credentials(
            open(c["ca.pem"], "rb").read())) as run:
        t = Target(run.addr, "", security=ClientSecurity(tls_ca=c["ca.pem"], auth_token=TOKEN))
        assert len(good_request(t)["tokens"]) == 2
        code, _ = asyncio.run(outcome(Case("plain", lambda t: call_generate(without(t, tls_ca=""), gen_request([1])),
                                           S.UNAVAILABLE, ()), t))
        assert code == S.UNAVAILABLE
        assert len(good_request(t)["tokens"]) == 2
        assert TOKEN not in run.log_text() and "auth_token=<set>" in run.log_text()


def test_config_refuses_inconsistent_security(tmp_path, pki):
    c = pki["ca"]
    for make, kw, words in [
        (PrefillConfig, dict(tls_cert=c["server.pem"]), "--tls-cert and --tls-key go together"),
        (PrefillConfig, dict(tls_ca=c["ca.pem"]), "--tls-ca (require client certificates) needs --tls-cert"),
        (PrefillConfig, dict(tls_cert=str(tmp_path / "nope.pem"), tls_key=c["server.key"]), "no such file"),
        (DecodeConfig, dict(prefill_tls_cert=c["client.pem"], prefill_tls_key=c["client.key"]),
         "--prefill-tls-cert (client certificate) needs --prefill-tls-ca"),
        (DecodeConfig, dict(auth_token="a", auth_token_file=pki["token"]), "give one, not both"),
        (DecodeConfig, dict(prefill_auth_token_file=str(tmp_path / "none")), "--prefill-auth-token-file"),
        (DecodeConfig, dict(max_message_bytes=1000), "--max-message-bytes 1000 is too small"),
        (PrefillConfig, dict(max_inflight=0), "--max-inflight must be >= 1"),
    ]:
        with pytest.raises(ValueError) as e:
            make(**kw)
        assert words in str(e.value), (kw, str(e.value))
    assert "auth_token=<set>" in one_line(DecodeConfig(auth_token="x")) and "=x " not in one_line(
        DecodeConfig(auth_token="x"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_token("", str(empty))


def test_no_pickle_or_eval_in_the_code():
    """No unpickling, eval or exec anywhere in the shipped packages (docs/architecture.md, "Control plane:
    typed messages only")."""
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    found = []
    for pkg in ("kvtransfer", "prefill_server", "decode_server", "bench", "proto", "deploy"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                    found += [f"{path}: import {m}" for m in mods if m.split(".")[0] in banned_modules]
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                            "eval", "exec"):
                        found.append(f"{path}:{node.lineno}: {node.func.id}()")
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr == "load" and getattr(node.func.value, "id", "") == "torch"
                            and not any(k.arg == "weights_only" for k in node.keywords)):
                        found.append(f"{path}:{node.lineno}: torch.load without weights_only")
    assert not found, found


def test_a_data_plane_certificate_that_does_not_name_its_address_stops_the_decode_server_saying_so(tmp_path, pki):
    """The decode side's data plane on 127.0.0.2, its certificate naming 127.0.0.1 (make_test_ca.sh): the prefill
    side waited out its connect timeout and the two re-handshook, neither naming TLS, until --handshake-timeout-s
    (an operator's pass). Now the prefill side refuses the pairing (FAILED_PRECONDITION) and the decode server exits
    2 at once, naming the TLS failure and the flag to fix."""
    c = pki["ca"]
    with server_pair(tmp_path, prefill_args=["--transport", "grpc", "--data-tls-ca", c["ca.pem"]],
                     decode_args=["--transport", "grpc", "--data-listen", "127.0.0.2:0", "--data-tls-cert",
                                  c["server.pem"], "--data-tls-key", c["server.key"], "--handshake-timeout-s", "120"],
                     wait=False) as run:
        assert run.procs[1].wait(timeout=100) == 2  # before: 120 s, then DEADLINE_EXCEEDED
        log = open(run.logs[1]).read()
    assert "refused the handshake" in log and "TLS handshake" in log and "--data-tls-cert" in log, log[-2000:]
