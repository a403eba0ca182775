"""The two front doors `serve` sends its requests through: the decode server's gRPC Generate, and the OpenAI
front's /v1/completions (`--api URL`, through bench/measure/openai_stream.py).

Why apart from the run (bench/runs/serve.py, whose ServeConfig is the `cfg` here): the run schedules the load (warm-up, arrivals, concurrency, the
time budget) and is the same for both doors; each door is `send(ids, timeout) -> record`, an async context
manager that owns its channel or session, and both produce one record shape (input_len, start, token arrival
times, failure code and message, the mode that ran), so the figures differ only by the door.
"""

from __future__ import annotations

import time

import aiohttp
import grpc

from bench.measure import openai_stream
from decode_server.client import MODES
from kvtransfer.rpc.modes import Mode
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg


async def one_request(stub, ids: list[int], cfg, timeout: float, metadata, stop_after: int | None = None
                      ) -> dict:
    """Token arrival times of one Generate stream, or its failure as a status code name; `stop_after`: the client
    ends the stream (cancels the call) once it has that many tokens, as a reader who stops reading."""
    req = pb.GenerateRequest(token_ids=ids, max_new_tokens=cfg.output_len, mode=MODES[cfg.mode])
    if cfg.temperature > 0:  # absent: greedy
        req.sampling.CopyFrom(pb.Sampling(temperature=cfg.temperature, top_p=cfg.top_p))
    return await stream_record(stub, req, timeout, metadata, stop_after)


async def stream_record(stub, req: pb.GenerateRequest, timeout: float, metadata, stop_after: int | None = None,
                        digests: bool = False) -> dict:
    """One Generate stream as a record: input_len, start, each token's id and arrival time (s after the send), the
    mode that ran and the last message's Timing (`timing`, None on failure), each step's logits digest with `digests`
    (the request asks for them), or the failure as a status code name
    (INCOMPLETE: fewer tokens than max_new_tokens, or than `stop_after` where the client cancels the call once it
    has that many)."""
    out = {"input_len": len(req.token_ids), "times": [], "tokens": [], "code": None, "error": "", "mode": "",
           "timing": None}
    if digests:
        out["digests"] = []
    t0 = out["start"] = time.perf_counter()
    want = min(stop_after or req.max_new_tokens, req.max_new_tokens)
    call = stub.Generate(req, timeout=timeout, metadata=metadata)
    try:
        async for msg in call:
            out["times"].append(time.perf_counter() - t0)
            out["tokens"].append(msg.token_id)
            if digests:
                out["digests"].append(msg.logits_digest)
            if msg.HasField("timing"):
                out["timing"] = msg.timing
                out["mode"] = Mode.from_proto(msg.timing.mode).value
            if len(out["times"]) == want < req.max_new_tokens:
                call.cancel()  # the client ends it: the server sees CANCELLED
                break
    except grpc.aio.AioRpcError as e:
        out["code"], out["error"] = e.code().name, e.details() or ""
    if out["code"] is None and len(out["times"]) != want:
        out["code"] = "INCOMPLETE"
        out["error"] = f"stream ended after {len(out['times'])} of {want} tokens"
    return out


def grpc_door(cfg, metadata):
    """A request function for the gRPC door: send(ids, timeout) -> record; an async context manager."""
    class Door:
        async def __aenter__(self):
            self.channel = grpc.aio.insecure_channel(cfg.addr)
            stub = pbg.DecodeStub(self.channel)
            return lambda ids, timeout, stop_after=None: one_request(stub, ids, cfg, timeout, metadata, stop_after)

        async def __aexit__(self, *exc):
            await self.channel.close()
    return Door()


def http_door(cfg, metadata):
    """The same for the OpenAI front (--api): one aiohttp session, unlimited connections (the semaphore limits)."""
    headers = {k.title(): v for k, v in (metadata or ())}

    class Door:
        async def __aenter__(self):
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=None))
            model = await openai_stream.served_model(self.session, cfg.api.rstrip("/"), headers)
            return lambda ids, timeout: openai_stream.one_request(self.session, cfg.api.rstrip("/"), model, ids,
                                                                  cfg.output_len, timeout, headers,
                                                                  temperature=cfg.temperature, top_p=cfg.top_p)

        async def __aexit__(self, *exc):
            await self.session.close()
    return Door()
