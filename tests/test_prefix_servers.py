"""The prefix cache through the servers, in real processes (tiny, float32, CPU).

- A pair (gloo, --exact, one slot, no host tier): a conversation's second turn reuses the first turn's slot and is
  prefilled on the decode worker after it (Timing: reused tokens, tier DEVICE, mode colocated); a turn that adds
  more than --local-suffix-max-tokens goes to the prefill worker whole. The same conversation colocated makes the
  same reuse decisions (one slot: each turn claims the last one's) and gives the same tokens, logits digests and
  cache digest, bit for bit: the pair's first-turn cache crossed the link byte for byte (--exact).
- A colocated server (one slot, a small host tier): a conversation pushed out of the pool by another comes back
  from the host tier (tier HOST, its bytes counted), a prompt sharing only its first blocks reuses just those, and
  each equals the same prompt prefilled from scratch (skip_prefix_cache) in its tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from decode_server.client import generate
from kvtransfer.model.prefill import random_prompt
from support.faultkit import scrape, value
from support.servers import colocated_server, free_port, server_pair

pytestmark = pytest.mark.timeout(300)

P1 = random_prompt(512, 70, seed=50)[0].tolist()
NEW = 10


def gen(addr: str, ids: list[int], mode: str = "auto", **kw) -> dict:
    return asyncio.run(generate(addr, ids, NEW, mode, **kw))


def user(n: int, seed: int) -> list[int]:
    return random_prompt(512, n, seed=seed)[0].tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with server_pair(tmp_path_factory.mktemp("prefix-pair"), prefix_cache=True,
                     decode_args=["--exact", "--max-batch", "1", "--local-suffix-max-tokens", "64"]) as run:
        yield run


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    port = free_port()
    with colocated_server(tmp_path_factory.mktemp("prefix-host"), prefix_cache=True,
                          args=["--max-batch", "1", "--host-cache-gib", "0.001", "--metrics-port", str(port)]) as run:
        run.metrics_url = f"http://127.0.0.1:{port}/metrics"
        yield run


def test_the_next_turn_reuses_the_slot_in_the_pair_and_matches_colocated(pair):
    def conversation(mode: str, first_mode: str) -> list[dict]:
        t1 = gen(pair.addr, P1, first_mode, skip_prefix_cache=True, digest=True)
        p2 = P1 + t1["tokens"] + user(20, 51)
        t2 = gen(pair.addr, p2, mode, digest=True, cache_digest=True)
        return [t1, t2, p2]
    a1, a2, p2 = conversation("auto", "auto")
    assert a1["timing"]["mode"] in ("layerwise", "bulk") and a1["timing"]["reused_tokens"] == 0
    assert a2["timing"]["reused_tokens"] == len(P1) + NEW - 1 and a2["timing"]["reuse_tier"] == "device"
    assert a2["timing"]["mode"] == "colocated"  # prefilled here, after the prefix the decode worker holds
    c1, c2, _ = conversation("colocated", "colocated")
    assert c1["logits_digests"] == a1["logits_digests"]  # the first turn crossed the link byte for byte
    assert c2["timing"]["reused_tokens"] == a2["timing"]["reused_tokens"]  # the same reuse decision
    assert (c2["tokens"], c2["logits_digests"], c2["cache_digest"]) == (
        a2["tokens"], a2["logits_digests"], a2["cache_digest"])
    scratch = gen(pair.addr, p2, "auto", skip_prefix_cache=True)
    assert scratch["timing"]["reused_tokens"] == 0 and scratch["tokens"] == a2["tokens"]  # within tolerance


def test_a_long_addition_goes_to_the_prefill_worker_whole(pair):
    t1 = gen(pair.addr, P1, "auto", skip_prefix_cache=True)
    p2 = P1 + t1["tokens"] + user(80, 52)  # 81 tokens to prefill: over --local-suffix-max-tokens 64
    t2 = gen(pair.addr, p2)
    assert t2["timing"]["reused_tokens"] == 0 and t2["timing"]["mode"] in ("layerwise", "bulk")


def test_an_evicted_conversation_comes_back_from_the_host_tier(hosted):
    b1 = gen(hosted.addr, P1)
    other = gen(hosted.addr, user(40, 53))  # takes the one slot: turn 1 of P1 goes to the host tier
    assert other["timing"]["reused_tokens"] == 0
    p2 = P1 + b1["tokens"] + user(12, 54)
    b2 = gen(hosted.addr, p2)
    t = b2["timing"]
    assert (t["reuse_tier"], t["reused_tokens"]) == ("host", len(P1) + NEW - 1)
    assert t["reload_bytes"] == t["reused_tokens"] * 1024  # tiny float32: 1 KiB of KV a token
    assert b2["tokens"] == gen(hosted.addr, p2, skip_prefix_cache=True)["tokens"]
    m = scrape(hosted.metrics_url)
    assert value(m, "kvt_prefix_hits_total", tier="host") >= 1
    assert value(m, "kvt_prefix_host_decisions_total", decision="reload") >= 1
    assert value(m, "kvt_prefix_reload_bytes_total") >= t["reload_bytes"]


def test_a_shared_opening_reuses_only_its_blocks(hosted):
    system = user(40, 55)
    gen(hosted.addr, system + user(30, 56))
    q = system + user(25, 57)
    got = gen(hosted.addr, q)
    assert got["timing"]["reused_tokens"] == 40  # the shared 40 tokens, checked token for token
    assert got["tokens"] == gen(hosted.addr, q, skip_prefix_cache=True)["tokens"]
    m = scrape(hosted.metrics_url)
    assert value(m, "kvt_kv_pool_slots_used") == 0 and value(m, "kvt_prefix_cached_slots") == 1


def test_the_load_report_counts_cached_slots_as_free(hosted):
    import grpc

    from proto import kvtransfer_pb2 as pb
    from proto import kvtransfer_pb2_grpc as pbg
    gen(hosted.addr, user(30, 58))
    with grpc.insecure_channel(hosted.addr) as ch:
        load = pbg.DecodeStub(ch).Load(pb.LoadRequest(), timeout=10)
    assert load.serving and (load.running_requests, load.waiting_requests, load.running_tokens) == (0, 0, 0)
    assert (load.free_slots, load.cached_slots) == (1, 1)  # one slot, holding the last request's context
