"""Prefill chunks that ride in a decode step (Sarathi-Serve's piggybacking): one forward for both.

Why: with ~1k-token prompts and 128 output tokens, a separate prefill forward and a separate
decode step each read all the weights; at concurrency 32 that caps one H200 at ~13x the
one-at-a-time baseline (README, "What bounds this"). A chunk of c prompt tokens and the B decode
rows share every GEMM instead: the step costs max(compute of c + B rows, one read of the
weights), so the decode rows ride nearly free while a prefill is in progress.

A step has --prefill-chunk rows in all, its decode rows included (Sarathi-Serve's token budget): the
rows left carry the next chunk of the prompt in progress, and when that ends short of them, the first
chunk of the next prompt too (up to MAX_PIECES prompts a step), so no graph row is padding while
prompts wait.
With --mixed-max-rows N there are larger steps too (2, 4 .. x --prefill-chunk rows, up to N, each its
own graph): a step takes the largest size that the prompt tokens waiting fill, so a burst of arrivals
drains in fewer, fuller steps and its requests join the batch sooner; when few wait, the smallest size.
A chunk needs nothing new from the step: c prompt tokens at positions start..start + c - 1 of one
slot are c more rows of it. The step writes every row's K/V before any row attends, and each row
attends over positions 0..its own of its slot, which for the chunk's rows is exactly causal
attention after the chunk's past; the chunks' rows attend flash style (kernels.chunk_attention:
each K/V tile read once for 64 rows, where the decode kernel would stream the slot once per row).
`mixed_forward` runs the step over the B decode rows plus the chunks' rows and keeps only the
decode rows and each chunk's last row for the final norm and lm_head. Being the step, it is
captured as CUDA graphs, one per (step size, batch bucket), the chunks padded to the size
(graphs.py): eagerly, the host's launches, not the GPU, would set its pace (~22 ms for the 7B
model at any size up to ~1k rows, measured).
`MixedPrefill` is one prompt's progress through its chunks.

What it equals: decode rows within the batching tolerance of the plain step; a prompt's cache
and first logits within the chunked-prefill tolerance of a whole prefill (tests/test_mixed.py).
A prompt that fits one chunk while nothing decodes takes the plain fused prefill instead, so a
request alone stays bit-identical between colocated and disaggregated.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvtransfer.engine.pool import Lease
from kvtransfer.engine.runner import StepRunner

MAX_PIECES = 4  # prompt chunks in one step (each keeps one row for lm_head)


def check_mixed_rows(rows: int, max_batch: int, max_rows: int = 0) -> None:
    """A mixed step of `rows` rows must leave room for prompt rows beside a full batch; larger sizes double it."""
    if rows < 2 * max_batch:
        raise ValueError(f"--prefill-chunk {rows} with --mixed-prefill is the rows of a step, decode rows included: "
                         f"it must be >= 2 x --max-batch ({2 * max_batch})")
    if max_rows and max_rows < 2 * rows:
        raise ValueError(f"--mixed-max-rows {max_rows} must be >= 2 x --prefill-chunk ({2 * rows}): the larger steps "
                         "are 2, 4 .. x --prefill-chunk rows (0: --prefill-chunk only)")


def step_sizes(rows: int, max_rows: int) -> list[int]:
    """The mixed steps' row counts: rows, 2 x rows, 4 x rows .. up to max_rows."""
    out = [rows]
    while out[-1] * 2 <= max_rows:
        out.append(out[-1] * 2)
    return out


@dataclass
class Chunk:
    ids: torch.Tensor  # (c,) int64 on the device
    slot: int
    start: int  # positions start .. start + c - 1
    last: bool  # the prompt's final chunk: its last row's logits give the first token


@torch.inference_mode()
def mixed_forward(r: StepRunner, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/positions/slots: (B,) decode rows (B may be 0); chunks: P pieces of prompts, each c_j tokens into its
    slot. Eager. Returns (decode logits (B, vocab), each chunk's last-row logits (P, vocab))."""
    b, dev = tokens.shape[0], tokens.device
    ends = torch.tensor([c.ids.shape[0] for c in chunks]).cumsum(0) + b - 1  # each chunk's last row
    keep = torch.cat([torch.arange(b), ends]).to(dev, non_blocking=True)  # (B + P,)
    pieces = piece_table(chunks, len(chunks)).to(dev, non_blocking=True)  # (P, 4)
    logits = r.forward(torch.cat([tokens, *(c.ids for c in chunks)]),  # (B + sum c_j,)
                       torch.cat([positions, *(torch.arange(c.start, c.start + c.ids.shape[0], device=dev)
                                               for c in chunks)]),
                       torch.cat([slots, *(torch.full((c.ids.shape[0],), c.slot, dtype=torch.long, device=dev)
                                           for c in chunks)]),
                       keep, (b, pieces))  # (B + P, vocab)
    return logits[:b], logits[b:]


def piece_table(chunks: list[Chunk], rows: int) -> torch.Tensor:
    """(rows, 4) int32 on the host, one row per chunk laid out one after another: first row, rows, slot, start;
    then unused pieces (0 rows). What kernels.chunk_attention reads."""
    table, at = torch.zeros(rows, 4, dtype=torch.int32), 0
    for j, c in enumerate(chunks):
        n = c.ids.shape[0]
        table[j] = torch.tensor([at, n, c.slot, c.start], dtype=torch.int32)
        at += n
    return table


@dataclass
class MixedPrefill:
    """One prompt's chunks, handed out one per step; the future resolves with LocalPrefill after the last."""

    ids: torch.Tensor  # (n,) int64 on the device
    lease: Lease
    want_digest: bool
    future: Future = field(default_factory=Future)
    start: int = 0
    t0: float = field(default_factory=time.perf_counter)  # reset when its first chunk goes (scheduler)

    def next_chunk(self, budget: int) -> Chunk:
        """The next chunk: at most `budget` tokens (the step's prompt rows still free)."""
        end = min(self.ids.shape[0], self.start + budget)
        c = Chunk(self.ids[self.start:end], self.lease.slot, self.start, end == self.ids.shape[0])
        self.start = end
        return c

    @property
    def left(self) -> int:
        """Prompt tokens not yet handed out."""
        return self.ids.shape[0] - self.start

    @property
    def handed_out(self) -> bool:
        return self.start >= self.ids.shape[0]
