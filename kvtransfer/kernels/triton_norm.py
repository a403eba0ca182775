"""Triton RMSNorm (optionally fused with the residual add) and SiLU-and-multiply.

Why: at decode batch sizes these are launch- and bandwidth-bound elementwise ops; one
program per row (norm) or per row block (silu) does each in one pass.

Rounding mirrors HF where it matters for bit-closeness: the residual sum is rounded to the
input dtype before the norm reads it (HF: hidden = residual + hidden), the normalized value
is rounded to the input dtype before the weight multiplies it, and SiLU(gate) is rounded
before the multiply by up (HF computes act(gate) * up in the input dtype). Only the fp32
reduction order and rsqrt/sigmoid implementations differ from torch's (<= 1 ulp of bf16 in
rare ties).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, Res, W, Out, ResOut,
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    # grid (B,): one program per row of x (B, H).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    act_ty = X.dtype.element_ty
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (r + x).to(act_ty)  # rounded once, as torch's bf16 add
        tl.store(ResOut + row * stride_ro + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, 0) / HIDDEN
    rstd = tl.math.rsqrt(var + eps)
    h = (x * rstd).to(act_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * h).to(Out.dtype.element_ty), mask=mask)


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def rms_norm_triton(x, weight, eps, residual=None):
    """x (B, H) [+ residual (B, H)] -> normed (B, H) [, residual_out (B, H)]; checked by the caller.

    normed has dtype promote(weight, x) as HF's weight * h.to(x.dtype) does.
    """
    batch, hidden = x.shape
    out = torch.empty((batch, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    has_res = residual is not None
    res_out = torch.empty((batch, hidden), dtype=x.dtype, device=x.device) if has_res else out
    res_in = residual if has_res else x
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(batch,)](
        x, res_in, weight, out, res_out,
        x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
        float(eps),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_res,
        num_warps=_norm_warps(block),
    )
    return (out, res_out) if has_res else out


@triton.jit
def _silu_mul_kernel(GU, Out, stride_g, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    # grid (B, cdiv(I, BLOCK)): gate_up (B, 2I) -> out (B, I).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    act_ty = GU.dtype.element_ty
    g = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(act_ty).to(tl.float32)  # F.silu in the input dtype
    tl.store(Out + row * stride_o + offs, (act * u).to(act_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (B, 2I) with unit last stride -> silu(gate) * up (B, I); checked by the caller."""
    batch, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((batch, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(batch, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4,
    )
    return out
