"""How one request's generations become its answer: one body, or one SSE stream of their pieces merged.

Why apart from the routes (app.py): both endpoints answer several prompts at once (a choice each) the same way,
and the stream's end is a contract of its own: whatever fails after the 200 went out, the client gets an error
event in OpenAI's shape and then `data: [DONE]`, never a stream that just stops; and every generation is
cancelled when its answer ends, so none keeps a KV slot busy on the decode server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing

from fastapi.responses import StreamingResponse

from api_server.errors import ApiError, internal
from api_server.generation import Generation, collect
from api_server.protocol import usage

MERGE_QUEUE = 64  # pieces buffered per request of several prompts (the client's reading paces the rest)

log = logging.getLogger("kvtransfer.api")


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage_of(gens: list[Generation]) -> dict:
    return usage(sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens))


async def collect_all(gens: list[Generation]):
    try:
        return await asyncio.gather(*(collect(g) for g in gens))
    finally:
        for g in gens:
            g.cancel()


async def merge_pieces(gens: list[Generation]):
    """(choice index, piece) from every generation as they come; one generation: straight through. Any error of
    one generation (a refusal, a bug) ends them all: a pump that died quietly would leave the queue waiting."""
    if len(gens) == 1:
        async with aclosing(gens[0].pieces()) as pieces:
            async for piece in pieces:
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue(MERGE_QUEUE)

    async def pump(i: int, gen: Generation):
        try:
            async with aclosing(gen.pieces()) as pieces:
                async for piece in pieces:
                    await queue.put((i, piece))
        except Exception as e:  # noqa: BLE001 - forwarded to the reader, never lost with its task
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            left -= item.finish_reason is not None
    finally:
        for t in tasks:
            t.cancel()


def sse_response(events, gens: list[Generation]) -> StreamingResponse:
    """SSE: the events, an error event if the generation fails after the 200 went out, then [DONE]. Whatever the
    failure (the decode server's status, or a bug here), the client gets an error in OpenAI's shape and the end of
    the stream, never a stream that just stops."""

    async def body():
        try:
            async with aclosing(events) as it:
                async for event in it:
                    yield event
        except ApiError as e:
            yield sse(e.body())
        except Exception as e:
            log.exception("a stream failed after its 200 was sent")
            yield sse(internal(e).body())
        finally:
            for g in gens:
                g.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
