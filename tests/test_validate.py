"""What the servers tell an operator or a client must be true when acted on, in real processes on CPU.

Why these together: each is a message (or a metric) read by someone who then does what it says. A refusal's
advice must be accepted when followed (the prompt-context check and the --max-seq-len slot check advise one
bound, the smaller); a handshake refusal the decode worker relays must name its own side as its own; and a
colocated server, which has no peer, must not export a `kvt_peer_up 0` that reads as a pair that is down.

Why one colocated server for the advice and the metrics: a start costs seconds on a shared CPU.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import urllib.request

import grpc
import pytest

from bench.measure.launch import colocated_server, free_port
from decode_server.client import generate
from support.servers import server_pair

MAX_SEQ = 600       # --max-seq-len: the KV slot, below tiny's context of 4,096 tokens
EXIT_DEADLINE_S = 240


def ids(n: int) -> list[int]:
    return [(7 * i + 3) % 512 for i in range(n)]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    mport = free_port()
    with colocated_server(str(tmp_path_factory.mktemp("colo")), "tiny", "float32", "cpu",
                          args=["--max-seq-len", str(MAX_SEQ), "--metrics-port", str(mport)]) as run:
        yield run, mport


def refusal(addr: str, n: int, new: int) -> str | None:
    """The INVALID_ARGUMENT details for a prompt of n tokens asking for `new` (None: answered in full)."""
    try:
        got = asyncio.run(generate(addr, ids(n), new, timeout=120))
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        return e.details()
    assert len(got["tokens"]) == new
    return None


@pytest.mark.parametrize("n,new", [
    (500, 200),   # within the context (700 <= 4096), over the slot (700 > 600)
    (10, 4090),   # over both: the context check used to advise 4,086 new tokens, which the slot refuses
])
def test_advice_for_too_many_new_tokens_is_accepted_when_followed(colocated, n, new):
    run, _ = colocated
    why = refusal(run.addr, n, new)
    assert why is not None and "--max-seq-len" in why, why
    m = re.search(r"ask for at most (\d+) new tokens", why)
    assert m and int(m[1]) == MAX_SEQ - n, why
    assert refusal(run.addr, n, int(m[1])) is None


def test_advice_for_a_prompt_that_fills_the_slot_is_accepted_when_followed(colocated):
    run, _ = colocated
    why = refusal(run.addr, MAX_SEQ, 1)
    m = re.search(r"send at most (\d+) prompt tokens", why or "")
    assert m and "--max-seq-len" in why, why
    assert refusal(run.addr, int(m[1]), 1) is None


def test_colocated_server_exports_no_peer_up(colocated):
    _, mport = colocated
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    assert 'kvt_info{role="decode"} 1.0' in text  # the endpoint is this server's
    assert not [line for line in text.splitlines() if line.startswith("kvt_peer_up")], text


def test_relayed_dtype_refusal_names_the_decode_side_as_its_own(tmp_path):
    """Prefill float32, decode bfloat16: the decode server exits 2, its message naming its own dtype as its own."""
    with server_pair(tmp_path, dtype="float32", prefill_args=["--transport", "gloo"],
                     decode_args=["--transport", "gloo", "--dtype", "bfloat16"], wait=False) as run:
        decode = run.procs[1]
        deadline = time.monotonic() + EXIT_DEADLINE_S
        while decode.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            rc = decode.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the decode server did not exit within {EXIT_DEADLINE_S} s\n{run.log_text()}")
        log = open(run.logs[1]).read()
    lines = [line for line in log.splitlines() if "cannot start:" in line]
    assert rc == 2 and len(lines) == 1, log[-3000:]
    assert "dtype: this decode worker 'bfloat16', prefill worker 'float32'" in lines[0], lines[0]
    assert "here" not in lines[0], lines[0]
    assert "the same --dtype" in lines[0] and "--seed" not in lines[0], lines[0]  # the one fix, not every flag


def _compat(**changed):
    from proto import kvtransfer_pb2 as pb
    base = dict(model="tiny", dtype="float32", weights_fingerprint="w1", geometry_digest="g1", num_layers=4,
                kv_heads=2, head_dim=16, layout="l2bhsd", protocol_version=2)
    return pb.Compat(**{**base, **changed})


def test_a_refusal_names_each_root_difference_and_only_its_fix():
    """kvtransfer/rpc/compat.mismatch: another dtype changes both fingerprints too; the refusal shows the dtype's
    values, folds the fingerprints into "differ with it", and asks for --dtype only (it listed every compat value
    and every flag that could be the cause). A fingerprint differing alone is shown with its own fix."""
    from kvtransfer.rpc.compat import mismatch
    a = _compat()
    assert mismatch(a, _compat()) is None
    text = mismatch(a, _compat(dtype="bfloat16", weights_fingerprint="w2", geometry_digest="g2"))
    assert "dtype: here 'float32', peer 'bfloat16'" in text and "'w1'" not in text and "'g1'" not in text, text
    assert "weights_fingerprint, geometry_digest differ with it" in text, text
    assert "the same --dtype" in text and "--seed" not in text and "--model" not in text, text
    text = mismatch(a, _compat(weights_fingerprint="w2"))
    assert "weights_fingerprint: here 'w1', peer 'w2'" in text and "--seed" in text and "--dtype" not in text, text
    text = mismatch(a, _compat(model="other", num_layers=8, weights_fingerprint="w2", geometry_digest="g2"))
    assert "model: here 'tiny'" in text and "num_layers: here 4, peer 8" in text and "'w2'" not in text, text
    assert text.count("the same --model") == 1, text  # one fix however many of its fields differ
    text = mismatch(a, _compat(geometry_digest="g9"))  # nothing it covers differs: another version's digest
    assert "geometry_digest: here 'g1', peer 'g9'" in text and "the same kvtransfer version" in text, text
