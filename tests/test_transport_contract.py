"""Runs the contract scenarios (tests/support/contract.py) against every backend available here.

Links are built through the registry with non-default options: gRPC with the checksum on
and off, several channels and small chunks; gloo with several layers per message.
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.transport.options import DistOptions, GrpcOptions, IpcOptions
from support import contract
from support.harness import run_in_threads, run_two_processes

SCENARIOS = sorted(contract.SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fake(scenario):
    run_in_threads("fake", scenario)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cuda_ipc_local(scenario, slots):
    """cuda_ipc's protocol with its in-process CPU stand-in (LocalOps) over a real Unix socket."""
    run_in_threads("cuda_ipc", scenario, IpcOptions(slots=slots, slot_timeout_s=10, local_ops=True))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gloo(scenario):
    run_two_processes("gloo", scenario, DistOptions(layers_per_message=1))


@pytest.mark.parametrize("scenario,per_msg", [("every_layer", 3), ("pool", 3), ("receiver_abort", 3), ("many", 4)])
def test_gloo_grouped_layers(scenario, per_msg):
    run_two_processes("gloo", scenario, DistOptions(layers_per_message=per_msg))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_grpc(scenario):
    run_two_processes("grpc", scenario, GrpcOptions(channels=2, checksum="xxh3"))


@pytest.mark.parametrize("scenario", ["many", "every_layer", "pool"])
def test_grpc_no_checksum_many_channels_small_chunks(scenario):
    run_two_processes("grpc", scenario, GrpcOptions(channels=3, chunk_bytes=1024, checksum="none"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_grpc_cuda(scenario):
    """Both sides on the GPU: staged D2H on the sender, pinned landing + H2D on the receiver."""
    run_two_processes("grpc", scenario, GrpcOptions(channels=2), device="cuda")
