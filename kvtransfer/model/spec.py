"""Model loading: named presets with seeded random weights, or a local HF directory.

Why presets: no machine here may download weights, yet timings must be those of the
real models. A preset has the exact published shapes; random weights run the same
kernels for the same time. Two workers built from the same preset and seed hold the
same weights, which `weights_fingerprint` proves at the handshake instead of assuming.

Why a local directory is checked before transformers reads it: a missing or cut-short
safetensors file, a missing config.json or an architecture the engine cannot run would
otherwise surface as a library traceback (or, for weights the checkpoint lacks, as
silently random ones). Each is refused as one ValueError naming the directory, what is
wrong and what to do; the servers print it as `cannot start: ...` and exit 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from kvtransfer.model.fused import SUPPORTED

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
    _check_config_json(name)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"model directory {name}: transformers cannot read its config.json ({_one_line(e)}); "
                         "use the config.json that came with the checkpoint") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _check_config_json(d: str) -> None:
    """config.json exists, parses, and names a causal decoder the engine runs (kvtransfer.model.fused.SUPPORTED)."""
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {d} has no config.json; pass the directory that holds the checkpoint's "
                         "config.json and *.safetensors (as save_pretrained writes them)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model directory {d}: config.json is not readable JSON ({_one_line(e)}); "
                         "copy the checkpoint's config.json again") from None
    if not isinstance(cfg, dict) or not cfg.get("model_type"):
        raise ValueError(f"model directory {d}: config.json names no model_type; use the config.json that came "
                         "with the checkpoint")
    kind, archs = cfg["model_type"], cfg.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else list(archs)
    named = f" (architectures {', '.join(map(str, archs))})" if archs else ""
    if kind not in SUPPORTED or any(not str(a).endswith("ForCausalLM") for a in archs):
        raise ValueError(f"model directory {d}: model type {kind!r}{named} is not supported: kvtransfer runs "
                         f"{', '.join(SUPPORTED)}-style causal decoders (*ForCausalLM) only; use a checkpoint of "
                         "one of those")


def _check_weight_files(d: str) -> None:
    """The safetensors files the checkpoint needs exist and are whole (each header's tensors fit in its file)."""
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"model directory {d}: model.safetensors.index.json is not a valid index "
                             f"({_one_line(e)}); copy it from the checkpoint again") from None
        for name in files:
            if not os.path.isfile(os.path.join(d, name)):
                raise ValueError(f"model directory {d}: {name} is missing (model.safetensors.index.json lists it); "
                                 "copy every shard of the checkpoint there")
    elif os.path.isfile(os.path.join(d, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        found = sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
        raise ValueError(f"model directory {d} has no model.safetensors (nor model.safetensors.index.json for a "
                         f"sharded checkpoint){'; it holds ' + ', '.join(found) if found else ''}; copy the "
                         "checkpoint's safetensors there (kvtransfer loads safetensors only: save_pretrained "
                         "writes them)")
    for name in files:
        _check_safetensors_file(d, name)


def _check_safetensors_file(d: str, name: str) -> None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors' bytes: all must be there."""
    path = os.path.join(d, name)
    size = os.path.getsize(path)
    redo = "copy or download it again"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"model directory {d}: {name} is truncated ({size} bytes, not even a header); {redo}")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise ValueError(f"model directory {d}: {name} is truncated ({size:,} bytes, its header alone says "
                             f"{8 + n:,}); {redo}")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"model directory {d}: {name} is not a safetensors file (bad header: {_one_line(e)}); "
                             f"{redo}") from None
    if 8 + n + end > size:
        raise ValueError(f"model directory {d}: {name} is truncated ({size:,} of {8 + n + end:,} bytes); {redo}")


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
        model = _load_local(spec).to(device)
        with torch.no_grad():  # safetensors mmaps are only 8-byte aligned; CPU GEMM results depend on it
            for p in model.parameters():
                p.data = p.data.clone()
    model.eval()
    model.requires_grad_(False)
    return model


def _load_local(spec: ModelSpec) -> PreTrainedModel:
    """A local HF directory's model, refusing (ValueError, one line) what would not be the checkpoint's weights."""
    d = spec.name
    config = load_config(d)
    _check_weight_files(d)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            d, config=config, dtype=spec.torch_dtype, attn_implementation="sdpa", local_files_only=True,
            output_loading_info=True, ignore_mismatched_sizes=True)  # mismatches are refused below, by name
    except (OSError, ValueError, SafetensorError) as e:
        raise ValueError(f"model directory {d}: cannot load its weights ({_one_line(e)}); copy the checkpoint's "
                         "config.json and safetensors there again") from None
    mismatched = info.get("mismatched_keys") or ()  # (name, checkpoint shape, model shape)
    wrong = sorted(info.get("missing_keys") or ()) + sorted(k[0] if isinstance(k, tuple) else k for k in mismatched)
    if wrong:
        raise ValueError(f"model directory {d}: its safetensors do not hold what config.json describes ({len(wrong)} "
                         f"weight(s) missing or of another shape, e.g. {', '.join(wrong[:3])}); use the config.json "
                         "that came with these weights")
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
