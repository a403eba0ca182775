"""`kvtransfer-prefill`: load the model, serve Handshake and Prefill; the data plane is built per pairing."""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2

from kvtransfer.model.loaded import load, pick_device
from kvtransfer.rpc.compat import local_compat
from kvtransfer.rpc.lifecycle import Stop, shut_down
from kvtransfer.rpc.main import run_main
from kvtransfer.rpc.metrics import start_metrics
from kvtransfer.rpc.security import resolve_token
from kvtransfer.transport import registry
from prefill_server.config import PrefillConfig
from prefill_server.faults import StallFault
from prefill_server.server import PrefillService, create_server
from prefill_server.worker import PrefillWorker

log = logging.getLogger("kvtransfer.prefill")


async def serve(config: PrefillConfig) -> None:
    stop = Stop()
    token = resolve_token(config.auth_token, config.auth_token_file)
    device = pick_device(config.device)
    loaded = load(config.spec(device), device, config.deterministic)
    backend = registry.resolve(config.transport, device.type)
    options = registry.options_from(config, backend.name)
    metrics = start_metrics("prefill", config.metrics_port, config.metrics_addr)

    def connect(address: str = "", group=None):
        kw = {"group": group} if group is not None else {}
        return registry.sender_link(backend.name, device, options, address=address,
                                    connect_timeout_s=config.send_timeout_s, **kw)

    fault = (StallFault(config.fail_after_layers, config.fail_stall_s, config.fail_requests)
             if config.fail_after_layers >= 0 else None)
    invariant = None
    if config.batch_invariant:
        from kvtransfer.engine.invariant_prefill import InvariantPrefill
        invariant = InvariantPrefill(loaded, config.max_prompt_tokens)
    worker = PrefillWorker(loaded, config.send_timeout_s, fault, invariant)
    store = None
    if backend.rendezvous is registry.Rendezvous.PROCESS_GROUP:  # one store for the process's lifetime
        from kvtransfer.transport.rendezvous import open_store
        try:
            store = await asyncio.to_thread(open_store, config.dist_init, 0, config.dist_timeout_s)
        except RuntimeError as e:  # torch's DistNetworkError: the port is taken or the host is not ours
            raise ValueError(f"cannot host the rendezvous store at --dist-init {config.dist_init}: {e}") from None
        log.info("model loaded on %s; rendezvous store at %s, waiting for the decode peer (%s)", device,
                 config.dist_init, backend.name)
    compat = local_compat(loaded.spec, loaded.model, loaded.geometry, config.deterministic, config.batch_invariant)
    service = PrefillService(config, worker, compat, backend, connect, metrics, store)
    server, port = await create_server(config, service, token=token)
    await server.start()
    await service.pairing.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # SERVING once paired
    log.info("prefill server ready on port %d (%s%s)%s", port, "mTLS" if config.tls_ca else
             "TLS" if config.tls_cert else "plaintext", ", token required" if token else "",
             "; fault injection on" if fault else "")
    await stop.event.wait()
    service.pairing.stopping = True  # handshakes refused from now; a join in progress gives up
    await shut_down(server, service.pairing.health, service.running, stop, config.shutdown_grace_s, log,
                    "prefill server", before_stop=service.close)


def main(argv: list[str] | None = None) -> None:
    run_main(PrefillConfig, argv, "kvtransfer prefill worker", serve, log, "kvtransfer-prefill")


if __name__ == "__main__":
    main()
