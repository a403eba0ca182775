"""`--batch-invariant` (issue #40) in real colocated servers on CPU (tiny preset): a request's tokens and every
step's logits digest are the same bits whatever runs beside it.

What is claimed (and tested here), for one request, greedy and seeded:
- alone, beside 7 and beside 63 random neighbours (sent at once with it, so the steps it rides in have other
  sizes and members, prompt chunks of others among them);
- its prompt cut into steps of 32 rows or taken in one step (--prefill-chunk 512, another server);
- its prompt's context found in the prefix cache, or not (skip_prefix_cache);
- colocated, or disaggregated (a pair both of whose workers run the mode; layer-wise and bulk): the prefill worker
  runs the decode step's invariant rows (kvtransfer/engine/invariant_prefill.py);
all give the same tokens and the same logits digests. The same neighbours change the digests on a server without
the mode (the control: the comparisons see a changed sum order; torch's CPU GEMM sums one row otherwise than
several). A pair whose workers disagree on the mode is refused at the handshake. On a GPU, the same claims in bf16
with the Triton kernels: tests/test_batch_invariant_servers_gpu.py (servers) and test_batch_invariant_gpu.py (the
step on qwen2.5-7b shapes).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from decode_server.client import generate, sampling_message
from decode_server.config import DecodeConfig
from kvtransfer.model.prefill import random_prompt
from support.servers import colocated_server, server_pair

VOCAB, NEW = 512, 12
ROWS = ["--max-batch", "16"]
TARGET = random_prompt(VOCAB, 150, seed=40).view(-1).tolist()


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    with colocated_server(tmp_path_factory.mktemp("bi32"), args=["--batch-invariant", "--prefill-chunk", "32", *ROWS],
                          prefix_cache=True) as run:
        yield run


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    with colocated_server(tmp_path_factory.mktemp("bi512"), args=["--batch-invariant", "--prefill-chunk", "512",
                                                                  *ROWS]) as run:
        yield run


def neighbours(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(VOCAB, rng.randint(5, 300), seed=seed * 1000 + i).view(-1).tolist() for i in range(n)]


async def beside(addr: str, n: int, seed: int, sampling=None, skip: bool = True, mode: str = "colocated") -> dict:
    """The target sent with n neighbours at once (itself in the middle of them, in `mode`); its record."""
    others = neighbours(n, seed)
    calls = [generate(addr, ids, NEW + i % 9, "auto", timeout=300) for i, ids in enumerate(others)]
    target = generate(addr, TARGET, NEW, mode, digest=True, timeout=300, sampling=sampling,
                      skip_prefix_cache=skip)
    results = await asyncio.gather(*calls[:n // 2], target, *calls[n // 2:])
    return results[n // 2]


def key(r: dict) -> tuple:
    assert len(r["tokens"]) == NEW and all(r["logits_digests"])
    return r["tokens"], r["logits_digests"]


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
def test_a_request_is_the_same_bits_beside_any_neighbours_chunked_or_whole_cached_or_not(chunked, whole, seed):
    sampling = sampling_message(1.0, 0.9, 0, seed) if seed is not None else None
    alone = key(asyncio.run(beside(chunked.addr, 0, 1, sampling)))
    assert key(asyncio.run(beside(chunked.addr, 7, 2, sampling))) == alone
    assert key(asyncio.run(beside(chunked.addr, 63, 3, sampling))) == alone
    assert key(asyncio.run(beside(whole.addr, 0, 1, sampling))) == alone  # one step for the whole prompt
    assert key(asyncio.run(beside(whole.addr, 7, 4, sampling))) == alone
    asyncio.run(beside(chunked.addr, 0, 1, sampling, skip=False))  # the prompt's context cached
    hit = asyncio.run(beside(chunked.addr, 3, 5, sampling, skip=False))
    assert hit["timing"]["reused_tokens"] > 0 and key(hit) == alone


def test_without_the_mode_the_same_neighbours_change_the_bits(tmp_path):
    """The control: the comparisons above would see a changed order."""
    with colocated_server(tmp_path, args=["--mixed-prefill", "--prefill-chunk", "32", *ROWS]) as plain:
        alone = key(asyncio.run(beside(plain.addr, 0, 1)))
        crowded = [key(asyncio.run(beside(plain.addr, n, s))) for n, s in ((7, 2), (63, 3))]
    assert any(c[1] != alone[1] for c in crowded)


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
def test_a_pair_in_the_mode_gives_the_colocated_bits(chunked, tmp_path, seed):
    sampling = sampling_message(1.0, 0.9, 0, seed) if seed is not None else None
    alone = key(asyncio.run(beside(chunked.addr, 0, 1, sampling)))
    with server_pair(tmp_path, prefill_args=["--batch-invariant"],
                     decode_args=["--batch-invariant", "--prefill-chunk", "32", *ROWS]) as pair:
        for mode in ("layerwise", "bulk"):
            got = asyncio.run(beside(pair.addr, 0, 1, sampling, mode=mode))
            assert got["timing"]["mode"] == mode and key(got) == alone
        assert key(asyncio.run(beside(pair.addr, 7, 2, sampling, mode="bulk"))) == alone


def test_a_pair_that_disagrees_on_the_mode_is_refused(tmp_path):
    with server_pair(tmp_path, decode_args=["--batch-invariant", "--prefill-chunk", "32", *ROWS],
                     wait=False) as run:
        decode = run.procs[1]
        decode.wait(timeout=120)
        assert decode.returncode != 0
        text = run.log_text()
        assert "batch_invariant" in text and "--batch-invariant on both or neither" in text


def test_the_mode_prefills_in_the_steps():
    for bad in ({"exact": True}, {"mixed_prefill": False}):
        with pytest.raises(ValueError, match="--batch-invariant"):
            DecodeConfig(batch_invariant=True, colocated=True, **bad)
    assert DecodeConfig(batch_invariant=True, colocated=True).batch_invariant
    assert DecodeConfig(batch_invariant=True).batch_invariant


def test_the_modes_split_size_is_the_kernels():
    from kvtransfer.kernels import ops
    from kvtransfer.kernels.triton_attention_split import INVARIANT_SPLIT_SIZE
    assert ops.INVARIANT_ATTENTION == {"split_size": INVARIANT_SPLIT_SIZE}


def test_the_invariant_prefill_streams_each_layer_from_its_last_piece(monkeypatch):
    """Layer-wise from the prefill worker: each layer goes out once, in order, during the forward of the prompt's
    last piece, with the bytes the run returns (a prompt of 3 pieces)."""
    from kvtransfer.engine import invariant_prefill
    from kvtransfer.model.loaded import load
    from kvtransfer.model.spec import ModelSpec
    monkeypatch.setattr(invariant_prefill, "ROWS_PER_FORWARD", 64)
    loaded = load(ModelSpec("tiny", "float32"), torch.device("cpu"), False)
    pre = invariant_prefill.InvariantPrefill(loaded, 512)
    ids = torch.tensor([TARGET])  # (1, 150): pieces of 64, 64, 22
    sent = []
    layers, logits = pre.run(ids, on_layer=lambda i, k, v: sent.append((i, k.clone(), v.clone())))
    assert [i for i, _, _ in sent] == list(range(len(layers)))
    assert all(torch.equal(k, layers[i][0]) and torch.equal(v, layers[i][1]) for i, k, v in sent)
    again, logits2 = pre.run(ids)  # without the hook: the same bits
    assert torch.equal(logits, logits2) and all(torch.equal(a[0], k) for a, (_, k, _) in zip(again, sent))
