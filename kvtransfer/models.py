"""Model loading: named presets with seeded random weights, or a local HF directory.

Why presets: no machine here may download weights, yet timings must be those of the
real models. A preset has the exact published shapes; random weights run the same
kernels for the same time. Two workers built from the same preset and seed hold the
same weights, which `weights_fingerprint` proves at the handshake instead of assuming.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

# Exact published shapes (config.json of HuggingFaceTB/SmolLM2-135M and Qwen/Qwen2.5-7B).
PRESETS: dict[str, dict] = {
    "tiny": dict(
        cls=LlamaConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        cls=LlamaConfig, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    ),
    "qwen2.5-7b": dict(
        cls=Qwen2Config, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
        bos_token_id=151643, eos_token_id=151643,
    ),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class ModelNotFoundError(ValueError):
    """The model name is neither a preset nor a local directory."""


@dataclass(frozen=True)
class ModelSpec:
    """What both workers must agree on to hold the same model."""

    name: str  # preset name or local directory
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.name not in PRESETS and not os.path.isdir(self.name):
            raise ModelNotFoundError(
                f"model {self.name!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
                "directory with config.json and safetensors; kvtransfer never downloads from a hub: "
                "download the model elsewhere and pass its directory")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def preset_config(name: str):
    kw = dict(PRESETS[name])
    cls = kw.pop("cls")
    head_dim = kw["hidden_size"] // kw["num_attention_heads"]
    return cls(head_dim=head_dim, **kw)


def load_config(name: str):
    if name in PRESETS:
        return preset_config(name)
    ModelSpec(name)  # raises the clear error for hub ids
    return AutoConfig.from_pretrained(name, local_files_only=True)


@torch.no_grad()
def _seeded_init_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from a generator seeded per name: independent of init order.

    RMSNorm weights are 1 + N(0, 0.02), not HF's 1.0: were every norm weight 1, a test against the HF forward
    could not tell one norm's weight from another's (input_layernorm's read where post_attention_layernorm's
    belongs). They are drawn in float64 by a CPU generator, so they are the same bits on every device and CPU
    (float32 draws take a vectorized path on AVX2 machines only), then rounded to the model's dtype."""
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        name_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            g = torch.Generator().manual_seed(name_seed)
            p.copy_(torch.empty(p.shape, dtype=torch.float64).normal_(1.0, 0.02, generator=g))
            continue
        g = torch.Generator(device=p.device)
        g.manual_seed(name_seed)
        if name.endswith(".bias"):
            p.normal_(0.0, 0.02, generator=g)
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
            p.normal_(0.0, fan_in ** -0.5 if "embed" not in name else 1.0, generator=g)


def load_model(spec: ModelSpec, device: str | torch.device = "cpu") -> PreTrainedModel:
    """Build the model on `device` in eval mode with sdpa attention."""
    device = torch.device(device)
    if spec.name in PRESETS:
        config = preset_config(spec.name)
        config._attn_implementation = "sdpa"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=spec.torch_dtype,
                                                     attn_implementation="sdpa")
        _seeded_init_(model, spec.seed)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            spec.name, dtype=spec.torch_dtype, attn_implementation="sdpa", local_files_only=True,
        ).to(device)
        with torch.no_grad():  # safetensors mmaps are only 8-byte aligned; CPU GEMM results depend on it
            for p in model.parameters():
                p.data = p.data.clone()
    model.eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every weight bit, computed on the weights' device (exact integer sums).

    Each tensor's raw bits are folded into two int64 sums (plain and position-weighted),
    so a single flipped bit or a swap of two elements (unless 65521 positions apart)
    changes the digest.
    """
    h = hashlib.sha256()
    chunk = 1 << 24
    for name, p in sorted(model.state_dict().items(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        bits = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32)
        s1 = torch.zeros((), dtype=torch.int64, device=p.device)
        s2 = torch.zeros((), dtype=torch.int64, device=p.device)
        for start in range(0, bits.numel(), chunk):
            part = bits[start:start + chunk].to(torch.int64)
            w = torch.arange(start, start + part.numel(), device=p.device, dtype=torch.int64) % 65521 + 1
            s1 += part.sum()
            s2 += (part * w).sum()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{int(s1)}:{int(s2)};".encode())
    return h.hexdigest()[:32]
