"""The prefill worker's prompt in the batch-invariant mode: the decode step's own rows, not the whole-prompt forward.

Why: in the mode (--batch-invariant, docs/batch-invariance.md) the decode server prefills a prompt in its steps,
every prompt row computed as a decode row of length position + 1 by batch-invariant ops (runner.py). A cache
that is to decode the same bits on the decode worker must come from those same ops, not from the fused prefill's
whole-prompt GEMMs and attention (other sum orders). So the prefill worker runs the prompt through a StepRunner
of its own, in invariant mode, over a one-row pool in the slot layout: the rows write their K/V there and the last
row's logits choose the first token, as the decode server's last prompt row would.
"""

from __future__ import annotations

import torch

from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner
from kvtransfer.model.loaded import LoadedModel

ROWS_PER_FORWARD = 512  # a long prompt in pieces (the activations of one forward stay bounded; the bits do not move)


class InvariantPrefill:
    def __init__(self, loaded: LoadedModel, max_tokens: int):
        """A pool of one row of `max_tokens` positions (the longest prompt this worker takes)."""
        self.pool = KVPool(loaded.geometry, loaded.device, slots=1, max_seq=max(2, max_tokens))
        self.runner = StepRunner(loaded.model, self.pool, invariant=True)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, on_layer=None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """ids (1, n) on the device -> (per layer (k, v), each (1, kv_heads, n, head_dim), views of the pool valid
        until the next call; the last position's logits (vocab,)). `on_layer(i, k, v)`: each layer as soon as its
        K/V are complete, in the last piece's forward (layer-wise streaming; ordered after their writes on the
        current stream)."""
        tokens = ids[0]  # (n,)
        n, dev = tokens.shape[0], tokens.device
        if n > self.pool.max_seq:
            raise ValueError(f"{n} prompt tokens: over this worker's {self.pool.max_seq} (--max-prompt-tokens)")
        logits, layers = None, self.pool.views(0, n)
        for a in range(0, n, ROWS_PER_FORWARD):
            b = min(n, a + ROWS_PER_FORWARD)
            positions = torch.arange(a, b, device=dev)  # (rows,)
            slots = torch.zeros(b - a, dtype=torch.long, device=dev)
            keep = torch.tensor([b - a - 1], device=dev) if b == n else None
            hook = (lambda i: on_layer(i, *layers[i])) if on_layer is not None and b == n else None
            out = self.runner.forward(tokens[a:b], positions, slots, keep, on_layer=hook)  # (1 or rows, vocab)
            logits = out[-1]
        return layers, logits
