"""Attention for a prefill chunk that follows a past: causal, aligned lower-right, on SDPA's fused kernels.

Why: for a chunk of q tokens after p cached ones, HF's sdpa path materializes a (q, p + q) mask, and a
masked SDPA leaves the flash kernel: the chunks of a long prompt then cost several times the whole
prefill's time per token, and each stalled the running decodes for as long. The mask is
only "causal, aligned to the last key", which `causal_lower_right` expresses without a tensor, so SDPA
keeps its flash / memory-efficient kernels (GQA without repeating K/V). Used for the second and later
chunks only, of models the fused ops cannot run (the others chunk on kvtransfer/model/fused_prefill.py, which
calls SDPA the same way): a first chunk (no past) runs HF's own sdpa path, exactly as an unchunked prefill.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvtransfer.model.fused_prefill import prompt_attention

NAME = "kvt_chunk"


def chunk_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (b, hq, q, d), key/value (b, hkv, p + q, d) -> ((b, q, hq, d), None), as HF's attention functions."""
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = causal_lower_right(q_len, kv_len) if kv_len > q_len else None
    with prompt_attention(kv_len):  # no cuDNN graph build per new length (kvtransfer/model/fused_prefill.py)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                             scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # causality is chunk_attention's own


AttentionInterface.register(NAME, chunk_attention)
AttentionMaskInterface.register(NAME, _no_mask)


@contextmanager
def chunk_attention_on(model):
    """Run `model`'s attention through chunk_attention inside the block (the caller owns the model's thread)."""
    before = model.config._attn_implementation
    model.config._attn_implementation = NAME
    try:
        yield
    finally:
        model.config._attn_implementation = before
