"""A request's prompts as token ids: text through the tokenizer, chat messages through its template, token ids as
they are; with the checks that must come before any of it.

Why long texts are tokenized off the event loop: the front is one event loop serving every request, and a prompt
of a few MiB takes seconds to tokenize; on the loop, every other request (a one-word prompt, /health) would wait
those seconds. In a worker thread the tokenizers library releases the GIL while it encodes, so the loop serves on;
a short text is tokenized in place, where a thread hop would cost more than the encoding. At most
LONG_TEXTS_AT_ONCE long texts are tokenized at a time, the others wait their turn: a tokenizer holds tens of bytes
per character of its text while it works (a new-user pass sent 30 bodies of 3 MB text at once: 3.4 GB of memory,
kept by the allocator afterwards, and seconds of every core), whatever the prompt-length check then says.

Why a lone UTF-16 surrogate is refused here: JSON's "\\ud800" escape parses to a Python str that no UTF-8
encoder takes, so the tokenizer fails on it with a TypeError (a 500 saying nothing useful); it is the client's
text that is wrong, so it is a 400 naming the field and the character.
"""

from __future__ import annotations

import asyncio
import weakref

from api_server.errors import bad_request
from api_server.limits import check_prompt_count, prompt_count
from api_server.params import token_ids
from api_server.protocol import ChatCompletionRequest
from api_server.text import TextCodec

INLINE_CHARS = 2048  # texts up to this long are tokenized on the event loop (well under a millisecond)
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
LONG_TEXTS_AT_ONCE = 2  # longer ones: this many worker threads at most, whatever the number of requests
_gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its Semaphore


def need_codec(codec: TextCodec | None, param: str, needs: str = "", instead: str = "send token ids") -> TextCodec:
    if codec is None:
        raise bad_request(f"{needs or param + ' as text needs'} a tokenizer, and this server has none: {instead}, "
                          "or start kvtransfer-api with --tokenizer DIR (or --model DIR, a local model directory)",
                          param, code="no_tokenizer")
    return codec


def check_text(text: str, param: str) -> None:
    """A 400 naming the first character UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{param}: character {e.start} is U+{ord(text[e.start]):04X}, a lone UTF-16 surrogate, "
                          "which is not Unicode text: send valid UTF-8 (a JSON \\u escape of a surrogate must be "
                          "one of a pair)", param) from None


def _check_all(value, param: str) -> None:
    """Every string in a JSON value (a chat message's content, its parts, its extra fields)."""
    if isinstance(value, str):
        check_text(value, param)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_all(k, param)
            _check_all(v, f"{param}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_all(v, f"{param}[{i}]")


async def _off_loop(size: int, fn, *args):
    if size <= INLINE_CHARS:
        return fn(*args)
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop) or _gates.setdefault(loop, asyncio.Semaphore(LONG_TEXTS_AT_ONCE))
    async with gate:
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:  # its client left; the thread runs on, and keeps its turn until it ends
            await asyncio.wait([work])
            raise


def _encode_checked(codec: TextCodec, text: str, param: str) -> list[int]:
    check_text(text, param)
    return codec.encode(text)


async def completion_prompts(codec: TextCodec | None, prompt, max_prompts: int) -> list[list[int]]:
    """/v1/completions' `prompt` (a string, ids, or a list of either) as one id list per prompt, none empty."""
    check_prompt_count(prompt_count(prompt), max_prompts)
    if not isinstance(prompt, str) and not prompt:
        raise bad_request("prompt is empty: send text, token ids, or a list of either", "prompt")
    if isinstance(prompt, str):
        out = [await _off_loop(len(prompt), _encode_checked, need_codec(codec, "prompt"), prompt, "prompt")]
    elif isinstance(prompt[0], int):
        out = [token_ids(prompt, "prompt", low=-(1 << 63))]
    elif isinstance(prompt[0], str):
        codec = need_codec(codec, "prompt")
        out = [await _off_loop(len(p), _encode_checked, codec, p, "prompt") for p in prompt]
    else:
        out = [token_ids(p, "prompt", low=-(1 << 63)) for p in prompt]
    for i, ids in enumerate(out):  # "" (or text the tokenizer makes nothing of), [[]]: the front says so, by name
        if not ids:
            where = "prompt" if isinstance(prompt, str) or isinstance(prompt[0], int) else f"prompt[{i}]"
            raise bad_request(f"{where} is empty (no tokens): send text, token ids, or a list of either", "prompt")
    return out


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template takes them: content parts joined (text only), every string valid."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            kinds = {part.get("type") for part in content} - {"text"}
            if kinds:
                raise bad_request(f"messages[{i}].content: part type {min(map(str, kinds))!r} is not "
                                  "supported (text only)", f"messages[{i}].content", code="unsupported_parameter")
            for j, part in enumerate(content):
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{j}].text must be a string (a text part is "
                                      '{"type": "text", "text": "..."})', f"messages[{i}].content[{j}].text")
            content = "".join(part["text"] for part in content)
        message = {**m.model_dump(exclude_none=True), "content": content or ""}
        _check_all(message, f"messages[{i}]")  # a lone surrogate is named first, the role's too
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role is {m.role!r}; use one of {', '.join(ROLES)}",
                              f"messages[{i}].role")
        out.append(message)
    return out


async def chat_prompt(codec: TextCodec | None, req: ChatCompletionRequest) -> list[int]:
    codec = need_codec(codec, "messages")
    messages = chat_messages(req)
    try:
        return await _off_loop(sum(len(m["content"]) for m in messages), codec.chat, messages)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
