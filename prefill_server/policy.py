"""Layer-wise or bulk: the measured policy behind MODE_AUTO.

Why a table and not a guess: streaming hides the transfer behind later layers, but its
per-layer work slows a short, launch-bound prefill. Which wins depends on the transport
and the prompt length, so the threshold per transport comes from a committed measurement
(`--layerwise-min-tokens` overrides it):

- grpc: bench/results/ttft-grpc-1xh200-2026-11-29 (Qwen2.5-7B, one H200): bulk wins at 1k,
  layer-wise from 4k on.
- nccl: the first experiment on 2 x H200 (an isend pair per layer; docs/architecture.md, "Layer-wise
  vs bulk on NVLink"): bulk won at 1k and at 32k, so bulk until the tuned layer-wise path is measured
  on two GPUs.
- gloo (CPU): the transfer is a memcpy-speed loopback; layer-wise from 2k like grpc.
- cuda_ipc: copies run on copy engines (no SMs); layer-wise from 2k until measured on two GPUs.
"""

from __future__ import annotations

BULK_ALWAYS = 1 << 62

MEASURED_MIN_TOKENS = {"grpc": 2048, "nccl": BULK_ALWAYS, "gloo": 2048, "cuda_ipc": 2048}


def layerwise_min_tokens(transport: str, override: int) -> int:
    """Prompts at least this long stream layer by layer; `override` >= 0 wins over the table."""
    return override if override >= 0 else MEASURED_MIN_TOKENS.get(transport, BULK_ALWAYS)


def choose(transport: str, override: int, prompt_tokens: int) -> str:
    return "layerwise" if prompt_tokens >= layerwise_min_tokens(transport, override) else "bulk"
