"""Batch invariance of the GEMM and the norms under the Triton interpreter (docs/batch-invariance.md).

Why: a batch-invariant mode needs each row's result to be the same bits whatever rows come with it. Here a few
fixed rows are computed alone (M = 1) and then inside batches of M = 7, 63 and 200 random rows, at the batch's
first, middle and last row (so at other places in a row tile, and in another tile at 200), and must come out
equal bit for bit; each is also checked against the torch reference within a stated tolerance. The interpreter
checks the kernels' tiling, loops and masks (what a change of tile by M would break); that a tensor-core dot
treats every row of a tile alike is a property of the GPU, checked by tests/test_invariant_gpu.py. Run with
`TRITON_INTERPRET=1 python -m pytest tests/test_invariant_interp.py`; skipped otherwise, as
tests/test_kernels_interp.py (whose interpreter caveats hold: bf16 conversions truncate).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton interpreter tests", allow_module_level=True)
pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's numpy use

from kvtransfer.kernels import ops as K

BATCHES = [7, 63, 200]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# K 160: two full 64-deep steps and a partial one for 2-byte inputs (five 32-deep ones for fp32); N 200: a full
# and a partial 128-column tile.
IN_F, OUT_F = 160, 200
SIGNIFICAND = {torch.bfloat16: 8, torch.float16: 11}


def _places(m: int) -> list[int]:
    return [0, m // 2, m - 1]


def _in_batches(targets: torch.Tensor, seed: int):
    """(M, x) for each M in BATCHES: M random rows with targets[j] at row _places(M)[j]."""
    gen = torch.Generator().manual_seed(seed)
    for m in BATCHES:
        x = (torch.randn(m, targets.shape[1], generator=gen) * 2).to(targets.dtype)
        x[_places(m)] = targets
        yield m, x


def _check_ref(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b) -> None:
    """The stated tolerance, per element: |out - ref| <= 2 K 2^-24 (|x| @ |w|^T + |b|), the error bound of two fp32
    sums of K + 1 terms in any orders (here they differ only in order), plus, for 2-byte outputs, 1 ulp of the
    reference element in its dtype (2^(exponent - significand + 1): the two sums may round apart, and the
    interpreter truncates to bf16)."""
    r = ref.float()
    err = (out.float() - r).abs()
    mags = x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())
    bound = 2 * (x.shape[1] + 1) * 2.0 ** -24 * mags
    if ref.dtype != torch.float32:
        exp = torch.floor(torch.log2(r.abs().clamp_min(2.0 ** -14)))
        bound += torch.exp2(exp - (SIGNIFICAND[ref.dtype] - 1))
    assert (err <= bound).all(), f"max error {(err / bound).max().item():.2f} x the bound"


def _cancelling(w: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the targets' sums round: products of bf16 values are exact in fp32 and sums of a few hundred randn-sized
    ones mostly exact too, so any order would give the same bits and the test could not see a changed order. Each
    target gets 4096 at k = 3 and at k = 100 (another 64-deep step), and w[:, 100] = -w[:, 3] ~ 1000: two products of
    ~4e6 that cancel, with the small terms between them added at 4e6's fp32 ulp (0.25), and a result of ~2.
    Returns (w, targets) in w's dtype (all values fit fp16)."""
    big = w.float().clone()
    big[:, 3] = (big[:, 3] * 1000).clamp(-30000, 30000)
    big[:, 100] = -big[:, 3]
    targets = targets.clone()
    targets[:, 3] = targets[:, 100] = 4096.0
    return big.to(w.dtype), targets.to(w.dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_row_is_the_same_in_any_batch(dtype, bias):
    gen = torch.Generator().manual_seed(31)
    w = torch.randn(OUT_F, IN_F, generator=gen).to(dtype)
    b = torch.randn(OUT_F, generator=gen).to(dtype) if bias else None
    w, targets = _cancelling(w, torch.randn(3, IN_F, generator=gen) * 0.25)
    alone = torch.cat([K.invariant_linear(t[None], w, b, use_triton=True) for t in targets])  # M = 1 each
    assert alone.shape == (3, OUT_F) and alone.dtype == dtype
    _check_ref(alone, K.invariant_linear(targets, w, b, use_triton=False), targets, w, b)
    for m, x in _in_batches(targets, seed=32):
        out = K.invariant_linear(x, w, b, use_triton=True)
        assert torch.equal(out[_places(m)], alone), f"M={m}: a row changed with its batch"
        _check_ref(out, K.invariant_linear(x, w, b, use_triton=False), x, w, b)


def test_matmul_strided_rows_and_empty_batch():
    gen = torch.Generator().manual_seed(33)
    w = torch.randn(OUT_F, IN_F, generator=gen).to(torch.bfloat16)
    wide = torch.randn(9, IN_F + 24, generator=gen).to(torch.bfloat16)  # x as a view of a wider buffer
    x = wide[:, :IN_F]
    assert not x.is_contiguous()
    out = K.invariant_linear(x, w, use_triton=True)
    assert torch.equal(out, K.invariant_linear(x.contiguous(), w, use_triton=True))
    assert torch.equal(out[4:5], K.invariant_linear(x[4:5], w, use_triton=True))
    assert K.invariant_linear(x[:0], w, use_triton=True).shape == (0, OUT_F)


# rtol = atol, as tests/test_kernels_interp.py; bf16 wider: over 200 rows the interpreter's two truncations (of h
# and of the output, each up to 1 ulp, 2^-7 relative) beside the reference's two roundings reach 2.3% here.
NORM_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("hidden", [100, 1536])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_row_is_the_same_in_any_batch(dtype, hidden):
    """The RMSNorm and the fused add + RMSNorm (kernels/triton_norm.py: one program per row, its block and warps
    from the hidden size alone): a row's normed output and residual sum do not depend on the batch."""
    gen = torch.Generator().manual_seed(34)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    targets = (torch.randn(3, hidden, generator=gen) * 3).to(dtype)
    res_targets = torch.randn(3, hidden, generator=gen).to(dtype)
    alone = torch.cat([K.rms_norm(t[None], w, 1e-6, use_triton=True) for t in targets])
    pairs = [K.add_rms_norm(t[None], r[None], w, 1e-6, use_triton=True) for t, r in zip(targets, res_targets)]
    alone_n, alone_r = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    tol = NORM_TOL[dtype]
    torch.testing.assert_close(alone, K.rms_norm(targets, w, 1e-6, use_triton=False), rtol=tol, atol=tol)
    res_gen = torch.Generator().manual_seed(35)
    for m, x in _in_batches(targets, seed=36):
        places = _places(m)
        assert torch.equal(K.rms_norm(x, w, 1e-6, use_triton=True)[places], alone), f"M={m}"
        res = torch.randn(m, hidden, generator=res_gen).to(dtype)
        res[places] = res_targets
        normed, summed = K.add_rms_norm(x, res, w, 1e-6, use_triton=True)
        assert torch.equal(normed[places], alone_n) and torch.equal(summed[places], alone_r), f"M={m}"
        ref_n, _ = K.add_rms_norm(x, res, w, 1e-6, use_triton=False)
        torch.testing.assert_close(normed, ref_n, rtol=tol, atol=tol)
