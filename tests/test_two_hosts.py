"""Prefill on one host, decode on another: two network namespaces joined by a veth pair."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from bench.measure.launch import ROOT, free_port, spawn, stop
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from support import netns
from support.enginekit import engine_generate

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")]


def client(host: netns.Host, addr: str, ids: list[int], n: int) -> dict:
    p = host.run(sys.executable, "-m", "decode_server.client", "--addr", addr, "--ids", ",".join(map(str, ids)),
                 "--max-new-tokens", str(n), "--digest", cwd=ROOT, timeout=120,
                 env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_gloo_over_tcp_between_namespaces(tmp_path):
    model = load_model(ModelSpec("tiny", "float32"))
    ids = random_prompt(model.config.vocab_size, 57, seed=3).view(-1).tolist()
    want = engine_generate(model, ids, 6)
    with netns.two_hosts() as (a, b):
        dist = f"tcp://{a.addr}:{free_port()}"
        common = ["--model", "tiny", "--dtype", "float32", "--dist-init", dist]
        logs = [str(tmp_path / "prefill.log"), str(tmp_path / "decode.log")]
        procs = [
            spawn("prefill_server", [*common, "--listen", f"{a.addr}:50061"], logs[0],
                  env=dict(os.environ, GLOO_SOCKET_IFNAME=a.ifname), prefix=a.prefix),
            spawn("decode_server", [*common, "--listen", f"{b.addr}:50051", "--prefill-addr", f"{a.addr}:50061"],
                  logs[1], env=dict(os.environ, GLOO_SOCKET_IFNAME=b.ifname), prefix=b.prefix),
        ]
        try:
            netns.wait_for_line(logs[1], "decode server ready", procs)
            for mode_ids in (ids, ids[:5]):
                got = client(b, f"{b.addr}:50051", mode_ids, 6)
                ref = engine_generate(model, mode_ids, 6)
                assert got["tokens"] == ref[0]
                assert got["logits_digests"] == ref[1]
            assert want[0] == client(b, f"{b.addr}:50051", ids, 6)["tokens"]
        finally:
            stop(procs)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make test certificates")
def test_grpc_with_tls_between_namespaces(tmp_path):
    """gRPC data plane and control plane, both TLS (mutual on the data plane), across the veth pair."""
    model = load_model(ModelSpec("tiny", "float32"))
    ids = random_prompt(model.config.vocab_size, 77, seed=4).view(-1).tolist()
    want = engine_generate(model, ids, 6)
    with netns.two_hosts("g") as (a, b):
        certs = tmp_path / "certs"
        subprocess.run(["bash", os.path.join(ROOT, "deploy", "make_test_ca.sh"), str(certs), "1",
                        f"IP:{a.addr},IP:{b.addr}"], check=True, capture_output=True)
        ca, crt, key = str(certs / "ca.pem"), str(certs / "server.pem"), str(certs / "server.key")
        ccrt, ckey = str(certs / "client.pem"), str(certs / "client.key")
        common = ["--model", "tiny", "--dtype", "float32", "--transport", "grpc"]
        logs = [str(tmp_path / "prefill.log"), str(tmp_path / "decode.log")]
        procs = [
            spawn("prefill_server", [*common, "--listen", f"{a.addr}:50061", "--tls-cert", crt, "--tls-key", key,
                                     "--data-tls-ca", ca, "--data-tls-cert", ccrt, "--data-tls-key", ckey],
                  logs[0], prefix=a.prefix),
            spawn("decode_server", [*common, "--listen", f"{b.addr}:50051", "--prefill-addr", f"{a.addr}:50061",
                                    "--prefill-tls-ca", ca, "--data-listen", f"{b.addr}:0",
                                    "--data-tls-cert", crt, "--data-tls-key", key, "--data-tls-ca", ca],
                  logs[1], prefix=b.prefix),
        ]
        try:
            netns.wait_for_line(logs[1], "decode server ready", procs)
            got = client(b, f"{b.addr}:50051", ids, 6)
            assert got["tokens"] == want[0]
            assert got["logits_digests"] == want[1]
        finally:
            stop(procs)
        with open(logs[1]) as f:
            assert "data plane (grpc) listening" in f.read()
