"""The bad-input catalogue (docs/errors.md) against a real prefill/decode pair over gloo.

Why each case ends with a good request: a refusal is only correct if the servers are
still whole after it (no leaked in-flight slot, no data plane out of step, no dead loop).
Two configurations serve all cases: `main` (message limit 64 KiB, --max-new-tokens 1000)
and `tight` (--max-inflight 1, --max-receive-bytes 48 tokens' worth) for the limits.

Why cases share a pair only while it is unchanged: a pair takes tens of seconds to start
on a small machine, so one per case is too slow, yet a case that changes the servers (a
handshake wrongly accepted starts a new pairing and the data plane is down until the decode
side pairs again) must fail alone, not the unrelated cases after it. So after every case
the prefill server must not have accepted a handshake (its log counts the pairings) and a
good request must succeed; a case that fails in any way discards its pair, and the next
case starts on a fresh one.
"""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import ExitStack, contextmanager

import grpc
import pytest
import torch

from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec
from kvtransfer.rpc.compat import local_compat
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.badinputs import (
    CORRUPT,
    GENERATE,
    HANDSHAKE,
    HEALTH,
    PREFILL,
    Case,
    Target,
    call_generate,
    call_handshake,
    call_prefill,
    gen_request,
    good_request,
    outcome,
    raw_stream,
    raw_unary,
    undocumented,
    wait_for_log,
)
from support.servers import server_pair

S = grpc.StatusCode
MSG_LIMIT = 65536
CONTEXT = 4096              # tiny's max_position_embeddings
RECEIVE_LIMIT = 48 * 1024   # tiny float32 is 1,024 bytes per token: 48 tokens
UNEXPECTED_ID = 1 << 62


def ids(n: int) -> list[int]:
    return [(7 * i + 3) % 512 for i in range(n)]


def compat_with(t: Target, **changes) -> pb.Compat:
    c = pb.Compat()
    c.CopyFrom(t.compat)
    for k, v in changes.items():
        setattr(c, k, v)
    return c


async def slow_then(t: Target, second):
    """Hold the only in-flight slot with a long request, run `second`, then cancel the long one."""
    async with t.security.channel(t.addr) as ch:
        slow = pbg.DecodeStub(ch).Generate(gen_request(ids(3), 3000), timeout=60)
        await slow.read()  # the first token is out: the request holds its slot
        try:
            return await second(ch)
        finally:
            slow.cancel()


async def cancel_mid_stream(t: Target):
    async with t.security.channel(t.addr) as ch:
        call = pbg.DecodeStub(ch).Generate(gen_request(ids(3), 3000), timeout=60)
        for _ in range(3):
            await call.read()
        call.cancel()
        return await call.code(), await call.details()


async def unexpected_frame(t: Target):
    """The prefill side cannot know; the decode side must drain the frame, drop it and go on."""
    await call_prefill(t, pb.PrefillRequest(request_id=UNEXPECTED_ID, token_ids=ids(9), mode=pb.MODE_LAYERWISE))
    return S.OK, await asyncio.to_thread(wait_for_log, t, f"no request {UNEXPECTED_ID} is waiting")


MAIN = [
    Case("empty_prompt", lambda t: call_generate(t, gen_request([])), S.INVALID_ARGUMENT, ("empty prompt",)),
    Case("prompt_over_model_context", lambda t: call_generate(t, gen_request(ids(CONTEXT))), S.INVALID_ARGUMENT,
         ("the model's context is 4096 tokens",)),
    Case("prompt_over_max_prompt_tokens", lambda t: call_generate(t, gen_request(ids(5001))), S.INVALID_ARGUMENT,
         ("at most 5000 (--max-prompt-tokens)",)),
    Case("token_id_negative", lambda t: call_generate(t, gen_request([1, -1])), S.INVALID_ARGUMENT,
         ("token id -1 outside the vocabulary [0, 512)",)),
    Case("token_id_too_large", lambda t: call_generate(t, gen_request([1, 512])), S.INVALID_ARGUMENT,
         ("token id 512 outside the vocabulary [0, 512)",)),
    Case("max_new_tokens_zero", lambda t: call_generate(t, gen_request([1, 2], 0)), S.INVALID_ARGUMENT,
         ("max_new_tokens is 0; use 1..1000",)),
    Case("max_new_tokens_over_limit", lambda t: call_generate(t, gen_request([1, 2], 1001)), S.INVALID_ARGUMENT,
         ("use 1..1000 (--max-new-tokens)",)),
    Case("max_new_tokens_uint32_max", lambda t: call_generate(t, gen_request([1, 2], 2**32 - 1)),
         S.INVALID_ARGUMENT, ("max_new_tokens is 4294967295",)),
    Case("prompt_plus_new_over_context", lambda t: call_generate(t, gen_request(ids(4000), 200)), S.INVALID_ARGUMENT,
         ("exceeds the model's context of 4096 tokens; ask for at most 96",)),
    Case("unknown_mode", lambda t: call_generate(t, gen_request([1, 2], 2, mode=7)), S.INVALID_ARGUMENT,
         ("unknown mode 7",)),
    Case("unknown_method", lambda t: raw_unary(t, t.addr, "/kvtransfer.v1.Decode/Nope", b""), S.UNIMPLEMENTED,
         ("Method not found",)),
    Case("garbage_generate", lambda t: raw_stream(t, t.addr, GENERATE, CORRUPT), S.INVALID_ARGUMENT,
         ("not a valid kvtransfer.v1.GenerateRequest",)),
    Case("garbage_prefill", lambda t: raw_unary(t, t.prefill_addr, PREFILL, CORRUPT), S.INVALID_ARGUMENT,
         ("not a valid kvtransfer.v1.PrefillRequest",)),
    Case("garbage_handshake", lambda t: raw_unary(t, t.prefill_addr, HANDSHAKE, CORRUPT), S.INVALID_ARGUMENT,
         ("not a valid kvtransfer.v1.HandshakeRequest",)),
    # the health service is gRPC's own: it answers corrupt bytes with UNKNOWN
    Case("garbage_health_decode", lambda t: raw_unary(t, t.addr, HEALTH, CORRUPT), S.UNKNOWN,
         ("Error parsing message with type 'grpc.health.v1.HealthCheckRequest'",)),
    Case("garbage_health_prefill", lambda t: raw_unary(t, t.prefill_addr, HEALTH, CORRUPT), S.UNKNOWN,
         ("Error parsing message with type 'grpc.health.v1.HealthCheckRequest'",)),
    Case("oversize_bytes_generate", lambda t: raw_stream(t, t.addr, GENERATE, b"\0" * (MSG_LIMIT + 1)),
         S.RESOURCE_EXHAUSTED, (f"larger than max ({MSG_LIMIT + 1} vs. {MSG_LIMIT})",)),
    Case("oversize_prompt_generate", lambda t: call_generate(t, gen_request([-1] * 7000)), S.RESOURCE_EXHAUSTED,
         (f"vs. {MSG_LIMIT})",)),
    Case("oversize_bytes_prefill", lambda t: raw_unary(t, t.prefill_addr, PREFILL, b"\0" * (MSG_LIMIT * 2)),
         S.RESOURCE_EXHAUSTED, (f"vs. {MSG_LIMIT})",)),
    Case("prefill_request_id_zero", lambda t: call_prefill(t, pb.PrefillRequest(request_id=0, token_ids=[1])),
         S.INVALID_ARGUMENT, ("request_id 0 is reserved for the warm-up",)),
    Case("prefill_request_id_over_int64",
         lambda t: call_prefill(t, pb.PrefillRequest(request_id=2**64 - 1, token_ids=[1])), S.INVALID_ARGUMENT,
         ("is over 2**63-1",)),
    Case("prefill_request_id_unexpected", unexpected_frame, S.OK, ("is waiting (cancelled or unknown)",)),
    Case("prefill_empty_prompt", lambda t: call_prefill(t, pb.PrefillRequest(request_id=5, token_ids=[])),
         S.INVALID_ARGUMENT, ("empty prompt",)),
    Case("prefill_token_outside_vocab",
         lambda t: call_prefill(t, pb.PrefillRequest(request_id=5, token_ids=[3, 99999])), S.INVALID_ARGUMENT,
         ("token id 99999 outside the vocabulary",)),
    Case("prefill_prompt_over_model_context",
         lambda t: call_prefill(t, pb.PrefillRequest(request_id=5, token_ids=ids(5000))), S.INVALID_ARGUMENT,
         ("the model's context is 4096 tokens",)),
    Case("prefill_mode_colocated",
         lambda t: call_prefill(t, pb.PrefillRequest(request_id=5, token_ids=[3], mode=pb.MODE_COLOCATED)),
         S.INVALID_ARGUMENT, ("cannot be prefilled remotely",)),
    Case("handshake_other_weights",
         lambda t: call_handshake(t, pb.HandshakeRequest(compat=compat_with(t, weights_fingerprint="0" * 16),
                                                         transport=pb.TRANSPORT_GLOO)),
         S.FAILED_PRECONDITION, ("weights_fingerprint: here",)),
    Case("handshake_other_geometry",
         lambda t: call_handshake(t, pb.HandshakeRequest(compat=compat_with(t, num_layers=5, kv_heads=4),
                                                         transport=pb.TRANSPORT_GLOO)),
         S.FAILED_PRECONDITION, ("num_layers: here 4, peer 5",)),
    Case("handshake_other_dtype",
         lambda t: call_handshake(t, pb.HandshakeRequest(compat=compat_with(t, dtype="bfloat16"), transport=pb.TRANSPORT_GLOO)),
         S.FAILED_PRECONDITION, ("dtype: here 'float32', peer 'bfloat16'",)),
    Case("handshake_missing_compat", lambda t: call_handshake(t, pb.HandshakeRequest(transport=pb.TRANSPORT_GLOO)),
         S.FAILED_PRECONDITION, ("protocol_version: here 2, peer 0",)),
    Case("handshake_other_transport",
         lambda t: call_handshake(t, pb.HandshakeRequest(compat=t.compat, transport=pb.TRANSPORT_NCCL)),
         S.FAILED_PRECONDITION, ("transport: here 'gloo', peer 'nccl'",)),
    Case("deadline_tiny", lambda t: call_generate(t, gen_request(ids(3), 50), timeout=0.001), S.DEADLINE_EXCEEDED,
         ("Deadline Exceeded",)),
]

TIGHT = [
    Case("over_max_receive_bytes", lambda t: call_generate(t, gen_request(ids(49))), S.RESOURCE_EXHAUSTED,
         ("a 49-token cache is 50176 bytes, over this server's --max-receive-bytes 49152",)),
    Case("prefill_over_peer_receive_bytes",
         lambda t: call_prefill(t, pb.PrefillRequest(request_id=9, token_ids=ids(49))), S.RESOURCE_EXHAUSTED,
         ("the decode peer accepts at most 49152 (its --max-receive-bytes)",)),
    Case("too_many_inflight",
         lambda t: slow_then(t, lambda ch: pbg.DecodeStub(ch).Generate(gen_request(ids(3)), timeout=10).read()),
         S.RESOURCE_EXHAUSTED, ("1 requests in flight (limit 1, --max-inflight)",), slot_wait_s=10),
    Case("deadline_mid_stream", lambda t: call_generate(t, gen_request(ids(3), 3000), timeout=0.5),
         S.DEADLINE_EXCEEDED, ("Deadline Exceeded", "before the deadline"), slot_wait_s=10),
    Case("client_cancels_mid_stream", cancel_mid_stream, S.CANCELLED, ("Locally cancelled",), slot_wait_s=10),
]


@pytest.fixture(scope="module")
def compat(tiny_fp32) -> pb.Compat:
    return local_compat(ModelSpec("tiny"), tiny_fp32, CacheGeometry.from_config(tiny_fp32.config, torch.float32),
                        False)


ACCEPTED = re.compile(r"handshake from decode instance \w+: pairing epoch \d+")  # prefill_server/pairing.py


def accepted_handshakes(prefill_log: str) -> int:
    """How many handshakes the prefill server accepted (each starts a pairing); the whole log, not a tail."""
    with open(prefill_log) as f:
        return len(ACCEPTED.findall(f.read()))


class Servers:
    """One pair for the cases of a configuration, until a case fails: the next case then gets a fresh pair."""

    def __init__(self, tmp_path_factory, compat: pb.Compat, name: str, **pair_args):
        self.tmp_path_factory, self.compat, self.name, self.pair_args = tmp_path_factory, compat, name, pair_args
        self.target: Target | None = None
        self.run = None  # the pair's Running (its processes)
        self.prefill_log, self.pairings = "", 0
        self._stack: ExitStack | None = None

    def get(self) -> Target:
        if self.target is None:
            with ExitStack() as stack:
                run = stack.enter_context(server_pair(self.tmp_path_factory.mktemp(self.name), **self.pair_args))
                self.prefill_log = run.logs[0]
                self.pairings = accepted_handshakes(self.prefill_log)
                assert self.pairings >= 1, \
                    f"the pairing is not in the prefill log as {ACCEPTED.pattern!r}:\n{run.log_text()}"
                self.target = Target(run.addr, run.prefill_addr, self.compat, log_text=run.log_text)
                self.run = run
                self._stack = stack.pop_all()
        return self.target

    def discard(self) -> None:
        stack, self._stack, self.target, self.run = self._stack, None, None, None
        if stack is not None:
            stack.close()

    def same_pairing(self, what: str) -> None:
        now = accepted_handshakes(self.prefill_log)
        assert now == self.pairings, (f"{what}: the prefill server accepted {now - self.pairings} handshake(s), "
                                      f"each a new pairing\n{self.target.log_text()}")

    @contextmanager
    def case(self, what: str):
        """One case on this pair, which must keep its pairing; a case that fails in any way discards the pair."""
        try:
            yield self.get()
            self.same_pairing(what)
        except BaseException:
            self.discard()
            raise


@pytest.fixture(scope="module")
def main_servers(tmp_path_factory, compat):
    limits = ["--max-message-bytes", str(MSG_LIMIT), "--max-prompt-tokens", "5000"]
    servers = Servers(tmp_path_factory, compat, "main", prefill_args=limits,
                      decode_args=[*limits, "--max-new-tokens", "1000"])
    yield servers
    servers.discard()


@pytest.fixture(scope="module")
def tight_servers(tmp_path_factory, compat):
    servers = Servers(tmp_path_factory, compat, "tight", prefill_args=["--warmup-tokens", "16"],
                      decode_args=["--max-inflight", "1", "--max-receive-bytes", str(RECEIVE_LIMIT)])
    yield servers
    servers.discard()


@pytest.fixture
def main(main_servers) -> Servers:
    main_servers.get()  # a fresh pair after a failed case starts here, in set-up
    return main_servers


@pytest.fixture
def tight(tight_servers) -> Servers:
    tight_servers.get()
    return tight_servers


def check(case: Case, servers: Servers) -> None:
    with servers.case(case.name) as t:
        code, details = asyncio.run(outcome(case, t))
        servers.same_pairing(case.name)
        assert code == case.code, f"{case.name}: {code} {details!r}"
        assert any(w in details for w in case.words), f"{case.name}: {details!r} names none of {case.words}"
        assert len(good_request(t, case.slot_wait_s)["tokens"]) == 2, case.name


@pytest.mark.parametrize("case", MAIN, ids=lambda c: c.name)
def test_main(main, case):
    check(case, main)


@pytest.mark.parametrize("case", TIGHT, ids=lambda c: c.name)
def test_tight(tight, case):
    check(case, tight)


def test_catalogue_is_documented():
    assert not undocumented(MAIN + TIGHT), "docs/errors.md lacks rows for these cases"


def test_prefill_death_turns_decode_not_serving(main_servers):
    """A dead peer breaks the data plane: probes see NOT_SERVING, requests get UNAVAILABLE, nothing hangs.

    On the `main` pair once its cases are done (each pair start is ~10 s of a CI core per server): this ends it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    t = main_servers.get()
    run = main_servers.run
    try:
        assert len(good_request(t)["tokens"]) == 2
        run.procs[0].kill()
        run.procs[0].wait(timeout=10)
        with grpc.insecure_channel(run.addr) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            status = None
            for _ in range(100):
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.1)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING, run.log_text()
        code, details = asyncio.run(outcome(Case("dead", lambda t: call_generate(t, gen_request([1, 2])),
                                                 S.UNAVAILABLE, ()), t))
        assert code == S.UNAVAILABLE and "prefill worker" in details, details
    finally:
        main_servers.discard()
