"""The compute roofline beside a `serve` figure: what the GPU's GEMMs allow for the workload's FLOPs.

Why: `decode` prices a step against its memory floor; a served run's output tok/s needs the other bound, the
arithmetic. `serve --roofline` measures, in the bench process right before the load, the bf16 GEMM rate of the
model's own shapes at ROWS rows (a prefill-sized step: compute bound), and divides it by the FLOPs one request
of the run costs. The result is an upper bound on output tok/s (every FLOP at that rate; memory, launches and
the host cost nothing), so `of_roofline` = measured / roofline says how much of the arithmetic the server uses.

What one request counts (`request_flops`; a multiply-add is 2 FLOPs), for a prompt of P tokens and O output
tokens, the server feeding N = P + O - 1 tokens through the layers (the prompt, then every output token but the
last, which is never fed back):
  layers     2 x (q, k, v, o, gate, up, down weights of one layer) x num_hidden_layers x N
  attention  QK^T and PV: 2 x 2 x num_attention_heads x head_dim x num_hidden_layers per (token, key), a token at
             position t reading t + 1 keys (causal, its own included): x N (N + 1) / 2, i.e. N tokens at the
             request's mean context (N + 1) / 2
  lm_head    2 x hidden_size x vocab_size x O: logits only for the rows that pick a token (the prompt's last
             row, then each fed output token)
Not counted: biases, norms, RoPE, SiLU, residual adds, the embedding lookup, sampling. Over a run, the mean of
the requests' counts (prompt lengths vary).

What the rate is (`measure_gemm`, CUDA only): F.linear at ROWS rows in bf16 over the engine's shapes
(kvtransfer/model/fused.py fuses q, k, v into one weight and gate, up into another): qkv, o, gate_up, down and
lm_head, each warmed up, then the median over REPS of CUDA-event-timed loops (bench.measure.timing.loop_us). The
layer GEMMs' rate is one layer's FLOPs over their summed times (each runs once per token); lm_head has its own.
Attention's FLOPs are priced at the layer rate. Per run, `gemm_tflops` is the rate the request's FLOPs get over
those two (FLOPs / time), and roofline output tok/s = gemm_tflops / FLOPs per request x O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROWS = 2048
REPS = 7          # timed loops per shape: the median of these
CALLS = 10        # GEMMs per timed loop
WARMUP = 3        # untimed calls per shape first (cuBLAS picks and loads its kernel)
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")
COUNTED = ("per request of P prompt and O output tokens, N = P + O - 1 tokens fed: 2 x (q,k,v,o,gate,up,down "
           "weights) x layers x N, + attention QK^T and PV 4 x heads x head_dim x layers x N (N + 1) / 2 (N tokens at "
           "the mean context), + lm_head 2 x hidden x vocab x O; biases, norms, RoPE, SiLU, embedding and sampling "
           "not counted; attention priced at the layer GEMMs' rate; each completed request at the P and O it ran "
           "(bench/measure/roofline.py)")


def cuda_visible() -> bool:
    """Whether this process sees a CUDA device (the GEMM rate is measured only then)."""
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config) -> Dims:
        """From a transformers config (a preset's or a local directory's)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.hidden_size, heads, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                   config.intermediate_size, config.num_hidden_layers, config.vocab_size)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """The engine's GEMMs as (out features, in features)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q), "gate_up": (2 * self.intermediate,
                self.hidden), "down": (self.hidden, self.intermediate), "lm_head": (self.vocab, self.hidden)}

    def layer_params(self) -> int:
        """Weights one token multiplies in one layer: q, k, v, o, gate, up, down."""
        return sum(n * k for name, (n, k) in self.shapes().items() if name in LAYER_SHAPES)


def request_flops(dims: Dims, prompt_len: int, output_len: int) -> dict:
    """One request's FLOPs by part (see the module's docstring for what is counted)."""
    fed = prompt_len + output_len - 1
    layers = 2 * dims.layer_params() * dims.layers * fed
    attention = 4 * dims.heads * dims.head_dim * dims.layers * fed * (fed + 1) // 2
    lm_head = 2 * dims.hidden * dims.vocab * output_len
    return {"layers": layers, "attention": attention, "lm_head": lm_head, "total": layers + attention + lm_head}


def output_lens(prompt_lens: Sequence[int], output_len: int | Sequence[int]) -> list[int]:
    """Each request's output tokens: `output_len` for every one, or each one's (paired with `prompt_lens`)."""
    outs = [output_len] * len(prompt_lens) if isinstance(output_len, int) else list(output_len)
    if len(outs) != len(prompt_lens) or not outs:
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(outs)} output lengths")
    return outs


def mean_request_flops(dims: Dims, prompt_lens: Sequence[int], output_len: int | Sequence[int]) -> dict:
    """The mean over a run's requests of `request_flops`, by part (`output_len` as `output_lens` takes it)."""
    each = [request_flops(dims, p, o) for p, o in zip(prompt_lens, output_lens(prompt_lens, output_len))]
    return {k: sum(f[k] for f in each) / len(each) for k in each[0]}


def measure_gemm(dims: Dims, device: str = "cuda", rows: int = ROWS) -> dict:
    """The bf16 GEMM rate of `dims`' shapes at `rows` rows on a CUDA device (refused elsewhere: a CPU rate is no
    roofline of a GPU server). Every tensor is freed before it returns: the load that follows shares the GPU."""
    import torch
    import torch.nn.functional as F

    from bench.measure.timing import loop_us

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"the GEMM rate is measured on a CUDA device only (got {device!r})")
    shapes = {}
    with torch.cuda.device(dev):
        for name, (n, k) in dims.shapes().items():
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            for _ in range(WARMUP):
                F.linear(x, w)
            us = loop_us(lambda: F.linear(x, w), CALLS, REPS)
            shapes[name] = {"n": n, "k": k, "us": us, "tflops": 2 * rows * n * k / (us * 1e-6) / 1e12}
            del w, x
        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(dev)
    layer = [shapes[s] for s in LAYER_SHAPES]
    layer_tflops = sum(2 * rows * s["n"] * s["k"] for s in layer) / (sum(s["us"] for s in layer) * 1e-6) / 1e12
    return {"device": name, "rows": rows, "dtype": "bfloat16", "reps": REPS, "calls_per_rep": CALLS,
            "shapes": shapes, "layer_tflops": layer_tflops, "lm_head_tflops": shapes["lm_head"]["tflops"]}


def run_figures(measured: dict, dims: Dims, prompt_lens: Sequence[int], output_len: int | Sequence[int],
                output_throughput: float | None) -> dict:
    """One run's roofline from the measured rates and its requests: roofline_output_tok_s, gemm_tflops (the rate its
    FLOPs get), of_roofline (None without output), and the mean FLOPs per request by part. `output_len`: every
    request's, or each one's (beside `prompt_lens`: the tokens the requests made, e.g. under --stop-after)."""
    outs = output_lens(prompt_lens, output_len)
    flops = mean_request_flops(dims, prompt_lens, outs)
    seconds = ((flops["layers"] + flops["attention"]) / (measured["layer_tflops"] * 1e12)
               + flops["lm_head"] / (measured["lm_head_tflops"] * 1e12))
    roof = sum(outs) / len(outs) / seconds  # the mean request's output tokens in the mean request's time
    return {"roofline_output_tok_s": roof, "gemm_tflops": flops["total"] / seconds / 1e12,
            "of_roofline": output_throughput / roof if output_throughput is not None else None,
            "roofline_flops_per_request": flops}
