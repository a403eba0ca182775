"""The routes: /v1/completions, /v1/chat/completions, /v1/models, /health.

Why every generation starts before the response does: the first token back from the decode server is the point
after which an HTTP status can no longer change; until then any refusal is an HTTP error in OpenAI's shape
(api_server/errors.py), after it a stream carries an error event and ends with [DONE]. Several prompts in one
/v1/completions request run as concurrent Generate calls, one choice index each (OpenAI's batch form); any of
them failing ends the whole request and cancels the others.

Why every request runs beside a watcher of its client: Starlette runs a route handler to its end whether or not
the client is still there, and a non-streaming answer (or a stream still waiting for its first token) sends
nothing that could notice the hang-up; without the watcher a client that gave up would keep its KV slot busy on
the decode server until max_tokens. Once the client is gone the handler is cancelled, its Generate calls with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request

from api_server import errors
from api_server.backend import Backend
from api_server.config import ApiConfig
from api_server.errors import ApiError
from api_server.generation import Generation
from api_server.metrics import ApiMetrics
from api_server.limits import BodyLimit, check_max_tokens, check_message_size, check_prompt_tokens
from api_server.params import Params, params
from api_server.prompts import chat_prompt, completion_prompts, need_codec
from api_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_choice,
    chat_delta,
    completion_choice,
    envelope,
)
from api_server.slow_clients import BodyDeadline
from api_server.streams import collect_all, merge_pieces, sse, sse_response, usage_of
from api_server.text import TextCodec
from proto import kvtransfer_pb2 as pb

DEFAULT_CHAT_MAX_TOKENS = 256  # chat without max_tokens, from a decode server that does not say its limits
STRAY_MESSAGE_S = 0.1  # an ASGI server sending other messages than the disconnect is not read in a busy loop

log = logging.getLogger("kvtransfer.api")


def build_app(config: ApiConfig, backend: Backend, codec: TextCodec | None, metrics: ApiMetrics) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        backend.open()
        yield
        await backend.close()

    app = FastAPI(title="kvtransfer OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    errors.install(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(BodyDeadline, seconds=config.body_timeout_s)
    started = int(time.time())
    front = Front(config, backend, codec, metrics)

    @app.get("/health")
    async def health():
        if await backend.serving(config.health_timeout_s):
            return {"status": "serving"}
        raise ApiError(503, f"the decode server at {backend.address} is not serving (unreachable, starting, "
                       "pairing with its prefill worker, or shutting down)", code="backend_not_serving")

    @app.get("/v1/models")
    async def models():
        name, info = await front.model_name(), await backend.info()
        card = {"id": name, "object": "model", "created": started, "owned_by": "kvtransfer"}
        if info.max_seq_len:
            card["max_model_len"] = info.max_seq_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _unless_gone(request, front.complete(req))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        return await _unless_gone(request, front.chat(req))

    return app


async def _client_gone(request: Request) -> None:
    """Returns once the HTTP client has hung up. Why reading the ASGI messages is safe here: FastAPI has read the
    whole body to parse the request, so the next message is the disconnect; and the watcher is gone before a
    streaming response starts listening for the same message itself."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(STRAY_MESSAGE_S)


async def _unless_gone(request: Request, work):
    """`work`'s result (the response); if the client hangs up first, `work` is cancelled, which cancels its
    Generate calls (the decode server frees their KV slots at its next step), and the request ends as a 499 that
    nobody reads but the metrics count."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler cancelled (the server stopping): its work too
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    if watch.exception() is not None:  # cannot tell whether the client is there: answer as if it were
        log.warning("cannot watch the client for a hang-up: %r", watch.exception())
        return await task
    task.cancel()
    await asyncio.wait((task,))  # its clean-up (the calls cancelled) done before the handler returns
    if not task.cancelled() and task.exception() is not None:
        log.debug("a request whose client hung up also failed: %r", task.exception())
    raise ApiError(499, "the client closed the connection before its answer was ready", code="client_closed_request")


class Front:
    """What the routes share: the served name, prompts to ids, starting and collecting generations."""

    def __init__(self, config: ApiConfig, backend: Backend, codec: TextCodec | None, metrics: ApiMetrics):
        self.config, self.backend, self.codec, self.metrics = config, backend, codec, metrics

    async def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        info = await self.backend.info()
        model = self.config.model
        return info.model or (os.path.basename(os.path.normpath(model)) if model else "") or "kvtransfer"

    async def _check_model(self, asked: str | None) -> str:
        name = await self.model_name()
        if asked and asked != name:
            raise ApiError(404, f"The model '{asked}' does not exist: this server serves '{name}' (GET /v1/models)",
                           "model", "model_not_found")
        return name

    async def _requests(self, p: Params, prompts: list[list[int]], max_tokens: list[int],
                        param: str) -> list[pb.GenerateRequest]:
        """The GenerateRequests, each checked against the decode server's prompt limit (its Info) and the
        channel's message limit; a prompt of more ids than the limit has bytes is never built (an id takes one
        byte at least)."""
        eos, limit = self.codec.eos_token_ids if self.codec else [], self.config.max_message_bytes
        try:
            info = await self.backend.info()
            most, max_seq = info.max_prompt_tokens, min((x for x in (info.context_length, info.max_seq_len) if x),
                                                        default=0)  # the decode server's bound: the smaller
            most_new = info.max_new_tokens
        except ApiError:  # not reachable: its Generate call will say so
            most = max_seq = most_new = 0
        out = []
        for ids, n in zip(prompts, max_tokens):
            check_prompt_tokens(len(ids), most, param, max_seq)
            if p.max_tokens is not None:  # the client's (a filled-in one fits by construction: _fill)
                check_max_tokens(len(ids), n, most_new, max_seq, p.max_tokens_param)
            request = p.request(ids, n, eos) if len(ids) <= limit else None
            check_message_size(len(ids), None if request is None else request.ByteSize(), limit, param)
            out.append(request)
        return out

    async def _start(self, p: Params, prompts: list[list[int]], max_tokens: list[int], endpoint: str,
                     t0: float, param: str = "prompt") -> list[Generation]:
        """Every generation started (its first token in); the first refusal cancels the others at once, so it
        is answered without waiting for their prefill."""
        requests = await self._requests(p, prompts, max_tokens, param)
        gens = [Generation(self.backend, r, self.codec.detokenizer(ids) if self.codec else None, p.stop,
                           self.metrics, endpoint, t0) for r, ids in zip(requests, prompts)]
        tasks = [asyncio.ensure_future(g.start()) for g in gens]
        for t in tasks:  # an error a cancelled start still ends with is nobody's to hear
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t.exception() for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                raise failed
        except BaseException:  # a refusal, or the request cancelled (its client gone)
            for t in tasks:
                t.cancel()
            for g in gens:
                g.cancel()
            raise
        return gens

    async def complete(self, req: CompletionRequest):
        t0 = time.perf_counter()
        p = params(req)
        name = await self._check_model(req.model)
        if p.stop:  # matched on the generated text, which is empty without a tokenizer: they would never stop it
            need_codec(self.codec, "stop", "stop strings need", "use stop_token_ids")
        prompts = await completion_prompts(self.codec, req.prompt, self.config.max_prompts_per_request)
        max_tokens = [p.max_tokens or await self._fill(len(ids)) for ids in prompts]  # null: as chat's default
        gens = await self._start(p, prompts, max_tokens, "/v1/completions", t0)
        rid, created, ids = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.return_token_ids or self.codec is None

        def choice(i, piece):
            return completion_choice(i, piece.text, piece.finish_reason, piece.token_ids if ids else None)
        if not req.stream:
            return envelope("text_completion", rid, created, name, [choice(i, piece) for i, piece in
                                                                    enumerate(await collect_all(gens))],
                            usage_of(gens))

        async def events():
            async with aclosing(merge_pieces(gens)) as merged:
                async for i, piece in merged:
                    yield sse(envelope("text_completion", rid, created, name, [choice(i, piece)]))
            if req.stream_options and req.stream_options.include_usage:
                yield sse(envelope("text_completion", rid, created, name, [], usage_of(gens)))
        return sse_response(events(), gens)

    async def chat(self, req: ChatCompletionRequest):
        t0 = time.perf_counter()
        p = params(req)
        name = await self._check_model(req.model)
        prompt = await chat_prompt(self.codec, req)
        max_tokens = p.max_tokens or await self._fill(len(prompt))
        gens = await self._start(p, [prompt], [max_tokens], "/v1/chat/completions", t0, "messages")
        rid, created, ids = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.return_token_ids
        if not req.stream:
            piece = (await collect_all(gens))[0]
            return envelope("chat.completion", rid, created, name,
                            [chat_choice(0, piece.text, piece.finish_reason, piece.token_ids if ids else None)],
                            usage_of(gens))

        def chunk(delta, reason=None, token_ids=None):
            return sse(envelope("chat.completion.chunk", rid, created, name,
                                 [chat_delta(0, delta, reason, token_ids if ids else None)]))

        async def events():
            yield chunk({"role": "assistant", "content": ""}, token_ids=[])
            async with aclosing(merge_pieces(gens)) as merged:
                async for _, piece in merged:
                    yield chunk({"content": piece.text} if piece.text else {}, piece.finish_reason, piece.token_ids)
            if req.stream_options and req.stream_options.include_usage:
                yield sse(envelope("chat.completion.chunk", rid, created, name, [], usage_of(gens)))
        return sse_response(events(), gens)

    async def _fill(self, prompt_len: int) -> int:
        """No max_tokens (chat's default, or null): what the decode server's slot leaves after the prompt, within
        its --max-new-tokens (at least 1: a prompt with no room left is the server's to refuse, in its words)."""
        info = await self.backend.info()
        bounds = [b for b in (info.max_new_tokens, info.max_seq_len and info.max_seq_len - prompt_len) if b]
        return max(1, min(bounds)) if bounds else DEFAULT_CHAT_MAX_TOKENS
