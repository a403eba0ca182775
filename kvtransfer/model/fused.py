"""The decoder's weights as the fused engine reads them: q/k/v and gate/up as one tensor each, in place.

Why shared: the decode step (kvtransfer/engine/runner.py) and the fused prefill (kvtransfer/model/fused_prefill.py)
run the same fused projections on the HF modules' own parameters. Fusing rebinds each module's
parameter as a view of the concatenated tensor, so the weights exist once and the plain HF forward
keeps working on them; it is idempotent, so any number of runners and prefills share one copy.
Only Llama/Qwen2/Mistral-style decoders qualify (`check_supported` says why not otherwise).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

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




# model -> (its layer weights, the signature they were built from), while the model lives
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(model) -> list[tuple[torch.nn.Parameter, int]]:
    """Every decoder-layer parameter and where its data lives: a module swapped, a weight rebound (`.data =`, a move
    of the model) changes it; weights copied in place (load_state_dict) do not, and need no new fusion."""
    return [(p, p.data_ptr()) for p in model.model.layers.parameters()]


def _intact(model, signature: list[tuple[torch.nn.Parameter, int]]) -> bool:
    now = list(model.model.layers.parameters())
    return len(now) == len(signature) and all(q is p and q.data_ptr() == ptr for q, (p, ptr) in zip(now, signature))


def fused_layers(model) -> list[LayerWeights]:
    """Each decoder layer's weights, q/k/v and gate/up fused in place. Fused once per model, and the list is kept
    for it while its parameters stay where they were: every prefill asks, and walking every layer's storages
    would cost host time on each call."""
    cached = _FUSED.get(model)
    if cached is not None and _intact(model, cached[1]):
        return cached[0]
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse(a.q_proj, a.k_proj, a.v_proj)
        gate_up, _ = _fuse(m.gate_proj, m.up_proj)
        out.append(LayerWeights(layer.input_layernorm.weight, qkv, qkv_bias, a.o_proj.weight, a.o_proj.bias,
                                layer.post_attention_layernorm.weight, gate_up, m.down_proj.weight))
    _FUSED[model] = out, _signature(model)  # after fusing: the parameters are the fused tensor's views now
    return out
