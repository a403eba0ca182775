"""One batched decode step over the KV pool: a function of static-shaped tensors.

Why not the HF forward: HF decodes one request per call through a DynamicCache, launching
~30 small kernels per layer from Python, so batch 32 costs what batch 1 costs (launch-bound).
This step reads the same weights (the HF modules' own parameters, fused in place: q/k/v and
gate/up become views of one tensor each, so prefill still runs the HF forward on them), feeds
B rows at their own positions, writes each row's new K/V into its pool slot and attends over
exactly its valid length. Its inputs are three (B,) tensors, so it can be captured as a CUDA
graph per batch size (graphs.py). The math mirrors HF's Llama/Qwen2/Mistral decoder; what
differs from HF is kernel choice, so logits agree with the HF forward within a stated
tolerance (tests/test_engine.py), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtransfer import kernels

from .pool import KVPool

SUPPORTED = ("llama", "qwen2", "mistral")


class UnsupportedModel(ValueError):
    """The batched engine cannot run this architecture; the message says why."""


def check_supported(config, max_seq: int) -> None:
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED:
        raise UnsupportedModel(f"model type {kind!r}: the batched decode engine runs {', '.join(SUPPORTED)}-style "
                               "decoders only")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r}: the engine's MLP is SiLU-gated only")
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", kind == "mistral")
    if window and uses_window and window < max_seq:
        raise UnsupportedModel(f"sliding window of {window} tokens < --max-seq-len {max_seq}: sliding-window "
                               "attention is not supported by the engine; lower --max-seq-len to the window")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModel("mlp_bias=True is not supported by the engine")


@dataclass
class LayerWeights:
    ln1: torch.Tensor  # (H,)
    qkv: torch.Tensor  # ((Hq + 2 Hkv) * D, H): q, k, v rows
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # (H, Hq * D)
    o_bias: torch.Tensor | None
    ln2: torch.Tensor  # (H,)
    gate_up: torch.Tensor  # (2 I, H): gate rows, then up rows
    down: torch.Tensor  # (H, I)


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor that `parts` are consecutive row blocks of (a fusion done before), else None."""
    first = parts[0]
    offset, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in parts:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


@torch.no_grad()
def _fuse(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output dim; rebind each module's parameters as a
    view of the fused tensor, so the weights exist once and the HF forward keeps working on them. Idempotent: a
    second runner over the same model (a new pool) reuses the fused tensor instead of copying the weights again."""
    w = _adjacent([m.weight.data for m in linears])
    b = None if linears[0].bias is None else _adjacent([m.bias.data for m in linears])
    if w is not None and (b is not None or linears[0].bias is None):
        return w, b
    w = torch.cat([m.weight for m in linears])
    b = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = w[row:row + n]
        if b is not None:
            m.bias.data = b[row:row + n]
        row += n
    return w, b


class StepRunner:
    def __init__(self, model, pool: KVPool, use_triton: bool | None = None):
        cfg = model.config
        check_supported(cfg, pool.max_seq)
        self.pool, self.device = pool, pool.device
        self.use_triton = kernels.triton_available(self.device) if use_triton is None else use_triton
        self.hq, self.hkv, self.d = cfg.num_attention_heads, pool.geometry.kv_heads, pool.geometry.head_dim
        self.eps = cfg.rms_norm_eps
        inner = model.model
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse(a.q_proj, a.k_proj, a.v_proj)
            gate_up, _ = _fuse(m.gate_proj, m.up_proj)
            self.layers.append(LayerWeights(layer.input_layernorm.weight, qkv, qkv_bias, a.o_proj.weight,
                                            a.o_proj.bias, layer.post_attention_layernorm.weight, gate_up,
                                            m.down_proj.weight))
        self.scale = float(getattr(inner.layers[0].self_attn, "scaling", self.d ** -0.5))
        self.embed, self.norm, self.lm_head = inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight
        # HF's own rotary module over every position once: (max_seq, D) in the model dtype, as HF casts it
        dtype = self.embed.dtype
        with torch.no_grad():
            pos = torch.arange(pool.max_seq, device=self.device).unsqueeze(0)  # (1, max_seq)
            cos, sin = inner.rotary_emb(torch.empty(0, dtype=dtype, device=self.device), pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # (max_seq, D)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """tokens, positions, slots: (B,) int64 on the device -> logits (B, vocab) in the model dtype.

        Row b feeds `tokens[b]` at position `positions[b]` of slot `slots[b]`: its K/V are written there, and it
        attends over positions 0..positions[b] of that slot.
        """
        ops, tri = kernels, self.use_triton
        b = tokens.shape[0]
        lengths = (positions + 1).to(torch.int32)  # (B,)
        cos, sin = self.cos[positions], self.sin[positions]  # (B, D)
        h = self.embed[tokens]  # (B, H)
        residual = None
        q_end, k_end = self.hq * self.d, (self.hq + self.hkv) * self.d
        for i, w in enumerate(self.layers):
            if residual is None:
                x, residual = ops.rms_norm(h, w.ln1, self.eps, use_triton=tri), h
            else:
                x, residual = ops.add_rms_norm(h, residual, w.ln1, self.eps, use_triton=tri)
            qkv = F.linear(x, w.qkv, w.qkv_bias)  # (B, (Hq + 2 Hkv) * D)
            q = qkv[:, :q_end].view(b, self.hq, self.d)
            k = qkv[:, q_end:k_end].view(b, self.hkv, self.d)
            v = qkv[:, k_end:].view(b, self.hkv, self.d)
            kp, vp = self.pool.layer(i)  # (slots + 1, Hkv, max_seq, D) each
            q = ops.rope_store(q, k, v, cos, sin, kp, vp, slots, positions, use_triton=tri)
            o = ops.decode_attention(q, kp, vp, slots, lengths, self.scale, use_triton=tri)  # (B, Hq, D)
            h = F.linear(o.reshape(b, self.hq * self.d), w.o, w.o_bias)  # (B, H)
            x, residual = ops.add_rms_norm(h, residual, w.ln2, self.eps, use_triton=tri)
            h = F.linear(ops.silu_mul(F.linear(x, w.gate_up), use_triton=tri), w.down)  # (B, H)
        x, _ = ops.add_rms_norm(h, residual, self.norm, self.eps, use_triton=tri)
        return F.linear(x, self.lm_head)  # (B, vocab)
