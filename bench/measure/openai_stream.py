"""One streamed completion against an OpenAI-compatible HTTP server, timed per token: `serve --api URL`.

Why its own file: `serve` times the same load through two front doors (the decode server's gRPC and the OpenAI
front, api_server/), and both must produce one record shape, so the figures differ only by the door. The
request is what OpenAI's tools send (`vllm bench serve --backend openai`): a token-id prompt to
/v1/completions, `stream` with usage, `ignore_eos` so every request makes exactly `max_tokens`, greedy unless
`serve --temperature` says otherwise, and `return_token_ids` (vLLM's extension). A token's time is the arrival
of the SSE chunk that carries its id (a token with no text of its own, such as a character's first bytes, rides
in the next chunk: its gap is then 0); the count is checked against the final usage chunk.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import aiohttp


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


async def served_model(session: aiohttp.ClientSession, base: str, headers: dict) -> str:
    """The first model GET /v1/models lists (the name every request must carry)."""
    async with session.get(f"{base}/v1/models", headers=headers) as r:
        body = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"GET {base}/v1/models: HTTP {r.status}: {body}")
        return body["data"][0]["id"]


async def one_request(session: aiohttp.ClientSession, base: str, model: str, ids: list[int], output_len: int,
                      timeout: float, headers: dict, *, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Token arrival times of one streamed completion, or its failure as `HTTP <code>` (or the exception's name)."""
    body = {"model": model, "prompt": ids, "max_tokens": output_len, "stream": True, "ignore_eos": True,
            "temperature": temperature, "top_p": top_p, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    out = {"input_len": len(ids), "times": [], "code": None, "error": "", "mode": ""}
    t0 = out["start"] = time.perf_counter()
    usage = None
    try:
        async with session.post(f"{base}/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                text = await r.text()
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                out["code"], out["error"] = f"HTTP {r.status}", text
                return out
            async for raw in r.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    ids = chunk["choices"][0].get("token_ids")
                    out["times"].extend([time.perf_counter() - t0] * (1 if ids is None else len(ids)))
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (TimeoutError, aiohttp.ClientError) as e:
        out["code"], out["error"] = type(e).__name__, str(e)
        return out
    made = usage["completion_tokens"] if usage else None
    if made != output_len or len(out["times"]) != output_len:
        out["code"] = "INCOMPLETE"
        out["error"] = f"{len(out['times'])} tokens streamed, usage says {made}, of {output_len}"
    return out
