"""Pieces both servers share: model + device set-up, the process-group pair, grpc.aio plumbing.

Why one place: the two workers must build the model, the geometry and the data-plane
link the same way, or their caches would not match byte for byte.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from .determinism import enable_deterministic
from .geometry import CacheGeometry
from .models import ModelSpec, load_model

log = logging.getLogger("kvtransfer")

GRPC_MESSAGE_LIMIT = 64 << 20  # control messages are small; keeps garbage bounded
GRPC_OPTIONS = [("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
                ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT)]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device here; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: torch.nn.Module
    geometry: CacheGeometry
    device: torch.device


def load(spec: ModelSpec, device: torch.device, deterministic: bool) -> LoadedModel:
    if deterministic:
        enable_deterministic()
    model = load_model(spec, device)
    return LoadedModel(spec, model, CacheGeometry.from_config(model.config, spec.torch_dtype), device)


def gpu_executor(device: torch.device, name: str) -> ThreadPoolExecutor:
    """One thread owns the device's compute: requests are serialized, CUDA context set once."""
    init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it is a dependency), else the default loop."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.new_event_loop()


def add_standard_services(server: grpc.aio.Server, service_names: list[str]):
    """Health (returned, to flip SERVING/NOT_SERVING) and reflection."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                                         reflection.SERVICE_NAME], server)
    return health_servicer


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
