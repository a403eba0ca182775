"""One batched decode step over the KV pool: a function of static-shaped tensors.

Why not the HF forward: HF decodes one request per call through a DynamicCache, launching
dozens of small kernels per layer from Python, so a batch of 32 costs what one request costs (launch-bound).
This step reads the same weights (the HF modules' own parameters, fused in place: q/k/v and
gate/up become views of one tensor each, kvtransfer/model/fused.py, so the HF forward still runs on
them), feeds B rows at their own positions, writes each row's new K/V into its pool slot and
attends over exactly its valid length. The layer loop itself is kvtransfer/model/decoder_stack.py,
shared with the fused prefill; what is the step's own is where K/V go, how rows attend and the
GEMM choice. Its inputs are three (B,) tensors, so it can be captured as a CUDA graph per batch
size (graphs.py). The math mirrors HF's Llama/Qwen2/Mistral decoder; what
differs from HF is kernel choice, so logits agree with the HF forward within a stated
tolerance (tests/test_engine.py), not bit for bit.
"""

from __future__ import annotations

import logging

import torch

from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.side_stream import SideStream
from kvtransfer.kernels import ops as kernels
from kvtransfer.model.decoder_stack import run_layers
from kvtransfer.model.fused import UnsupportedModel, check_supported, fused_layers

__all__ = ["StepRunner", "UnsupportedModel", "check_supported", "pick_gemv"]
log = logging.getLogger("kvtransfer.decode.runner")


GEMV_CHOICES = ("auto", "on", "off")  # --gemv: timed at start, every projection, none
SIDE_KERNEL = "chunk"  # a mixed step's attention kernel launched on the side stream: "chunk" (the prompt rows') or
# "decode" (bench/probes/chunk_attention.py --pair-sweep times both; the same kernels, so the same bits)
MIXED_ATTENTION = "fused"  # a mixed step's attention: "fused" (one launch where ops.mixed_attention_fuses says so:
# enough decode rows, and a pool whose rows fit the decode kernel's per-split cap; else as "two"), or "two" (the
# decode and the chunk kernel, on the side stream unless it is off); read at each forward, so a capture takes the
# value of its time (bench/probes/profile_mixed.py --attention prices both)
MIXED_ATTENTIONS = ("fused", "two")


class StepRunner:
    def __init__(self, model, pool: KVPool, use_triton: bool | None = None, gemv_rows: int | None = None,
                 gemv: str = "auto", invariant: bool = False):
        """invariant: the batch-invariant step (--batch-invariant, docs/batch-invariance.md): every projection and
        the lm_head by ops.invariant_linear, every row (prompt rows too) attending as a decode row, no GEMV pick,
        so a row's logits are the same bits whatever else the step carries."""
        cfg = model.config
        self.invariant = invariant
        check_supported(cfg, pool.max_seq)
        self.pool, self.device = pool, pool.device
        self.use_triton = kernels.triton_available(self.device) if use_triton is None else use_triton
        self.hq, self.hkv, self.d = cfg.num_attention_heads, pool.geometry.kv_heads, pool.geometry.head_dim
        self.eps = cfg.rms_norm_eps
        inner = model.model
        self.layers = fused_layers(model)
        self.scale = float(getattr(inner.layers[0].self_attn, "scaling", self.d ** -0.5))
        self.embed, self.norm, self.lm_head = inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight
        # HF's own rotary module over every position once: (max_seq, D) in the model dtype, as HF casts it
        dtype = self.embed.dtype
        with torch.no_grad():
            pos = torch.arange(pool.max_seq, device=self.device).unsqueeze(0)  # (1, max_seq)
            cos, sin = inner.rotary_emb(torch.empty(0, dtype=dtype, device=self.device), pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # (max_seq, D)
        # a mixed step's prompt rows attend on a side stream beside its decode rows (CUDA only; a probe turns it
        # off to price it: bench/probes/profile_mixed.py)
        self.side = SideStream(self.device)
        # gemv_rows 0 or gemv "off": cuBLAS at every batch; "on": the GEMV for every projection up to gemv_rows;
        # "auto": where it beats cuBLAS at start. A timing is noisy near the margin, so two processes may pick
        # differently (gate_up, o and lm_head flipped between starts of the same server on one H100) and then give
        # other bits; deterministic mode never lets a timing pick a kernel: two processes (colocated and a pair's
        # decode side) must run the same kernels to give the same bits.
        if gemv not in GEMV_CHOICES:
            raise ValueError(f"--gemv {gemv!r}: choose one of {', '.join(GEMV_CHOICES)}")
        rows = kernels.GEMV_MAX_ROWS if gemv_rows is None else gemv_rows
        if not (rows and self.use_triton) or gemv == "off" or invariant:
            self.gemv_rows = dict.fromkeys(PROJECTIONS, 0)
        elif gemv == "on":
            self.gemv_rows = dict.fromkeys(PROJECTIONS, rows)
        elif torch.are_deterministic_algorithms_enabled():
            self.gemv_rows = dict.fromkeys(PROJECTIONS, 0)
        else:
            self.gemv_rows = pick_gemv(self, rows)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                keep: torch.Tensor | None = None, chunks: tuple[int, torch.Tensor] | None = None,
                on_layer=None) -> torch.Tensor:
        """tokens, positions, slots: (B,) int64 on the device -> logits (B, vocab) in the model dtype.

        Row b feeds `tokens[b]` at position `positions[b]` of slot `slots[b]`: its K/V are written there, and it
        attends over positions 0..positions[b] of that slot. Every row's K/V is written before any row attends,
        so rows of one slot at consecutive positions are a causal prompt chunk (mixed.py rides one along).
        keep: (K,) int64 row indices; only those rows reach the final norm and lm_head -> logits (K, vocab).
        chunks: (d, pieces): rows 0..d-1 decode, rows d.. prompt chunks, pieces (P, 4) int32 (first row counted from
        d, rows, slot, start; kernels.chunk_attention), attending flash style instead of one decode row each. The
        pieces cover every row from d (padding rows as a zero piece, mixed.piece_table): the rows they leave out
        attend to nothing defined.
        on_layer(i): called once layer i's K/V of every row are in the pool (eager only: the invariant prefill
        streams its layers so, kvtransfer/engine/invariant_prefill.py).
        """
        ops, tri, rows = kernels, self.use_triton, self.gemv_rows  # rows: projection -> GEMV up to this batch
        lengths = (positions + 1).to(torch.int32)  # (B,)
        cos, sin = self.cos[positions], self.sin[positions]  # (B, D)

        table = self.pool.table  # (slots + 1, width) int32: a slot's blocks, read in place by the kernels

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kp, vp = self.pool.layer(i)  # (blocks + 1, Hkv, page, D) each
            q = ops.rope_store(q, k, v, cos, sin, kp, vp, slots, positions, use_triton=tri, block_table=table)
            if on_layer is not None:
                on_layer(i)
            if self.invariant:  # every row, a prompt chunk's too, as a decode row of length position + 1
                return ops.decode_attention(q, kp, vp, slots, lengths, self.scale, use_triton=tri, block_table=table,
                                            **kernels.INVARIANT_ATTENTION)  # (B, Hq, D)
            if chunks is None:
                return ops.decode_attention(q, kp, vp, slots, lengths, self.scale, use_triton=tri,
                                            block_table=table)  # (B, Hq, D)
            d, pieces = chunks
            o = torch.empty_like(q)  # (B, Hq, D): rows :d from the decode kernel, d: from the chunk kernel
            if MIXED_ATTENTION == "fused" and ops.mixed_attention_fuses(d, self.hq, self.hkv, self.device,
                                                                        use_triton=tri, max_seq=self.pool.max_seq):
                return ops.mixed_attention(q, kp, vp, d, slots[:d], lengths[:d], pieces, self.scale, use_triton=tri,
                                           block_table=table, out=o)  # one launch (triton_mixed_attention.py)

            def prompt_rows():  # pieces cover every row d.. (padding: a zero piece, mixed.py)
                ops.chunk_attention(q[d:], kp, vp, pieces, self.scale, use_triton=tri, block_table=table, out=o[d:])

            def decode_rows():
                if d:
                    ops.decode_attention(q[:d], kp, vp, slots[:d], lengths[:d], self.scale, use_triton=tri,
                                         block_table=table, out=o[:d])
            beside, then = (prompt_rows, decode_rows) if SIDE_KERNEL == "chunk" else (decode_rows, prompt_rows)
            try:
                with self.side.fork():  # the two kernels at once (side_stream.py)
                    beside()
                then()
            finally:  # joined even when a launch fails: `o` is never freed while the side stream may write it
                self.side.join()
            return o

        def project(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if self.invariant:
                y = ops.invariant_linear(x, w, bias, use_triton=tri)  # (B, N)
                return ops.silu_mul(y, use_triton=tri) if name == "gate_up" else y  # (B, I) or (B, N)
            if name == "gate_up":
                return ops.gate_up_silu(x, w, use_triton=tri, max_rows=rows[name])  # (B, I)
            return ops.linear(x, w, bias, use_triton=tri, max_rows=rows[name])

        h, residual = run_layers(self.layers, self.embed[tokens], self.eps, (self.hq, self.hkv, self.d), attend,
                                 project, use_triton=tri)  # (B, H) each
        if keep is not None:
            h, residual = h[keep], residual[keep]  # (K, H)
        x, _ = ops.add_rms_norm(h, residual, self.norm, self.eps, use_triton=tri)
        if self.invariant:
            return ops.invariant_linear(x, self.lm_head, use_triton=tri)  # (B or K, vocab)
        return ops.linear(x, self.lm_head, use_triton=tri, max_rows=rows["lm_head"])  # (B or K, vocab)


PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
GEMV_MARGIN = 0.05  # the GEMV must be this much faster: near-ties stay on cuBLAS, so noise rarely flips a pick


@torch.inference_mode()
def pick_gemv(runner: StepRunner, rows: int) -> dict[str, int]:
    """Per projection, the batch up to which the Triton GEMV runs: `rows` where it beats cuBLAS by GEMV_MARGIN on
    this device at batch 1, else 0. Timed once at start inside a CUDA graph, as the step runs (eager timing would measure
    Triton's Python launch cost instead), over several layers' weights (more bytes than L2 holds)."""
    layers = runner.layers[: min(8, len(runner.layers))]
    weights = {"qkv": [(w.qkv, w.qkv_bias) for w in layers], "o": [(w.o, w.o_bias) for w in layers],
               "gate_up": [(w.gate_up, None) for w in layers], "down": [(w.down, None) for w in layers],
               "lm_head": [(runner.lm_head, None)]}

    def us(name: str, max_rows: int) -> float:
        ws = weights[name]
        x = torch.zeros(1, ws[0][0].shape[1], dtype=ws[0][0].dtype, device=runner.device)

        def calls():
            for w, b in ws:
                if name == "gate_up":
                    kernels.gate_up_silu(x, w, max_rows=max_rows)
                else:
                    kernels.linear(x, w, b, max_rows=max_rows)
        return graph_us(calls, runner.device) / len(ws)

    picked = {}
    for name in PROJECTIONS:
        cublas, gemv = us(name, 0), us(name, rows)
        picked[name] = rows if gemv < cublas * (1 - GEMV_MARGIN) else 0
        log.info("batch-1 %s: cuBLAS %.1f us, Triton GEMV %.1f us -> %s", name, cublas, gemv,
                 "GEMV" if picked[name] else "cuBLAS")
    return picked


def graph_us(calls, device: torch.device, replays: int = 5) -> float:
    """GPU time of `calls()` captured once as a CUDA graph: the median of `replays` replays, in us."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        calls()  # warm-up outside capture: Triton compiles and autotunes here
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]
