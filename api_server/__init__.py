"""kvtransfer-api: the OpenAI-compatible HTTP front of one decode server (docs/api.md).

Why a separate process: HTTP parsing, JSON and detokenization are Python work per token; in the decode server's
process they would compete for the GIL with the thread that drives the decode engine. Here they talk to it over
the same gRPC `Decode` service every other client uses, so a router of many decode workers can later sit behind
the same front without either side changing.
"""
