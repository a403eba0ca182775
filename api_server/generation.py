"""One prompt's generation: a Generate stream from the decode server, as text pieces with stop strings applied.

Why `start` waits for the first token: until then nothing has been sent to the HTTP client, so a refusal (a
prompt over the context, a full server, an unreachable one) can still be an HTTP error with its own code rather
than an error event inside a 200 stream. Why the call is cancelled on a stop string (and whenever the consumer
stops reading: a client that hung up): the decode server then frees the request's KV slot at its next step
instead of decoding tokens nobody will read. A call that ended by itself is read to its status instead, so the
decode server counts it as finished, not cancelled.

finish_reason comes from the decode server's last message (FINISH_REASON_LENGTH or _STOP); from a server that
does not set it yet, a stream that ended at max_tokens is "length", an earlier end "stop".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from api_server.backend import Backend
from api_server.errors import from_rpc
from api_server.metrics import ApiMetrics
from api_server.stops import StopMatcher
from api_server.text import Detokenizer
from proto import kvtransfer_pb2 as pb

FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop"}


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last piece only


class Generation:
    def __init__(self, backend: Backend, request: pb.GenerateRequest, detok: Detokenizer | None, stop: list[str],
                 metrics: ApiMetrics, endpoint: str, t0: float):
        self.backend, self.request, self.detok = backend, request, detok
        self.stops = StopMatcher(stop)
        self.metrics, self.endpoint, self.t0 = metrics, endpoint, t0
        self.prompt_tokens = len(request.token_ids)
        self.completion_tokens = 0
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._first: pb.GenerateResponse | None = None
        self._last_t = 0.0

    async def start(self) -> None:
        """Send the request and wait for its first token; raises ApiError if the decode server refuses it."""
        self._call = self.backend.generate(self.request)
        self._first = await self._read()

    async def _read(self) -> pb.GenerateResponse | None:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise from_rpc(e, self.backend.address, self.completion_tokens) from None
        if msg is grpc.aio.EOF:
            return None
        now = time.perf_counter()
        if self.completion_tokens == 0:
            self.metrics.ttft_ms.labels(self.endpoint).observe((now - self.t0) * 1e3)
        else:
            self.metrics.itl_ms.observe((now - self._last_t) * 1e3)
        self._last_t = now
        self.completion_tokens += 1
        return msg

    async def pieces(self):
        """Text pieces up to and including the last one (which carries finish_reason). Pieces with no text are
        left out, except the last; their ids ride on the next piece (without a tokenizer: one piece per id)."""
        msg, ids = self._first, []
        try:
            while msg is not None:
                ids.append(msg.token_id)
                text = self.detok.step(msg.token_id) if self.detok else ""
                reason = FINISH.get(msg.finish_reason)
                if reason is not None and self.detok:
                    text += self.detok.flush()
                out, stopped = self.stops.feed(text)
                if stopped:
                    yield Piece(out, ids, "stop")
                    if reason is not None:  # the call's last message: read its status rather than cancel it
                        await self._call.code()
                    return
                if reason is not None:
                    yield Piece(out + self.stops.flush(), ids, reason)
                    await self._call.code()  # its OK status: a call that ended well is not cancelled (its count)
                    return
                if out or self.detok is None:  # no tokenizer: every token is a piece (its id, no text)
                    yield Piece(out, ids)
                    ids = []
                msg = await self._read()
            # the stream ended without a finish_reason (a decode server from before the field)
            out, stopped = self.stops.feed(self.detok.flush() if self.detok else "")
            inferred = "length" if self.completion_tokens >= self.request.max_new_tokens else "stop"
            yield Piece(out if stopped else out + self.stops.flush(), ids, "stop" if stopped else inferred)
        finally:
            self.cancel()

    def cancel(self) -> None:
        if self._call is not None and not self._call.done():
            self._call.cancel()


async def collect(gen: Generation) -> Piece:
    """A whole generation as one piece (the non-streaming answer)."""
    texts, ids, reason = [], [], None
    async for piece in gen.pieces():
        texts.append(piece.text)
        ids.extend(piece.token_ids)
        reason = piece.finish_reason
    return Piece("".join(texts), ids, reason)
