"""The decode step captured as CUDA graphs, one per bucketed batch size (nano-vllm's scheme).

Why: eagerly, the step launches a few hundred kernels from Python and the host, not the GPU,
sets the pace. A graph replays them in one call. Shapes must be static, so batches are padded
up to the next bucket (1, 2, 4, 8, then every 16): padding rows feed token 0 at position 0 of
the pool's scratch slot. Captured eagerly at start-up (time and memory logged) rather than
lazily: the first request must not pay a capture, and a capture that fails should fail the
start, not a request. All graphs share one memory pool, largest first.
"""

from __future__ import annotations

import logging
import time

import torch

from .runner import StepRunner

log = logging.getLogger("kvtransfer.decode.graphs")


def buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


class Step:
    """`step(tokens, positions, slots)` -> logits (n, vocab): eager (CPU, --no-cuda-graphs) or graph replay.

    The graphed logits are a view into the graph's output buffer: valid until the next call.
    """

    def __init__(self, runner: StepRunner, max_batch: int, cuda_graphs: bool):
        self.runner, self.max_batch = runner, max_batch
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buckets = buckets(max_batch)
        if cuda_graphs and runner.device.type == "cuda":
            self._capture()

    def _inputs(self) -> None:
        dev = self.runner.device
        self.tokens = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((self.max_batch,), self.runner.pool.scratch, dtype=torch.long, device=dev)

    def _capture(self) -> None:
        self._inputs()
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        before, t0 = torch.cuda.memory_allocated(dev), time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up off the default stream (Triton compiles here), as capture wants
            for _ in range(2):
                self.runner.forward(self.tokens, self.positions, self.slots)
        torch.cuda.current_stream(dev).wait_stream(side)
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                out = self.runner.forward(self.tokens[:b], self.positions[:b], self.slots[:b])
            self.graphs[b] = (g, out)
        torch.cuda.synchronize(dev)
        log.info("captured %d decode-step CUDA graphs (batch %s) in %.1f s, %.0f MiB", len(self.graphs),
                 ",".join(map(str, self.buckets)), time.perf_counter() - t0,
                 (torch.cuda.memory_allocated(dev) - before) / 2**20)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        if not self.graphs:
            return self.runner.forward(tokens, positions, slots)
        b = next(x for x in self.buckets if x >= n)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        if b > n:  # padding rows: scratch slot, position 0
            self.tokens[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.runner.pool.scratch)
        g, out = self.graphs[b]
        g.replay()
        return out[:n]
