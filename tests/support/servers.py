"""Test adapters over bench/measure/launch.py: server processes with their logs under pytest's tmp_path.

The decode servers start with --no-prefix-cache unless a test asks for the cache (prefix_cache=True): most tests
send one prompt several times and compare the results bit for bit across modes, which a reused prefix (equal
only within chunked prefill's tolerance, and prefilled on the decode worker) would defeat.
"""

from __future__ import annotations

from contextlib import contextmanager

import grpc

from bench.measure.launch import ROOT, Running, free_port, stop, wait_serving
from bench.measure.launch import colocated_server as _colocated
from bench.measure.launch import server_pair as _pair

__all__ = ["ROOT", "Running", "colocated_server", "free_port", "server_pair", "stop", "wait_serving"]


@contextmanager
def server_pair(tmp_path, model="tiny", dtype="float32", prefill_args=(), decode_args=(), wait=True,
                credentials: grpc.ChannelCredentials | None = None, prefix_cache: bool = False):
    decode_args = [*decode_args, *([] if prefix_cache else ["--no-prefix-cache"])]
    with _pair(str(tmp_path), model, dtype, prefill_args=prefill_args, decode_args=decode_args,
               common_args=["--log-level", "INFO"], wait=wait, credentials=credentials) as run:
        yield run


@contextmanager
def colocated_server(tmp_path, model="tiny", dtype="float32", args=(),
                     wait_credentials: grpc.ChannelCredentials | None = None, prefix_cache: bool = False):
    args = [*args, *([] if prefix_cache else ["--no-prefix-cache"])]
    with _colocated(str(tmp_path), model, dtype, args=args, credentials=wait_credentials) as run:
        yield run
