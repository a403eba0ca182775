"""Where the next token is chosen: from a step's logits to each row's next token, on the device.

Why a file of its own: the choice is made in three places that must agree, or a request would decode
differently colocated and disaggregated: the decode step's rows (queued.py, gathered on the device for the
step after, with no host sync), a prompt's first token at the end of a local prefill (engine.py, mixed.py's
last chunk) and at the end of a remote one (the prefill worker). Today the choice is greedy (argmax; ties go
to the lowest id, as in HF's greedy search).
"""

from __future__ import annotations

import torch


def next_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits (n, vocab) -> (n,) int64 on the same device; no host sync."""
    return logits.argmax(dim=-1)


def first_token(logits: torch.Tensor) -> torch.Tensor:
    """A prompt's last-row logits (vocab,) or (1, vocab) -> its first generated token, a 0-d int64 tensor."""
    return logits.reshape(-1).argmax()
