"""OpenAI's request and response shapes, with OpenAI's field names (and vLLM's extensions: top_k, stop_token_ids,
ignore_eos, return_token_ids).

Why every refused field is declared here instead of left unknown: a client that asks for `n=2` or `logprobs`
must hear that this server does not do it (400 naming the field, api_server/params.py), not get one plain answer
as if it had. Fields no field here names are ignored, as vLLM ignores them. Every field is strict (pydantic's
strict mode: an int is a number, nothing else is coerced): `"max_tokens": "8"` or `"stream": "yes"` is a client
bug to be told about (400 naming the field), not a guess to act on, and a prompt of strings is never read as ids.
Responses are plain dicts built here: a stream of 32 requests sends one chunk per token each, and the front's
event loop has better things to do than validate its own output.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False


class _Sampled(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM: 0 or -1 for all tokens
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM
    ignore_eos: bool | None = False  # vLLM; the inverse of GenerateRequest.stop_on_eos (null: false, as every flag)
    return_token_ids: bool | None = False  # vLLM: each choice also carries its generated ids
    stream: bool | None = False  # OpenAI's schema: boolean or null
    stream_options: StreamOptions | None = None
    user: str | None = None
    # refused unless trivial (params.refusals)
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampled):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = 16
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id ...: to the chat template as given
    role: str
    content: str | list[dict[str, Any]]  # required, as OpenAI's: a message without it is a client's bug


class ChatCompletionRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    out = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    out = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
           "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def chat_delta(index: int, delta: dict, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    out = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict], use: dict | None = None) -> dict:
    """`kind`: text_completion, chat.completion or chat.completion.chunk."""
    out = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
