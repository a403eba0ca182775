"""Cases a mutation pass over request and flag validation and admission found untested: the handshake's compat
compare (kvtransfer/rpc/compat.py), the flag checks (flagchecks.py, configargs.py), the shared request limits
(limits.py), TLS/token flags and the bind warning (security.py), the decode server's request checks
(decode_server/validate.py), its admission queue (admission.py), the KV pool's sizing (sizing.py) and the prefill
worker's layer-wise/bulk policy (prefill_server/policy.py). Each test here failed on a one-line change of that code
that the rest of the suite (test_bad_inputs.py, test_validate.py, test_security.py, test_defaults.py,
test_admission_units.py, test_operability.py, ...) let through; its docstring names the change it kills.

Why in process, without servers: every case is one function's answer at a boundary (a port of 65535, a prompt of
exactly the limit, a cache of exactly the receive limit, a pool of exactly two tokens a row), which a real server
reaches only through a request built for it and a start that costs seconds of a shared core; here each is a call,
the same way every time. The token interceptor and the admission queue run in an event loop of their own, with no
timers (the queue's periodic re-check is pushed out of reach, as in test_admission_units.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from decode_server import admission, sizing
from decode_server.admission import AdmissionQueue
from decode_server.config import DecodeConfig
from decode_server.sizing import (
    CPU_SEQ,
    CPU_SLOTS,
    GIB,
    WORKSPACE,
    Memory,
    check_max_seq_len,
    plan_blocks,
    plan_engine,
    plan_pool,
    workspace_bytes,
)
from decode_server.validate import request_problem
from kvtransfer.engine.pool import KVPool
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.spec import ModelSpec, preset_config
from kvtransfer.rpc.compat import local_compat, mismatch, relayed
from kvtransfer.rpc.configargs import one_line
from kvtransfer.rpc.flagchecks import check_device, check_dist_init, check_positive, check_seconds, split_address
from kvtransfer.rpc.limits import (
    GRPC_MESSAGE_MAX,
    MAX_REQUEST_ID,
    check_message_limit,
    request_id_problem,
    sampling_problem,
)
from kvtransfer.rpc.security import TokenInterceptor, bind, check_tls_flags, check_token_flags, resolve_token
from prefill_server import policy
from prefill_server.config import PrefillConfig
from proto import kvtransfer_pb2 as pb

GUARD_S = 10  # turns an admission wake-up that never comes into a failure; nothing waits on the clock otherwise


# --- the handshake's compat compare (kvtransfer/rpc/compat.py) ---


def _compat(**changed) -> pb.Compat:
    base = dict(model="tiny", dtype="float32", weights_fingerprint="w1", geometry_digest="g1", num_layers=4,
                kv_heads=2, head_dim=16, layout="l2bhsd", protocol_version=2)
    return pb.Compat(**{**base, **changed})


def test_another_layout_folds_the_geometry_digest_it_changes():
    """Caught: "layout" dropped from DERIVED["geometry_digest"] (another kvtransfer version's layout changes the
    geometry digest too; the refusal then showed both digests as a second root cause beside the layout)."""
    text = mismatch(_compat(), _compat(layout="l2hbsd", geometry_digest="g2"))
    assert "layout: here 'l2bhsd', peer 'l2hbsd'" in text, text
    assert "'g1'" not in text and "geometry_digest differ with it" in text, text
    assert text.count("the same kvtransfer version") == 1, text


def test_the_batch_invariant_flag_reaches_the_compat_the_handshake_compares(tiny_fp32):
    """Caught: local_compat built with batch_invariant=False whatever it was given (mismatch compares the field, but
    no worker would ever announce True: a pair that disagrees on --batch-invariant was accepted)."""
    geometry = CacheGeometry.from_config(tiny_fp32.config, torch.float32)
    on = local_compat(ModelSpec("tiny"), tiny_fp32, geometry, False, batch_invariant=True)
    off = local_compat(ModelSpec("tiny"), tiny_fp32, geometry, False, batch_invariant=False)
    assert on.batch_invariant and not off.batch_invariant
    assert "--batch-invariant on both or neither" in mismatch(on, off)


def test_a_relayed_refusal_names_both_sides_of_numbers_and_bools():
    """Caught: `-?` dropped from relayed's number pattern (a difference in a signed value was left worded from the
    prefill worker's side, its "here" read by the decode worker as itself). Numbers and bools are relayed as strings
    are: the listener's own value first."""
    text = relayed("peer is incompatible (num_layers: here 4, peer 5; batch_invariant: here True, peer False; "
                   "offset: here -1, peer 2). Start both workers with ...")
    assert "num_layers: this decode worker 5, prefill worker 4" in text, text
    assert "batch_invariant: this decode worker False, prefill worker True" in text, text
    assert "offset: this decode worker 2, prefill worker -1" in text, text
    assert "here" not in text and text.startswith("incompatible ("), text


# --- flag forms (kvtransfer/rpc/flagchecks.py) ---


def test_every_port_of_the_range_is_taken_and_port_zero_only_where_allowed():
    """Caught: `<= 65535` made `< 65535` (port 65535 refused), and `allow_port_zero` ignored (--prefill-addr and a
    tcp:// rendezvous given port 0, which no peer listens on, were accepted)."""
    assert split_address("--listen", "127.0.0.1:65535") == ("127.0.0.1", 65535)
    assert split_address("--listen", "127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_address("--prefill-addr", "h:1", allow_port_zero=False) == ("h", 1)
    with pytest.raises(ValueError, match="outside 1..65535"):
        split_address("--prefill-addr", "127.0.0.1:0", allow_port_zero=False)
    with pytest.raises(ValueError, match="--prefill-addr"):
        DecodeConfig(prefill_addr="127.0.0.1:0")
    with pytest.raises(ValueError, match="--dist-init"):
        check_dist_init("--dist-init", "tcp://127.0.0.1:0")
    check_dist_init("--dist-init", "tcp://127.0.0.1:29500?timeout=5")


def test_an_ipv6_address_is_bracketed_and_checked():
    """Caught: rpartition made partition (every IPv6 address was cut at its first colon and refused), and the
    IPv6Address check dropped (`[zz]:1` was taken as a host)."""
    assert split_address("--listen", "[::1]:50051") == ("::1", 50051)
    assert split_address("--listen", "[fe80::1]:0") == ("fe80::1", 0)
    with pytest.raises(ValueError, match="is not an IPv6 address"):
        split_address("--listen", "[zz]:1")


def test_a_file_rendezvous_names_a_path_and_a_device_an_index():
    """Caught: the path required after file:// dropped (`file://` alone was accepted and failed only at the
    rendezvous), and cuda:N's `\\d+` made `\\d*` (`cuda:` was accepted)."""
    check_dist_init("--dist-init", "file:///tmp/rendezvous")
    with pytest.raises(ValueError, match="--dist-init"):
        check_dist_init("--dist-init", "file://")
    check_device("--device", "cuda:1")
    with pytest.raises(ValueError, match="--device"):
        check_device("--device", "cuda:")


def test_check_positive_refuses_zero_and_nan_and_bounds_its_times():
    """Caught: `not v > 0` made `v < 0` (0 and nan passed: --affinity-max-keys 0, --max-body-bytes 0), and
    check_positive no longer bounding a time by MAX_SECONDS."""
    for v in (0, 0.0, -1, float("nan")):
        with pytest.raises(ValueError, match="--max-body-bytes"):
            check_positive(SimpleNamespace(max_body_bytes=v), "max_body_bytes")
    for v in (float("inf"), 1e10):
        with pytest.raises(ValueError, match="--request-timeout-s"):
            check_positive(SimpleNamespace(request_timeout_s=v), "request_timeout_s")
    check_positive(SimpleNamespace(request_timeout_s=1e7, max_body_bytes=1), "request_timeout_s", "max_body_bytes")
    check_seconds(SimpleNamespace(shutdown_grace_s=0.0), "shutdown_grace_s")


# --- configs (kvtransfer/rpc/configargs.py) ---


def test_every_secret_is_redacted_in_the_start_line():
    """Caught: the redaction matching `auth_token` only by its whole name (--prefill-auth-token's value, the decode
    server's secret for its peer, reached the start-up log)."""
    line = one_line(DecodeConfig(auth_token="front-secret", prefill_auth_token="peer-secret"))
    assert "front-secret" not in line and "peer-secret" not in line, line
    assert "auth_token=<set>" in line and "prefill_auth_token=<set>" in line, line
    assert "prefill_auth_token_file= " in line  # a file name is no secret (empty here)


def test_a_config_built_without_argparse_still_refuses_a_value_outside_its_choices():
    """Caught: check_choices never refusing (argparse refuses on the command line, but a config built in code,
    not from the command line, took `--gemv fastest` and `--log-level LOUD`)."""
    with pytest.raises(ValueError, match="--gemv 'fastest': choose one of"):
        DecodeConfig(colocated=True, gemv="fastest")
    with pytest.raises(ValueError, match="--log-level"):
        PrefillConfig(log_level="LOUD")


# --- request limits shared by both servers (kvtransfer/rpc/limits.py) ---


def test_the_edges_of_the_sampling_values_and_request_ids():
    """Caught: top_p's `<= 1` made `< 1` (1, the documented "no nucleus cut", refused), stop ids' `0 <=` made
    `0 <` (token 0 refused as a stop id), and `rid > MAX_REQUEST_ID` made `>=` (2**63-1, the largest id the frame
    carries, refused)."""
    assert sampling_problem(1.0, 1.0, 0) is None
    assert sampling_problem(0.0, None, 5, [0, 511], 512) is None
    assert "top_p is 1.5" in sampling_problem(1.0, 1.5, 0)
    assert "stop_token_ids: 512" in sampling_problem(0.0, None, 0, [0, 512], 512)
    assert request_id_problem(MAX_REQUEST_ID, 0) is None
    assert "over 2**63-1" in request_id_problem(MAX_REQUEST_ID + 1, 0)
    assert "reserved" in request_id_problem(0, 0)


def test_the_message_limit_is_at_least_what_a_longest_prompt_needs_and_at_most_grpcs():
    """Caught: `max_message_bytes < need` made `<=` (exactly 10 x --max-prompt-tokens + 1024, the minimum
    docs/errors.md gives, refused) and gRPC's bound off by one (2**31-1 is the largest C int gRPC takes)."""
    check_message_limit(100 * 10 + 1024, 100)
    with pytest.raises(ValueError, match="use at least 2024"):
        check_message_limit(100 * 10 + 1023, 100)
    check_message_limit(GRPC_MESSAGE_MAX, 0)
    with pytest.raises(ValueError, match="gRPC's limit"):
        check_message_limit(GRPC_MESSAGE_MAX + 1, 0)


# --- TLS, tokens and the bind warning (kvtransfer/rpc/security.py) ---


def test_a_key_without_a_certificate_is_refused_and_a_directory_is_no_file(tmp_path):
    """Caught: `bool(cert) != bool(key)` made `cert and not key` (a --tls-key alone started a plaintext server the
    operator believed to be TLS), and isfile made exists (a directory named as the certificate was accepted)."""
    key = tmp_path / "server.key"
    key.write_text("k")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        check_tls_flags("tls", "", str(key), "", server=True)
    with pytest.raises(ValueError, match="--tls-cert .*no such file"):
        check_tls_flags("tls", str(tmp_path), str(key), "", server=True)


def test_an_inline_token_with_blanks_or_controls_is_refused():
    """Caught: the printable check dropped (a token with a trailing blank or a newline cannot be sent as gRPC
    metadata: every call then fails, or matches no client that strips it)."""
    for bad in ("secret ", " secret", "sec\nret", "sec\x00ret"):
        with pytest.raises(ValueError, match="printable without surrounding blanks"):
            check_token_flags("auth", bad, "")
    check_token_flags("auth", "s3cret-token", "")


def test_a_token_file_gives_its_first_line(tmp_path):
    """The bug this pass found: resolve_token said "the file's first line" (and every --*-token-file flag's help,
    "first line") but returned the whole file, stripped. A token file with a second line (a comment, a rotated
    key) gave a token with a newline in it: no gRPC client can send that (each call failed in gRPC's C core with
    "Illegal header value"), so nobody could call the server. Also caught: the strip dropped (a file's final
    newline became part of the token)."""
    one = tmp_path / "one"
    one.write_text("s3cret\n")
    assert resolve_token("", str(one)) == "s3cret"
    two = tmp_path / "two"
    two.write_text("s3cret\r\nrotated-next\n")
    assert resolve_token("", str(two)) == "s3cret"
    assert resolve_token("inline", "") == "inline"


class _Server:
    """grpc.aio.Server's two bind calls, recorded."""

    def __init__(self):
        self.ports = []

    def add_insecure_port(self, address):
        self.ports.append(("insecure", address))
        return 1

    def add_secure_port(self, address, creds):
        self.ports.append(("secure", address))
        return 1


@pytest.mark.parametrize("address, tls, token, warned", [
    ("127.0.0.1:1", False, "", False),
    ("localhost:1", False, "", False),
    ("[::1]:1", False, "", False),
    ("0.0.0.0:1", False, "", "TLS and a token"),
    ("10.0.0.5:1", True, "", "a token"),
    ("10.0.0.5:1", False, "t", "TLS"),
    ("10.0.0.5:1", True, "t", False),
])
def test_only_a_non_loopback_listener_without_tls_and_a_token_is_warned_about(caplog, address, tls, token, warned):
    """docs/security.md: "a server that listens elsewhere without TLS and a token logs a warning at start".
    Caught: `not _loopback` made `_loopback` (the warning on loopback, none on 0.0.0.0), `creds is None or not
    token` made `and` (TLS without a token, or a token in clear text, unwarned), and "localhost" no longer loopback."""
    server = _Server()
    with caplog.at_level(logging.WARNING, logger="kvtransfer.rpc.security"):
        assert bind(server, address, object() if tls else None, token) == 1
    assert server.ports == [("secure" if tls else "insecure", address)]
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtransfer.rpc.security"]
    if not warned:
        assert not lines, lines
    else:
        assert len(lines) == 1 and f"without {warned}:" in lines[0], lines


def test_the_servers_listen_on_loopback_unless_told_otherwise():
    """docs/security.md: "both servers bind to 127.0.0.1 unless --listen names another address" (and /metrics,
    and the decode server's data plane). Caught: any of these defaults made 0.0.0.0 (tests/test_loopback.py's
    launch passes --listen itself, and no other test starts a server on its defaults)."""
    for config in (DecodeConfig(), PrefillConfig()):
        assert config.listen.startswith("127.0.0.1:") and config.metrics_addr == "127.0.0.1", config
    assert DecodeConfig().data_listen.startswith("127.0.0.1:")


def _intercept(interceptor: TokenInterceptor, method: str, metadata, handler):
    async def continuation(details):
        return handler

    details = SimpleNamespace(method=method, invocation_metadata=metadata)
    return asyncio.run(interceptor.intercept_service(continuation, details))


def test_the_token_interceptor_leaves_unknown_methods_and_all_of_health_as_they_are():
    """Caught: the `handler is None` pass-through dropped (a call of an unknown method without the token raised in
    the interceptor instead of answering UNIMPLEMENTED), and the open prefix narrowed to Health/Check (a probe's
    Watch then needed the token; docs/security.md: "The gRPC health service stays open")."""
    guard = TokenInterceptor("t")
    assert _intercept(guard, "/kvtransfer.v1.Decode/Nope", (), None) is None
    watch = grpc.unary_stream_rpc_method_handler(lambda r, c: iter(()))
    assert _intercept(guard, "/grpc.health.v1.Health/Watch", (), watch) is watch
    generate = grpc.unary_stream_rpc_method_handler(lambda r, c: iter(()))
    assert _intercept(guard, "/kvtransfer.v1.Decode/Generate", (("authorization", "Bearer t"),), generate) is generate
    refused = _intercept(guard, "/kvtransfer.v1.Decode/Generate", (("authorization", "Bearer u"),), generate)
    assert refused is not generate and refused.response_streaming and not refused.request_streaming


# --- the decode server's request checks (decode_server/validate.py) ---

BYTES_PER_TOKEN = 1024
PREFILL_AT = "10.0.0.2:50061"


def _problem(n: int, new: int = 1, mode: int = pb.MODE_AUTO, *, colocated: bool = False, peer_limit: int = 0,
             peers: bool = True, max_receive_tokens: int = 1000, context: int = 4096, slot: int = 4096):
    """request_problem for an n-token prompt asking `new` tokens, against a model of `context` tokens, a KV slot of
    `slot`, prefill peers that announced `peer_limit` (0: none yet) and a receive limit of `max_receive_tokens`."""
    config = SimpleNamespace(max_new_tokens=100, max_prompt_tokens=2000, colocated=colocated,
                             max_receive_bytes=max_receive_tokens * BYTES_PER_TOKEN)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
    geometry = SimpleNamespace(cache_bytes=lambda tokens: tokens * BYTES_PER_TOKEN)
    engine = SimpleNamespace(m=SimpleNamespace(model=model, geometry=geometry), pool=SimpleNamespace(max_seq=slot))
    prefill = SimpleNamespace(prompt_limit=lambda: (peer_limit, PREFILL_AT) if peer_limit else (0, "")) if peers \
        else None
    request = pb.GenerateRequest(token_ids=[(7 * i + 3) % 512 for i in range(n)], max_new_tokens=new, mode=mode)
    return request_problem(request, config, engine, 512, prefill)


def test_a_prompt_of_exactly_the_prefill_workers_limit_is_sent_and_one_more_refused():
    """Caught: `n > limit` made `>=` (a prompt of exactly the --max-prompt-tokens the prefill worker announced,
    which that worker accepts, refused by the decode worker)."""
    assert _problem(200, peer_limit=200) is None
    code, message = _problem(201, peer_limit=200)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert f"the prefill worker at {PREFILL_AT} accepts at most 200" in message and "--max-prompt-tokens" in message
    assert _problem(201, peer_limit=200, mode=pb.MODE_COLOCATED) is None  # prefilled here: that limit is not its


def test_a_cache_of_exactly_the_receive_limit_is_taken_and_one_token_more_refused():
    """Caught: `size > --max-receive-bytes` made `>=` (a cache of exactly the limit, which the data plane takes,
    refused RESOURCE_EXHAUSTED)."""
    assert _problem(48, max_receive_tokens=48) is None
    code, message = _problem(49, max_receive_tokens=48)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, message
    assert f"a 49-token cache is {49 * BYTES_PER_TOKEN} bytes" in message and "--max-receive-bytes" in message


def test_a_disaggregated_request_without_a_prefill_peer_is_a_failed_precondition():
    """Caught: "no prefill peer configured" ending INVALID_ARGUMENT (docs/errors.md: INVALID_ARGUMENT is "the
    request itself is wrong": retrying it unchanged fails the same way; here the server is, and a colocated request
    to it is served)."""
    code, message = _problem(3, peers=False)
    assert (code, message) == (grpc.StatusCode.FAILED_PRECONDITION, "no prefill peer configured")
    assert _problem(3, peers=False, mode=pb.MODE_COLOCATED) is None
    assert _problem(3, peers=False, colocated=True) is None


def test_a_request_may_not_ask_for_the_mode_that_is_only_reported():
    """Caught: MODE_RECOMPUTE added to the modes a request may ask for (4: what a Timing reports when the decode
    worker prefilled itself after its peer failed; test_bad_inputs.py's `unknown_mode` sends 7 only)."""
    code, message = _problem(3, mode=pb.MODE_RECOMPUTE)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("unknown mode 4"), message
    for mode in (pb.MODE_AUTO, pb.MODE_LAYERWISE, pb.MODE_BULK, pb.MODE_COLOCATED):
        assert _problem(3, mode=mode) is None


# --- the admission queue (decode_server/admission.py) ---


@pytest.fixture
def no_polling(monkeypatch):
    monkeypatch.setattr(admission, "ADMISSION_RECHECK_S", 60.0)


def _pool(slots: int) -> KVPool:
    return KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=slots, max_seq=4)


async def _until(cond) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_a_deadline_that_passes_before_admission_wait_s_is_a_deadline_exceeded_naming_whos_ahead(no_polling):
    """Caught: _gave_up's `perf_counter() < deadline` dropped (with --admission-wait-s set, a request whose own
    deadline came first was told RESOURCE_EXHAUSTED, "retry later", where docs/errors.md says DEADLINE_EXCEEDED),
    and "N requests were ahead of it" counting the whole queue, the request itself and those behind it included.
    The deadline is already past when the request arrives: it tries once, finds the pool full and leaves."""
    pool = _pool(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8, wait_s=3600)
        held = pool.try_lease()
        far = time.perf_counter() + 3600
        ahead = asyncio.create_task(q.acquire(far))
        await _until(lambda: q.waiting == 1)
        with pytest.raises(admission.RequestError) as late:
            await asyncio.wait_for(q.acquire(time.perf_counter() - 1), GUARD_S)
        assert q.waiting == 1
        held.release()
        (await asyncio.wait_for(ahead, GUARD_S)).release()
        q.close()
        return late.value
    err = asyncio.run(scenario())
    assert err.code is grpc.StatusCode.DEADLINE_EXCEEDED, err.message
    assert "1 requests were ahead of it" in err.message, err.message


# --- the KV pool's size (decode_server/sizing.py) ---

QWEN = preset_config("qwen2.5-7b")
QWEN_BPT = 28 * 2 * 4 * 128 * 2  # layers x K|V x kv heads x head dim x bf16


def test_the_workspace_holds_a_prefill_in_the_models_dtype_and_each_receive_slot():
    """Caught: workspace_bytes without elem_bytes (a bfloat16 prefill's activations counted as one byte each) and
    without the receive slots (cuda_ipc's slots and the data plane's staging took pool memory twice)."""
    n = 32768
    one = workspace_bytes(QWEN, QWEN_BPT, n, 1, 0)
    two = workspace_bytes(QWEN, QWEN_BPT, n, 2, 0)
    assert two - WORKSPACE == 2 * (one - WORKSPACE) == 2 * n * (6 * QWEN.hidden_size + 3 * QWEN.intermediate_size)
    assert workspace_bytes(QWEN, QWEN_BPT, n, 2, 3) - two == 3 * n * QWEN_BPT


def test_a_paged_pool_of_a_given_size_is_not_cut_to_max_batch_rows():
    """Caught: plan_blocks' `not pool_given` dropped (with --kv-pool-gib given, --max-batch x the context also
    capped the blocks: the pool asked for was not the pool made); without it, --max-batch still bounds the pool."""
    given = plan_blocks(QWEN_BPT, 1024, 64, 2, 0, 1 * GIB, "--kv-pool-gib 1", 128, pool_given=True)
    assert given.blocks == GIB // QWEN_BPT // 64 and given.slots == 2
    fitted = plan_blocks(QWEN_BPT, 1024, 64, 2, 0, 1 * GIB, "0.9 of the GPU", 128)
    assert fitted.blocks == 2 * 1024 // 64


def test_a_block_is_no_longer_than_a_row_and_a_row_no_longer_than_the_pool():
    """Caught: the block's `min(page, --max-seq-len or context)` dropped (blocks of 64 tokens for rows of 40), the
    row's `min(.., blocks x page)` dropped (a context longer than the whole pool announced), and `blocks < 1` made
    `< 0` (a budget under one block made a pool of none)."""
    short = plan_blocks(QWEN_BPT, 4096, 64, 4, 40, 1 * GIB, "--kv-pool-gib 1", 128, pool_given=True)
    assert short.page == 40 and short.max_seq == 40
    small = plan_blocks(QWEN_BPT, 4096, 64, 4, 0, 10 * 64 * QWEN_BPT, "--kv-pool-gib x", 128, pool_given=True)
    assert (small.blocks, small.max_seq) == (10, 640)
    with pytest.raises(ValueError, match="no room for a KV pool"):
        plan_blocks(QWEN_BPT, 4096, 64, 4, 0, 63 * QWEN_BPT, "--kv-pool-gib x", 128, pool_given=True)
    cpu = plan_blocks(512, 8192, 64, 0, 0, 0, "", 128)
    assert (cpu.slots, cpu.max_seq, cpu.blocks) == (CPU_SLOTS, CPU_SEQ, CPU_SLOTS * CPU_SEQ // 64)


def test_fixed_slots_leave_the_workspace_free_and_hold_two_tokens_a_row():
    """Caught: --max-batch x --max-seq-len checked against all free memory, not what WORKSPACE leaves (a pool that
    left no room for CUDA graphs and cuBLAS was accepted), and `tokens < 2 x rows` made `tokens < rows` (rows of one
    token: a prompt token and no room to generate)."""
    memory = Memory(total=80 * GIB, free=10 * GIB, ours=0)
    fits = (10 * GIB - WORKSPACE) // QWEN_BPT
    assert plan_pool(QWEN_BPT, 1 << 20, 1, fits, 0, 0.9, memory, 0, 128).max_seq == fits
    with pytest.raises(ValueError, match="--max-batch 1 x --max-seq-len"):
        plan_pool(QWEN_BPT, 1 << 20, 1, fits + 1, 0, 0.9, memory, 0, 128)
    assert plan_pool(1, 4096, 8, 0, 16 / GIB, 0.9, None, 0, 128).max_seq == 2
    with pytest.raises(ValueError, match="no room for a KV pool"):
        plan_pool(1, 4096, 8, 0, 15 / GIB, 0.9, None, 0, 128)


def test_mixed_steps_on_cuda_leave_two_rows_of_a_step_per_decoding_row(tiny_fp32, monkeypatch):
    """Caught: the auto row cap `min(256, chunk // 2)` made `min(256, chunk)` (with --mixed-prefill
    --prefill-chunk 128 on CUDA, 128 rows decoding: a full batch leaves no row of the step for prompt tokens, and
    the engine refuses the plan). The default chunk of 512 cannot tell: 512 // 2 is the cap of 256 already."""
    monkeypatch.setattr(sizing, "device_memory", lambda device: Memory(total=80 * GIB, free=70 * GIB, ours=GIB))
    cuda = LoadedModel(ModelSpec("tiny", "float32"), tiny_fp32,
                       CacheGeometry.from_config(tiny_fp32.config, torch.float32), torch.device("cuda", 0))
    options, _ = plan_engine(DecodeConfig(colocated=True, mixed_prefill=True, prefill_chunk=128), cuda, 0)
    assert (options.prefill_chunk, options.mixed_prefill, options.max_batch) == (128, True, 64)


def test_max_seq_len_of_exactly_the_models_context_is_taken():
    """Caught: `max_seq_len > context` made `>=` (--max-seq-len 4096 on a 4096-token model, the largest it can
    use, refused at start)."""
    check_max_seq_len(4096, 4096)
    with pytest.raises(ValueError, match="--max-seq-len 4097 is over the model's context of 4096"):
        check_max_seq_len(4097, 4096)


# --- layer-wise or bulk (prefill_server/policy.py) ---


def test_a_prompt_of_exactly_the_threshold_streams_layer_by_layer():
    """Caught: `>=` made `>` (a prompt of exactly --layerwise-min-tokens, "prompts at least this long stream",
    went bulk), the override's `>= 0` made `> 0` (--layerwise-min-tokens 0, every prompt layer-wise, fell back to
    the table), and an unmeasured transport defaulting to the gloo/grpc threshold (the table's rule: bulk until
    measured)."""
    assert policy.choose("grpc", -1, 2048) == "layerwise" and policy.choose("grpc", -1, 2047) == "bulk"
    assert policy.choose("grpc", 100, 100) == "layerwise" and policy.choose("grpc", 100, 99) == "bulk"
    assert policy.choose("nccl", 0, 1) == "layerwise" and policy.choose("nccl", -1, 1 << 20) == "bulk"
    assert policy.choose("fake", -1, 1 << 20) == "bulk"
