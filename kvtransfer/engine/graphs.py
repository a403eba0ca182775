"""The decode step captured as CUDA graphs, one per bucketed batch size (nano-vllm's scheme).

Why: eagerly, the step launches a few hundred kernels from Python and the host, not the GPU,
sets the pace. A graph replays them in one call. Shapes must be static, so batches are padded
up to the next bucket (1, 2, 4, 8, then every 16): padding rows feed token 0 at position 0 of
the pool's scratch slot. Captured eagerly at start-up (time and memory logged) rather than
lazily: the first request must not pay a capture, and a capture that fails should fail the
start, not a request. All graphs share one memory pool, largest first.

With --mixed-prefill there are more graphs per bucket b, one per step size c >= 2 b (mixed.step_sizes: a
ladder up to --prefill-chunk rows, the step's token budget): the b decode rows and then prompt chunks in the
rest (mixed.py: up to MAX_PIECES prompts, padded when they fall short). The b - n rows a batch of n leaves in
its bucket take the first prompt tokens (attending as decode rows, mixed.lay_out), so no bucket padding is paid
for while prompts wait. The graph keeps the bucket's rows and
MAX_PIECES more for lm_head (each chunk's last row; unused ones point at a padding row). Padding rows write and
read only the scratch slot. The size counts the decode rows, because the GEMMs are compute bound there and run
in 128-row tiles: 16 decode rows + 256 prompt rows would pay for 384.
A step takes the smallest size that holds every prompt token waiting, within the budget; when more wait, the
largest size they fill (with --mixed-max-rows, up to 2, 4 .. x --prefill-chunk rows): `prompt_budget`.
Eagerly, a mixed step is host bound (its launches cost the same at any row count), so every size is a graph.

The step's draw (sampler.py, `Sampler`) has graphs of its own, one per bucket (and bucket + MAX_PIECES rows with
--mixed-prefill, for the first tokens of prompts whose last chunk rode along), replayed after the step only when a
row samples; those of the plain step's buckets read its graph's logits buffer in place. A step of greedy rows takes
argmax outside any graph, as before sampling existed.
"""

from __future__ import annotations

import logging
import time

import torch

from kvtransfer.engine.mixed import MAX_PIECES, Chunk, lay_out, mixed_forward, step_sizes
from kvtransfer.engine.runner import StepRunner
from kvtransfer.engine.sampler import Sampler

log = logging.getLogger("kvtransfer.decode.graphs")


def buckets(max_batch: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(out + [max_batch]))


class Step:
    """`step(tokens, positions, slots)` -> logits (n, vocab): eager (CPU, --no-cuda-graphs) or graph replay.
    `step.mixed(tokens, positions, slots, chunks)` -> (logits (n, vocab), each chunk's last row (P, vocab)): the
    same step with prompt tokens riding along in P <= MAX_PIECES chunks, in the smallest of `sizes` (a ladder up to
    `chunk` rows, then 2, 4 .. x chunk) that holds them beside the bucket (graphed when `chunk` > 0;
    `prompt_budget` says how many to hand it).

    The graphed logits are a view into the graph's output buffer: valid until the next call. `step.sampler` draws
    the sampling rows' tokens from them (captured per bucket too, unless `sampling` is False: then always eager).
    """

    def __init__(self, runner: StepRunner, max_batch: int, cuda_graphs: bool, chunk: int = 0, max_rows: int = 0,
                 sampling: bool = True, staged: bool = False):
        """staged: without graphs, run mixed steps eagerly in the graphs' padded layout (buckets, sizes, the rows a
        bucket leaves taking prompt tokens), as tests on CPU check it; off, an eager mixed step is unpadded."""
        self.runner, self.max_batch, self.chunk = runner, max_batch, chunk
        self.sizes = step_sizes(chunk, max_rows) if chunk else []  # the mixed steps' row counts, ascending
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mixed_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (rows, bucket)
        self.buckets = buckets(max_batch)
        self.staged = False
        self.replayed: torch.cuda.Event | None = None  # the last call's event before its replay (None: eager)
        if cuda_graphs and runner.device.type == "cuda":
            self._capture()
        elif staged and chunk:
            self._inputs()
            self.staged = True
        vocab, dtype = runner.lm_head.shape[0], runner.lm_head.dtype
        rows = buckets(max_batch + MAX_PIECES) if chunk else self.buckets  # decode rows (+ finished prompts)
        self.sampler = Sampler(vocab, dtype, runner.device, rows if sampling else [], cuda_graphs,
                               {b: out for b, (_, out) in self.graphs.items()})  # draws read these in place

    def _inputs(self) -> None:
        dev, rows = self.runner.device, max([self.max_batch, *self.sizes])
        self.tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.slots = torch.full((rows,), self.runner.pool.scratch, dtype=torch.long, device=dev)
        self.keep = torch.zeros(self.max_batch + MAX_PIECES, dtype=torch.long, device=dev)
        self.pieces = torch.zeros(MAX_PIECES + 1, 4, dtype=torch.int32, device=dev)  # mixed.piece_table: the chunks'

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
                self.runner.forward(self.tokens[:self.max_batch], self.positions[:self.max_batch],
                                    self.slots[:self.max_batch])
                for c in self.sizes:  # one decode row, then c - 1 padding rows (a zero piece: every row written)
                    self.pieces[MAX_PIECES] = torch.tensor([0, c - 1, -1, 0], dtype=torch.int32)
                    self.runner.forward(self.tokens[:c], self.positions[:c], self.slots[:c], self.keep,
                                        (1, self.pieces))
        torch.cuda.current_stream(dev).wait_stream(side)
        for c in reversed(self.sizes):  # the largest graphs first: they size the shared pool
            for b in reversed(self._beside(c)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=mempool):
                    out = self.runner.forward(self.tokens[:c], self.positions[:c], self.slots[:c],
                                              self.keep[:b + MAX_PIECES], (b, self.pieces))
                self.mixed_graphs[c, b] = (g, out)
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                out = self.runner.forward(self.tokens[:b], self.positions[:b], self.slots[:b])
            self.graphs[b] = (g, out)
        torch.cuda.synchronize(dev)
        log.info("captured %d decode-step CUDA graphs (batch %s%s) in %.1f s, %.0f MiB",
                 len(self.graphs) + len(self.mixed_graphs), ",".join(map(str, self.buckets)),
                 f"; each also as {'/'.join(map(str, self.sizes))} rows with prompt chunks" if self.sizes else "",
                 time.perf_counter() - t0,
                 (torch.cuda.memory_allocated(dev) - before) / 2**20)

    def bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    def _beside(self, c: int) -> list[int]:
        """The buckets a step of c rows has a graph for: at most half its rows decode (as --prefill-chunk >= 2 x
        --max-batch), so a small step of the ladder is never mostly decode rows."""
        return [b for b in self.buckets if 2 * b <= c]

    def _sizes(self, b: int) -> list[int]:
        return [c for c in self.sizes if 2 * b <= c]

    def prompt_budget(self, n: int, waiting: int) -> int:
        """Prompt tokens a mixed step beside n decode rows (bucket b) carries while `waiting` prompt tokens wait:
        all of them in the smallest size that holds them, when the budget (--prefill-chunk rows) does; else the
        rows left in the largest size they fill. The rows the bucket leaves after the n decode rows carry prompt
        tokens too (lay_out), so a step of c rows has c - n for them. Only a step that takes every waiting token is
        padded."""
        if not self.chunk:
            return 0
        sizes = self._sizes(self.bucket(n))  # never empty: --prefill-chunk >= 2 x --max-batch
        if n + waiting <= self.chunk:
            return next(c for c in sizes if c - n >= waiting) - n
        return max(c for c in sizes if c - n <= waiting) - n

    def rows_for(self, n: int, prompt_rows: int) -> int:
        """The mixed step size that carries `prompt_rows` beside n decode rows: the smallest with room (0: none)."""
        return next((c for c in self._sizes(self.bucket(n)) if prompt_rows <= c - n), 0)

    def _fill(self, n: int, b: int, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows 0..n-1 of the input buffers from the caller's, rows n..b-1 padding (scratch slot, position 0)."""
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        if b > n:
            self.tokens[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.runner.pool.scratch)

    def _replay(self, g: torch.cuda.CUDAGraph) -> None:
        """Replay `g` after an event (`replayed`): from a step's start event to it, the device ran the input copies
        and waited for the host to launch them; the graph's own work comes after (queued.StepStats.staging_s)."""
        if self.runner.device.type == "cuda":  # (a probe's stand-in for a graph replays on CPU: no event)
            self.replayed = torch.cuda.Event(enable_timing=True)
            self.replayed.record()
        g.replay()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        n, self.replayed = tokens.shape[0], None  # None: this step ran eagerly
        if not self.graphs:
            return self.runner.forward(tokens, positions, slots)
        b = self.bucket(n)
        self._fill(n, b, tokens, positions, slots)
        g, out = self.graphs[b]
        self._replay(g)
        return out[:n]

    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        n, self.replayed = tokens.shape[0], None  # None: this step ran eagerly
        rows = self.rows_for(n, sum(c.ids.shape[0] for c in chunks))
        if not (self.mixed_graphs or self.staged) or not rows or len(chunks) > MAX_PIECES:
            return mixed_forward(self.runner, tokens, positions, slots, chunks)
        b = self.bucket(n)
        self._fill(n, n, tokens, positions, slots)
        p = lay_out(chunks, n, b, rows - b, MAX_PIECES, self.runner.pool.scratch)  # rows n .. rows - 1
        self.tokens[n:rows].copy_(p.tokens, non_blocking=True)
        self.positions[n:rows].copy_(p.positions, non_blocking=True)
        self.slots[n:rows].copy_(p.slots, non_blocking=True)
        self.keep[:b + MAX_PIECES].copy_(p.keep, non_blocking=True)
        self.pieces.copy_(p.table, non_blocking=True)
        if self.mixed_graphs:
            g, out = self.mixed_graphs[rows, b]
            self._replay(g)
        else:  # staged: what the graph would replay, eagerly (the CPU tests' view of the graphs' layout)
            out = self.runner.forward(self.tokens[:rows], self.positions[:rows], self.slots[:rows],
                                      self.keep[:b + MAX_PIECES], (b, self.pieces))
        return out[:n], out[b:b + len(chunks)]
