"""The batch-invariant step on a GPU (issue #40): a request's logits are the same bits alone and in any batch.

The engine-level form of tests/test_batch_invariant.py (which runs real servers on CPU), on qwen2.5-7b shapes in
bf16 with the Triton kernels: StepRunner(invariant=True) runs the fixed-tile GEMM (kvtransfer/kernels/
triton_matmul.py) and the decode attention cut at a fixed split size (ops.INVARIANT_ATTENTION). One target prompt
is prefilled as the step's rows and decoded 8 steps:
- alone: the whole prompt in one forward, then steps of one row;
- beside 7 neighbours: the prompt in pieces of 32 rows, each in a forward with pieces of the neighbours' prompts,
  then steps of 8 rows (the target in the middle);
- beside 63 neighbours, the steps replayed from CUDA graphs (graphs.Step, the 64-row bucket).
Every logits row of the target (its first token's and each step's) must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.engine.graphs import Step
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner
from kvtransfer.geometry import CacheGeometry
from kvtransfer.kernels import ops
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS, PROMPT, PIECE = 8, 300, 32


@pytest.fixture(scope="module")
def runner():
    if not ops.INVARIANT_ATTENTION:
        pytest.fail("ops.INVARIANT_ATTENTION is empty: the mode has no fixed-split attention on CUDA")
    model = load_model(ModelSpec("qwen2.5-7b", "bfloat16", 0), "cuda")
    pool = KVPool(CacheGeometry.from_config(model.config, torch.bfloat16), torch.device("cuda"), 64, 1024)
    return StepRunner(model, pool, invariant=True)


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 600, (n,), generator=g).tolist()
    return [random_prompt(152000, m, seed=seed * 100 + i, device="cuda")[0] for i, m in enumerate(lengths)]


def prefill(runner, rows: list[tuple[int, torch.Tensor]], piece: int) -> dict[int, torch.Tensor]:
    """Prompts (slot, ids (n,)) as the step's rows, `piece` rows of each prompt per forward, all prompts' pieces in
    the same forwards; -> each slot's last-row logits (vocab,)."""
    out, at = {}, 0
    while any(at < ids.shape[0] for _, ids in rows):
        toks, pos, slots, keep, ends = [], [], [], [], []
        for slot, ids in rows:
            b = min(ids.shape[0], at + piece)
            if at >= b:
                continue
            toks.append(ids[at:b])
            pos.append(torch.arange(at, b, device="cuda"))
            slots.append(torch.full((b - at,), slot, device="cuda"))
            if b == ids.shape[0]:
                keep.append(sum(t.shape[0] for t in toks) - 1)
                ends.append(slot)
        logits = runner.forward(torch.cat(toks), torch.cat(pos), torch.cat(slots),
                                torch.tensor(keep, device="cuda") if keep else None)
        for j, slot in enumerate(ends):
            out[slot] = logits[j].clone()
        at += piece
    return out


def decode(step, rows: list[tuple[int, int]], first: dict[int, torch.Tensor], target: int) -> list[torch.Tensor]:
    """STEPS greedy steps of every row (slot, its prompt length); the target slot's logits rows."""
    tokens = torch.stack([first[s].argmax() for s, _ in rows])
    positions = torch.tensor([n for _, n in rows], device="cuda")
    slots = torch.tensor([s for s, _ in rows], device="cuda")
    at, got = [s for s, _ in rows].index(target), []
    for _ in range(STEPS):
        logits = step(tokens, positions, slots)  # (B, vocab)
        got.append(logits[at].clone())
        tokens, positions = logits.argmax(-1), positions + 1
    return got


def test_a_row_is_the_same_bits_alone_and_beside_7_and_63_neighbours(runner):
    target = prompts(1, 7)[0][:PROMPT]
    first = prefill(runner, [(0, target)], 512)
    alone = [first[0], *decode(runner.forward, [(0, PROMPT)], first, 0)]
    for n, graphs in ((7, False), (63, True)):
        others = prompts(n, n)
        rows = [(1 + i, ids) for i, ids in enumerate(others)]
        rows.insert(n // 2, (0, target))  # slot 0 again: its positions are rewritten, the same bytes
        first = prefill(runner, rows, PIECE)
        step = Step(runner, 64, cuda_graphs=True) if graphs else runner.forward
        crowded = [first[0], *decode(step, [(s, ids.shape[0]) for s, ids in rows], first, 0)]
        for i, (a, b) in enumerate(zip(alone, crowded)):
            assert torch.equal(a, b), f"beside {n}: logits row {i} differs (max {float((a - b).abs().max()):g})"
