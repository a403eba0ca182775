"""Prefill chunks that ride in a decode step (Sarathi-Serve's piggybacking): one forward for both.

Why: with prompts far longer than their answers, a separate prefill forward and a separate decode
step each read all the weights, and the prefills cap the serving rate (README, "What bounds this").
A chunk of c prompt tokens and the B decode
rows share every GEMM instead: the step costs max(compute of c + B rows, one read of the
weights), so the decode rows ride nearly free while a prefill is in progress.

A step has at most --prefill-chunk rows, its decode rows included (Sarathi-Serve's token budget): the
rows left carry the next chunk of the prompt in progress, and when that ends short of them, the first
chunk of the next prompt too (up to MAX_PIECES prompts a step), so no graph row is padding while
prompts wait. When fewer prompt tokens wait than the budget leaves, the step takes the smallest size
of a ladder (--prefill-chunk / 2, / 4 .. down to MIN_STEP_ROWS) that holds them all: it pays for the
rows it has.
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
(graphs.py): eagerly, the host's launches, not the GPU, would set its pace.
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
from kvtransfer.engine.sampler import SamplingParams

MAX_PIECES = 4  # prompt chunks in one step (each keeps one row for lm_head)
MIN_STEP_ROWS = 128  # the smallest mixed step below --prefill-chunk: under it a 7B step is bound by the weights' read


def step_sizes(rows: int, max_rows: int) -> list[int]:
    """The mixed steps' row counts, ascending: rows / 2, rows / 4 .. down to MIN_STEP_ROWS (a step with little
    prompt work pays for the rows it has, not for `rows`), rows, then 2 x rows, 4 x rows .. up to max_rows."""
    out = [rows]
    while out[0] % 2 == 0 and out[0] // 2 >= MIN_STEP_ROWS:
        out.insert(0, out[0] // 2)
    while out[-1] * 2 <= max_rows:
        out.append(out[-1] * 2)
    return out


@dataclass
class Chunk:
    ids: torch.Tensor  # (c,) int64 on the device
    slot: int
    start: int  # positions start .. start + c - 1
    last: bool  # the prompt's final chunk: its last row's logits give the first token


@dataclass
class PromptRows:
    """The prompt chunks' rows of one mixed step from row n, after its n decode rows (the one layout both the eager
    step and its CUDA graphs use). A graph has b >= n decode rows (its bucket): the b - n rows the batch leaves
    free take the first prompt tokens, attending as decode rows (a prompt row at position p is a decode row of
    length p + 1 of its slot: the same attention, by the decode kernel), and the rest follow from row b, attending
    through the chunk kernel; what is left is padding."""

    tokens: torch.Tensor  # (b - n + rows,) int64: the chunks' ids one after another, then padding (token 0)
    positions: torch.Tensor  # (b - n + rows,) int64: each chunk's start .. start + c - 1, then 0
    slots: torch.Tensor  # (b - n + rows,) int64: each chunk's slot, then the scratch slot
    keep: torch.Tensor  # (b + pieces,) int64: rows 0 .. b - 1, then each chunk's last row (unused: the last row)
    table: torch.Tensor  # (pieces + 1, 4) int32: the rows from b, what kernels.chunk_attention reads (piece_table)


def lay_out(chunks: list[Chunk], n: int, b: int, rows: int, pieces: int, scratch: int) -> PromptRows:
    """The rows of `chunks` from row n (n decode rows, b >= n of them in the step's graph), padded to b + `rows`
    rows and `pieces` pieces (b - n + rows >= their tokens, pieces >= len(chunks)). Built on the host; the caller
    moves them to the device."""
    sizes = [c.ids.shape[0] for c in chunks]
    total, span = sum(sizes), b - n + rows
    dev = chunks[0].ids.device
    tokens = torch.cat([*(c.ids for c in chunks), torch.zeros(span - total, dtype=torch.long, device=dev)])
    positions, slots = torch.zeros(span, dtype=torch.long), torch.full((span,), scratch, dtype=torch.long)
    keep, at = list(range(b)), 0
    for c, size in zip(chunks, sizes):
        positions[at:at + size] = torch.arange(c.start, c.start + size)
        slots[at:at + size] = c.slot
        at += size
        keep.append(n + at - 1)
    keep += [b + rows - 1] * (pieces - len(chunks))  # unused pieces: a padding (or the last chunk's) row
    return PromptRows(tokens, positions, slots, torch.tensor(keep, dtype=torch.long),
                      piece_table(chunks, pieces, rows, b - n))


@torch.inference_mode()
def mixed_forward(r: StepRunner, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/positions/slots: (B,) decode rows (B may be 0); chunks: P pieces of prompts, each c_j tokens into its
    slot. Eager, unpadded. Returns (decode logits (B, vocab), each chunk's last-row logits (P, vocab))."""
    b, dev = tokens.shape[0], tokens.device
    p = lay_out(chunks, b, b, sum(c.ids.shape[0] for c in chunks), len(chunks), r.pool.scratch)
    logits = r.forward(torch.cat([tokens, p.tokens]),  # (B + sum c_j,)
                       torch.cat([positions, p.positions.to(dev, non_blocking=True)]),
                       torch.cat([slots, p.slots.to(dev, non_blocking=True)]),
                       p.keep.to(dev, non_blocking=True), (b, p.table.to(dev, non_blocking=True)))  # (B + P, vocab)
    return logits[:b], logits[b:]


def piece_table(chunks: list[Chunk], pieces: int, rows: int, skip: int = 0) -> torch.Tensor:
    """(pieces + 1, 4) int32 on the host, what kernels.chunk_attention reads over `rows` rows: the chunks laid out
    one after another, their first `skip` tokens left out (rows before these, attending as decode rows: lay_out),
    one row per chunk (first row, rows, slot, start; a chunk wholly left out: 0 rows), then unused pieces (0 rows),
    then the padding up to `rows` rows (slot -1: rows the kernel zeroes, so the step's attention output needs no
    fill of its own)."""
    table, at = torch.zeros(pieces + 1, 4, dtype=torch.int32), -skip
    for j, c in enumerate(chunks):
        n = c.ids.shape[0]
        cut = min(n, max(0, -at))  # its tokens before row 0
        table[j] = torch.tensor([max(at, 0), n - cut, c.slot, c.start + cut], dtype=torch.int32)
        at += n
    at = max(at, 0)
    table[pieces] = torch.tensor([at, rows - at, -1, 0], dtype=torch.int32)
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
    sampling: SamplingParams | None = None  # how its first token is chosen (None: greedy; at position len(ids))

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
