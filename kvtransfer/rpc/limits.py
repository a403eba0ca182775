"""The request limits both servers enforce, in one validator.

Why shared: a prompt the decode server would refuse (longer than the model's context, past
--max-prompt-tokens, a token id outside the vocabulary) must be refused the same way, with the
same words, when it is sent straight to a prefill server; before, the prefill side computed and
pushed a cache the decode side then dropped. The same holds for a request's sampling values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

MAX_REQUEST_ID = (1 << 63) - 1  # the data-plane header carries it as int64
CONTROL_MESSAGE_LIMIT = 4 << 20  # default --max-message-bytes: a 32k-token prompt is < 330 KB
BYTES_PER_TOKEN_ID = 10  # worst case of one packed int64 on the wire
MAX_WAITING = 4096  # the decode server's default --max-waiting: requests that may queue for KV memory


def prompt_problem(token_ids: Sequence[int], max_prompt_tokens: int, context_len: int, vocab: int) -> str | None:
    """What is wrong with this prompt (None: nothing); at least one token must be left to generate."""
    n = len(token_ids)
    if n == 0:
        return "empty prompt: send at least one token id"
    if n > max_prompt_tokens:
        return f"prompt has {n} tokens; this server accepts at most {max_prompt_tokens} (--max-prompt-tokens)"
    if n >= context_len:
        return (f"prompt has {n} tokens; the model's context is {context_len} tokens, "
                "and at least one must be left to generate")
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        return f"token id {bad} outside the vocabulary [0, {vocab})"
    return None


def sampling_problem(temperature: float, top_p: float | None, top_k: int, stop_token_ids: Iterable[int] = (),
                     vocab: int = 0) -> str | None:
    """What is wrong with a request's `sampling` (and its stop_token_ids; None: nothing). top_p None: not set."""
    if not (math.isfinite(temperature) and temperature >= 0):
        return f"sampling.temperature is {temperature}; use a finite value >= 0 (0: greedy)"
    if top_p is not None and not 0 < top_p <= 1:
        return f"sampling.top_p is {top_p}; use a value in (0, 1] (leave it unset for 1: no nucleus cut)"
    if top_k < 0:
        return f"sampling.top_k is {top_k}; use 0 (all tokens) or a positive count"
    bad = next((t for t in stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        return f"stop_token_ids: {bad} outside the vocabulary [0, {vocab})"
    return None


def request_id_problem(rid: int, reserved: int) -> str | None:
    if rid == reserved:
        return f"request_id {reserved} is reserved for the warm-up; use 1..2**63-1"
    if rid > MAX_REQUEST_ID:
        return f"request_id {rid} is over 2**63-1"
    return None


GRPC_MESSAGE_MAX = 2 ** 31 - 1  # gRPC's message limits are C ints: a larger one failed as a Python traceback


def check_message_limit(max_message_bytes: int, max_prompt_tokens: int) -> None:
    """A prompt the server accepts must also fit in one message (0: no prompts here), and gRPC must take the limit;
    refuse a config where either fails."""
    if max_message_bytes > GRPC_MESSAGE_MAX:
        raise ValueError(f"--max-message-bytes {max_message_bytes}: at most {GRPC_MESSAGE_MAX} (gRPC's limit)")
    need = max_prompt_tokens * BYTES_PER_TOKEN_ID + 1024
    if max_message_bytes < need:
        raise ValueError(f"--max-message-bytes {max_message_bytes} is too small for --max-prompt-tokens "
                         f"{max_prompt_tokens}: use at least {need}")


class ConcurrencyLimit:
    """At most `limit` requests at a time; the next one is refused at once (no queue to grow). `limit` None: no
    cap, the requests are only counted (the decode server's default: its admission queue bounds them)."""

    def __init__(self, limit: int | None):
        self.limit, self.count = limit, 0

    def try_enter(self) -> bool:
        if self.limit is not None and self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1

    def refusal(self) -> str:
        return f"{self.count} requests in flight (limit {self.limit}, --max-inflight); retry later"
