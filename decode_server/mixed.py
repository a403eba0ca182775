"""Prefill chunks that ride in a decode step (Sarathi-Serve's piggybacking): one forward for both.

Why: with ~1k-token prompts and 128 output tokens, a separate prefill forward and a separate
decode step each read all the weights; at concurrency 32 that caps one H200 at ~13x the
one-at-a-time baseline (README, "What bounds this"). A chunk of c prompt tokens and the B decode
rows share every GEMM instead: the step costs max(compute of c + B rows, one read of the
weights), so the decode rows ride nearly free while a prefill is in progress.

`mixed_forward` is the step's math over B decode rows plus one chunk of one prompt: norms and
GEMMs over all B + c rows, RoPE and the pool write for all rows in one kernel, then attention
split: the decode rows through the split-K kernel over their slots, the chunk through SDPA over
its own slot (causal, aligned lower-right after the chunk's past). Eager (not graph-captured:
c varies). `MixedPrefill` is one prompt's progress through its chunks.

What it equals: decode rows within the batching tolerance of the plain step; a prompt's cache
and first logits within the chunked-prefill tolerance of a whole prefill (tests/test_mixed.py).
A prompt that fits one chunk while nothing decodes takes the plain fused prefill instead, so a
request alone stays bit-identical between colocated and disaggregated.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtransfer import kernels

from .pool import Lease
from .runner import StepRunner


@dataclass
class Chunk:
    ids: torch.Tensor  # (c,) int64 on the device
    slot: int
    start: int  # positions start .. start + c - 1
    last: bool  # the prompt's final chunk: its last row's logits give the first token


@torch.inference_mode()
def mixed_forward(r: StepRunner, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/positions/slots: (B,) decode rows (B may be 0); chunk: c prompt tokens into chunk.slot.
    Returns (decode logits (B, vocab), the chunk's last-row logits (vocab,))."""
    ops, tri = kernels, r.use_triton
    b, c, dev = tokens.shape[0], chunk.ids.shape[0], chunk.ids.device
    chunk_pos = torch.arange(chunk.start, chunk.start + c, device=dev)
    pos = torch.cat([positions, chunk_pos])  # (B + c,)
    at = torch.cat([slots, torch.full((c,), chunk.slot, dtype=torch.long, device=dev)])
    lengths = (positions + 1).to(torch.int32)
    cos, sin = r.cos[pos], r.sin[pos]  # (B + c, D)
    h = r.embed[torch.cat([tokens, chunk.ids])]  # (B + c, H)
    residual = None
    n, end = b + c, chunk.start + c
    q_end, k_end = r.hq * r.d, (r.hq + r.hkv) * r.d
    mask = causal_lower_right(c, end) if chunk.start else None
    for i, w in enumerate(r.layers):
        if residual is None:
            x, residual = ops.rms_norm(h, w.ln1, r.eps, use_triton=tri), h
        else:
            x, residual = ops.add_rms_norm(h, residual, w.ln1, r.eps, use_triton=tri)
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # (B + c, (Hq + 2 Hkv) * D)
        q = qkv[:, :q_end].view(n, r.hq, r.d)
        k = qkv[:, q_end:k_end].view(n, r.hkv, r.d)
        v = qkv[:, k_end:].view(n, r.hkv, r.d)
        kp, vp = r.pool.layer(i)  # (slots + 1, Hkv, max_seq, D)
        q = ops.rope_store(q, k, v, cos, sin, kp, vp, at, pos, use_triton=tri)  # every row's K/V into its slot
        parts = []
        if b:
            parts.append(ops.decode_attention(q[:b], kp, vp, slots, lengths, r.scale, use_triton=tri))  # (B, Hq, D)
        qc = q[b:].transpose(0, 1)[None]  # (1, Hq, c, D)
        oc = F.scaled_dot_product_attention(qc, kp[chunk.slot, :, :end][None], vp[chunk.slot, :, :end][None],
                                            attn_mask=mask, is_causal=mask is None, scale=r.scale,
                                            enable_gqa=r.hq != r.hkv)  # (1, Hq, c, D)
        parts.append(oc[0].transpose(0, 1))  # (c, Hq, D)
        o = torch.cat(parts).reshape(n, q_end)
        h = F.linear(o, w.o, w.o_bias)  # (B + c, H)
        x, residual = ops.add_rms_norm(h, residual, w.ln2, r.eps, use_triton=tri)
        h = F.linear(ops.silu_mul(F.linear(x, w.gate_up), use_triton=tri), w.down)
    keep = torch.cat([torch.arange(b, device=dev), torch.tensor([n - 1], device=dev)])  # decode rows + chunk's last
    x, _ = ops.add_rms_norm(h[keep], residual[keep], r.norm, r.eps, use_triton=tri)
    logits = F.linear(x, r.lm_head)  # (B + 1, vocab)
    return logits[:b], logits[b]


@dataclass
class MixedPrefill:
    """One prompt's chunks, handed out one per step; the future resolves with LocalPrefill after the last."""

    ids: torch.Tensor  # (n,) int64 on the device
    lease: Lease
    chunk: int
    want_digest: bool
    future: Future = field(default_factory=Future)
    start: int = 0
    t0: float = field(default_factory=time.perf_counter)  # reset when its first chunk goes (scheduler)

    def next_chunk(self) -> Chunk:
        end = min(self.ids.shape[0], self.start + self.chunk)
        c = Chunk(self.ids[self.start:end], self.lease.slot, self.start, end == self.ids.shape[0])
        self.start = end
        return c

    @property
    def handed_out(self) -> bool:
        return self.start >= self.ids.shape[0]
