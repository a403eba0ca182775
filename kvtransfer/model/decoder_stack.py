"""The decoder layer stack over the fused weights: one loop for the decode step and the fused prefill.

Why one loop: the batched decode step (kvtransfer/engine/runner.py) and the fused prefill
(kvtransfer/model/fused_prefill.py) run the same Llama/Qwen2/Mistral layer over rows of tokens; they
differ only in where a layer's K/V go and how its rows attend (the pool's slots and the decode/chunk
kernels there; a one-slot block, a per-layer stream hook and SDPA here), and in the GEMM choice (a
batch-1 GEMV in the step). Those two come in as callables; the norms, projections and residuals,
and so their rounding, are written once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtransfer.kernels import ops as kernels
from kvtransfer.model.fused import LayerWeights

# attend(i, q, k, v) -> o: layer i's rows, q (R, Hq, D) and k, v (R, Hkv, D) pre-RoPE -> (R, Hq, D), after
# writing the layer's rotated K and V wherever the caller keeps them.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# project(name, x, w, bias) -> x @ w^T (+ bias); name is "qkv", "o", "gate_up" (which returns silu(gate) * up,
# (R, I)) or "down".
Project = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def plain_project(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """cuBLAS GEMMs at any row count (the prefill's): F.linear, and silu_mul after the gate/up GEMM (its backend
    chosen by the tensor's device, as every op of the prefill: run_layers' use_triton does not reach it)."""
    if name == "gate_up":
        return kernels.silu_mul(torch.nn.functional.linear(x, w))
    return torch.nn.functional.linear(x, w, bias)


def run_layers(layers: list[LayerWeights], h: torch.Tensor, eps: float, heads: tuple[int, int, int],
               attend: Attend, project: Project = plain_project, use_triton: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """h (R, H): the embedded rows -> (h, residual) after the last layer, each (R, H), for the caller's final
    add + RMSNorm. heads = (Hq, Hkv, D). use_triton as kernels' ops (None: Triton on CUDA when importable)."""
    hq, hkv, d = heads
    rows = h.shape[0]
    q_end, k_end = hq * d, (hq + hkv) * d
    residual = None
    for i, w in enumerate(layers):
        if residual is None:
            x, residual = kernels.rms_norm(h, w.ln1, eps, use_triton=use_triton), h
        else:
            x, residual = kernels.add_rms_norm(h, residual, w.ln1, eps, use_triton=use_triton)
        qkv = project("qkv", x, w.qkv, w.qkv_bias)  # (R, (Hq + 2 Hkv) * D)
        q = qkv[:, :q_end].view(rows, hq, d)
        k = qkv[:, q_end:k_end].view(rows, hkv, d)
        v = qkv[:, k_end:].view(rows, hkv, d)
        o = attend(i, q, k, v)  # (R, Hq, D)
        h = project("o", o.reshape(rows, q_end), w.o, w.o_bias)  # (R, H)
        x, residual = kernels.add_rms_norm(h, residual, w.ln2, eps, use_triton=use_triton)
        h = project("down", project("gate_up", x, w.gate_up, None), w.down, None)  # (R, I) -> (R, H)
    return h, residual
