"""`--batch-invariant` in real servers on one GPU (issue #40): tests/test_batch_invariant.py's claims in bf16 on CUDA.

The tiny preset in bfloat16 on cuda:0, with the mode's Triton kernels (the fixed-tile GEMM on tensor cores, the
decode attention cut at its fixed split) and CUDA graphs: one request, greedy and seeded, gives the same tokens and
logits digests alone, beside 7 and 63 random neighbours, in steps of 32 rows or in one step, from the prefix cache
or not, and over a pair of processes on this GPU (cuda_ipc; NCCL refuses two ranks on one GPU), layer-wise and bulk.
The control without the mode is the CPU test's (the GEMM there sums one row otherwise than several); the engine
step on qwen2.5-7b shapes is tests/test_batch_invariant_gpu.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_server.client import sampling_message
from support.servers import colocated_server, server_pair
from test_batch_invariant import beside, key

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ON_GPU = ["--device", "cuda:0", "--kv-pool-gib", "1", "--max-batch", "16", "--batch-invariant"]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    with colocated_server(tmp_path_factory.mktemp("bi32"), dtype="bfloat16", prefix_cache=True,
                          args=[*ON_GPU, "--mixed-prefill", "--prefill-chunk", "32"]) as run:
        yield run


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    with colocated_server(tmp_path_factory.mktemp("bi512"), dtype="bfloat16",
                          args=[*ON_GPU, "--prefill-chunk", "512"]) as run:
        yield run


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
def test_on_a_gpu_a_request_is_the_same_bits_beside_any_neighbours(chunked, whole, tmp_path, seed):
    sampling = sampling_message(1.0, 0.9, 0, seed) if seed is not None else None
    alone = key(asyncio.run(beside(chunked.addr, 0, 1, sampling)))
    assert key(asyncio.run(beside(chunked.addr, 7, 2, sampling))) == alone
    assert key(asyncio.run(beside(chunked.addr, 63, 3, sampling))) == alone
    assert key(asyncio.run(beside(whole.addr, 0, 1, sampling))) == alone
    assert key(asyncio.run(beside(whole.addr, 63, 4, sampling))) == alone
    asyncio.run(beside(chunked.addr, 0, 1, sampling, skip=False))  # the prompt's context cached
    hit = asyncio.run(beside(chunked.addr, 3, 5, sampling, skip=False))
    assert hit["timing"]["reused_tokens"] > 0 and key(hit) == alone
    pool = ["--transport", "cuda_ipc", "--device", "cuda:0", "--batch-invariant"]
    with server_pair(tmp_path, dtype="bfloat16", prefill_args=pool,
                     decode_args=[*ON_GPU, "--transport", "cuda_ipc", "--mixed-prefill", "--prefill-chunk", "32"]
                     ) as pair:
        for mode in ("layerwise", "bulk"):
            got = asyncio.run(beside(pair.addr, 0, 1, sampling, mode=mode))
            assert got["timing"]["mode"] == mode and key(got) == alone
        assert key(asyncio.run(beside(pair.addr, 7, 2, sampling, mode="bulk"))) == alone
