"""The colocated reference run the tests compare against: prefill then greedy decode on one device.

Why here and not in the package: no server runs prefill and the HF decode back to back on one cache; the tests
do, as the baseline every disaggregated run must equal token for token and logit for logit.
"""

from __future__ import annotations

import torch

from bench.measure.reference_decode import Generation, decode
from kvtransfer.model.prefill import prefill
from kvtransfer.model.streaming import StreamingCache


def colocated_generate(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[Generation, StreamingCache]:
    """Prefill + decode on one device. Returns the generation and the final cache."""
    cache, first = prefill(model, input_ids)
    return decode(model, cache, first, max_new_tokens), cache
