"""Batch invariance of the GEMM and the norms on a GPU (docs/batch-invariance.md; run on the device machine).

Why: the interpreter (tests/test_invariant_interp.py) checks the kernels' tiling and loops, but not that the
compiled tensor-core dot computes every row of a tile by the same operations, nor the norm's compiled reduction;
this checks the bits on the GPU, bf16 on Qwen2.5-7B shapes (hidden 3584: the qkv projection's 4608 outputs and the
MLP's down projection's 18944 inputs). A few rows alone (M = 1) and at the first, middle and last row of batches of
M = 2 .. 512 must be equal bit for bit; against an fp32 computation of the same product, within 1 bf16 ulp plus
the fp32 sums' error bound. cuBLAS's own row-to-batch differences are printed, not asserted (they are why the
mode exists). Run: python3 -m pytest tests/test_invariant_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.kernels import ops as K

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not K.triton_available("cuda"), reason="needs triton"),
]

BATCHES = [2, 3, 7, 8, 63, 64, 129, 200, 256, 512]
SHAPES = [(3584, 4608), (18944, 3584)]  # (K, N): qkv, down


def _places(m: int) -> list[int]:
    return sorted({0, m // 2, m - 1})


def _batches(targets: torch.Tensor, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for m in BATCHES:
        x = torch.randn(m, targets.shape[1], generator=gen, device="cuda").to(targets.dtype)
        places = _places(m)
        x[places] = targets[: len(places)]
        yield m, places, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=["qkv", "down"])
def test_gemm_row_is_the_same_in_any_batch(shape, dtype):
    k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(41)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    targets = torch.randn(3, k, generator=gen, device="cuda").to(dtype)
    alone = torch.cat([K.invariant_linear(t[None], w, bias) for t in targets])  # (3, N)
    gold = targets.double() @ w.double().T + bias.double()
    bound = 2 * (k + 1) * 2.0 ** -24 * (targets.double().abs() @ w.double().abs().T + bias.double().abs())
    if dtype == torch.bfloat16:
        bound += torch.exp2(torch.floor(torch.log2(gold.abs().clamp_min(2.0 ** -30))) - 7)  # 1 ulp
    assert ((alone.double() - gold).abs() <= bound).all()
    alone_ref = torch.cat([torch.nn.functional.linear(t[None], w, bias) for t in targets])  # cuBLAS, M = 1
    cublas_moved = []
    for m, places, x in _batches(targets, seed=42):
        out = K.invariant_linear(x, w, bias)
        assert torch.equal(out[places], alone[: len(places)]), f"M={m}: a row changed with its batch"
        ref = torch.nn.functional.linear(x, w, bias)
        if not torch.equal(ref[places], alone_ref[: len(places)]):
            cublas_moved.append(m)
    print(f"\n{shape} {dtype}: cuBLAS rows differed from themselves alone at M = {cublas_moved}")


def test_gemm_in_a_cuda_graph_gives_the_eager_bits():
    gen = torch.Generator(device="cuda").manual_seed(43)
    w = torch.randn(4608, 3584, generator=gen, device="cuda").to(torch.bfloat16)
    x = torch.randn(64, 3584, generator=gen, device="cuda").to(torch.bfloat16)
    eager = K.invariant_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    K.invariant_linear(x, w)  # compiled before capture
    with torch.cuda.graph(graph):
        out = K.invariant_linear(x, w)
    x.copy_(torch.randn(64, 3584, generator=gen, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, K.invariant_linear(x, w)) and not torch.equal(out, eager)


@pytest.mark.parametrize("hidden", [3584, 8192])
def test_norms_row_is_the_same_in_any_batch(hidden):
    gen = torch.Generator(device="cuda").manual_seed(44)
    w = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
    targets = (torch.randn(3, hidden, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    res_t = torch.randn(3, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    alone = torch.cat([K.rms_norm(t[None], w, 1e-6) for t in targets])
    pairs = [K.add_rms_norm(t[None], r[None], w, 1e-6) for t, r in zip(targets, res_t)]
    for m, places, x in _batches(targets, seed=45):
        j = len(places)
        assert torch.equal(K.rms_norm(x, w, 1e-6)[places], alone[:j]), f"M={m}"
        res = torch.randn(m, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        res[places] = res_t[:j]
        normed, summed = K.add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(normed[places], torch.cat([p[0] for p in pairs[:j]])), f"M={m}"
        assert torch.equal(summed[places], torch.cat([p[1] for p in pairs[:j]])), f"M={m}"
