"""What an OpenAI request asks of the decode server: the fields checked and turned into a GenerateRequest's.

Why checked here, before any call: a field the proto cannot carry (a seed over 2**64, a token id over int64)
would otherwise fail inside protobuf as a 500, and a field this server does not implement (n > 1, logprobs,
tools) must be refused by name rather than ignored. Limits the decode server enforces itself (prompt length,
vocabulary, --max-new-tokens) are left to it: its INVALID_ARGUMENT says exactly what to fix, and it is the one
that knows. Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 on /v1/completions.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

from api_server.errors import bad_request
from api_server.protocol import ChatCompletionRequest, CompletionRequest
from proto import kvtransfer_pb2 as pb

UINT32_MAX, INT64_MAX, UINT64 = (1 << 32) - 1, (1 << 63) - 1, 1 << 64


@dataclass
class Params:
    """One request's generation settings; `max_tokens` None: as many as the server allows (chat's default)."""

    max_tokens: int | None
    sampling: pb.Sampling
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens_param: str = "max_tokens"  # the client's field that set max_tokens (chat: max_completion_tokens too)

    def request(self, prompt: list[int], max_tokens: int, eos_token_ids: list[int]) -> pb.GenerateRequest:
        """The GenerateRequest; the tokenizer's EOS (a chat template's end of turn) stops it too, unless
        ignore_eos."""
        stops = list(self.stop_token_ids)
        if not self.ignore_eos:
            stops += [t for t in eos_token_ids if t not in stops]
        return pb.GenerateRequest(token_ids=prompt, max_new_tokens=max_tokens, stop_on_eos=not self.ignore_eos,
                                  sampling=self.sampling, stop_token_ids=stops)


def _refuse(what: str, param: str, why: str = "is not supported by this server"):
    raise bad_request(f"{what} {why}", param, code="unsupported_parameter")


def refusals(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Raise 400 naming the first field this server does not implement (when it asks for more than the default)."""
    if req.n not in (None, 1):
        _refuse(f"n={req.n}", "n", "is not supported: this server returns one choice per prompt (n=1)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            _refuse(name, name)
    if req.logit_bias:
        _refuse("logit_bias", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            _refuse("echo", "echo")
        if req.best_of not in (None, 1):
            _refuse(f"best_of={req.best_of}", "best_of")
        if req.suffix:
            _refuse("suffix", "suffix")
        if req.logprobs is not None:
            _refuse("logprobs", "logprobs")
        return
    if req.logprobs or req.top_logprobs:
        _refuse("logprobs", "logprobs" if req.logprobs else "top_logprobs")
    if req.tools or req.functions:
        _refuse("tools/functions (tool calling)", "tools" if req.tools else "functions")
    for name in ("tool_choice", "function_call"):
        if getattr(req, name) not in (None, "none"):
            _refuse(name, name)
    if req.response_format and req.response_format.get("type", "text") != "text":
        _refuse(f"response_format {req.response_format.get('type')!r}", "response_format",
                "is not supported: this server produces plain text")


def params(req: CompletionRequest | ChatCompletionRequest) -> Params:
    refusals(req)
    if isinstance(req, ChatCompletionRequest):
        max_tokens, name = (req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens")
    else:
        max_tokens, name = req.max_tokens, "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{name} is {max_tokens}; use 1 or more (the decode server's --max-new-tokens caps it)",
                          name)
    if max_tokens is not None and max_tokens > UINT32_MAX:
        raise bad_request(f"{name} is {max_tokens}; use at most {UINT32_MAX} (the decode server's --max-new-tokens "
                          "caps it further)", name)
    return Params(max_tokens, sampling(req), stop_strings(req.stop), token_ids(req.stop_token_ids or [],
                                                                                "stop_token_ids"),
                  bool(req.ignore_eos), name)


def _f32(x: float) -> float:
    """x as the decode server holds it (Sampling's fields are 32-bit floats)."""
    return ctypes.c_float(x).value


def sampling(req) -> pb.Sampling:
    t = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(t) or t < 0:
        raise bad_request(f"temperature is {t}; use 0 (greedy) or more", "temperature")
    if not math.isfinite(_f32(t)):
        raise bad_request(f"temperature is {t}, over a 32-bit float's range; use at most 1e38 (any temperature "
                          "over ~100 already draws nearly uniformly)", "temperature")
    out = pb.Sampling(temperature=t)  # one under ~1.4e-45 holds as 0: greedy, its limit
    if req.top_p is not None:
        if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
            raise bad_request(f"top_p is {req.top_p}; use a value in (0, 1]", "top_p")
        if _f32(req.top_p) == 0:
            raise bad_request(f"top_p is {req.top_p}, which a 32-bit float holds as 0; use at least 1e-38 (any "
                              "top_p that small keeps the single most likely token)", "top_p")
        out.top_p = req.top_p
    if req.top_k is not None:
        if not -1 <= req.top_k <= UINT32_MAX:
            raise bad_request(f"top_k is {req.top_k}; use 1 or more, or 0 / -1 for all tokens", "top_k")
        out.top_k = max(req.top_k, 0)
    if req.seed is not None:
        if not -(1 << 63) <= req.seed < UINT64:
            raise bad_request(f"seed {req.seed} does not fit 64 bits", "seed")
        out.seed = req.seed % UINT64  # a negative seed: its two's complement, one seed per int64
    return out


def stop_strings(stop: str | list[str] | None) -> list[str]:
    out = [stop] if isinstance(stop, str) else stop or []
    if any(s == "" for s in out):
        raise bad_request("stop holds an empty string, which would end every answer before its first character: "
                          "remove it", "stop")
    return out


def token_ids(ids: list[int], param: str, low: int = 0) -> list[int]:
    """Ids that fit the proto's int64; whether a prompt's are in the vocabulary is the decode server's to say
    (`low` -2**63: its message names the vocabulary's range)."""
    bad = next((t for t in ids if not low <= t <= INT64_MAX), None)
    if bad is not None:
        raise bad_request(f"{param}: {bad} is not a token id (ids are 0 .. the vocabulary's size - 1)", param)
    return ids
