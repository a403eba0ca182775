"""Test adapters over bench/measure/launch.py: server processes with their logs under pytest's tmp_path."""

from __future__ import annotations

from contextlib import contextmanager

import grpc

from bench.measure.launch import ROOT, Running, free_port, stop, wait_serving
from bench.measure.launch import colocated_server as _colocated
from bench.measure.launch import server_pair as _pair

__all__ = ["ROOT", "Running", "colocated_server", "free_port", "server_pair", "stop", "wait_serving"]


@contextmanager
def server_pair(tmp_path, model="tiny", dtype="float32", prefill_args=(), decode_args=(), wait=True,
                credentials: grpc.ChannelCredentials | None = None):
    with _pair(str(tmp_path), model, dtype, prefill_args=prefill_args, decode_args=decode_args,
               common_args=["--log-level", "INFO"], wait=wait, credentials=credentials) as run:
        yield run


@contextmanager
def colocated_server(tmp_path, model="tiny", dtype="float32", args=(),
                     wait_credentials: grpc.ChannelCredentials | None = None):
    with _colocated(str(tmp_path), model, dtype, args=args, credentials=wait_credentials) as run:
        yield run
