"""`kvtransfer-router`: serve the Decode service in front of several decode workers (docs/router.md).

It runs in the servers' frame (kvtransfer.rpc.main's run_main: flags -> config, one line and exit 2 on a bad one,
logging, one uvloop loop, SIGTERM/SIGINT -> a graceful stop and exit 0) and stays a light process that never loads
torch, a model or the engine (tests/test_layout.py checks it), so it does not compete with a worker for the GIL or
the memory. SIGHUP reads --worker-file again (router/workers.py, `update`); a file that does not read, or would
leave no worker, is logged and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from grpc_health.v1 import health_pb2

from kvtransfer.rpc.lifecycle import Stop, shut_down
from kvtransfer.rpc.main import run_main
from kvtransfer.rpc.security import ClientSecurity, resolve_token, server_credentials
from kvtransfer.rpc.server import build_server, new_health
from proto import kvtransfer_pb2 as pb
from router.affinity import Affinity
from router.config import RouterConfig, from_args
from router.metrics import RouterMetrics
from router.placement import Placement
from router.server import RouterService
from router.workers import WorkerSet

log = logging.getLogger("kvtransfer.router")

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DECODE_SERVICE = pb.DESCRIPTOR.services_by_name["Decode"].full_name


async def serve(config: RouterConfig) -> None:
    stop = Stop()
    token = resolve_token(config.auth_token, config.auth_token_file)
    security = ClientSecurity(config.worker_tls_ca, config.worker_tls_cert, config.worker_tls_key,
                              resolve_token(config.worker_auth_token, config.worker_auth_token_file,
                                            "--worker-auth-token-file"))
    metrics = RouterMetrics()
    if config.metrics_port:
        log.info("metrics on http://%s:%d/metrics", config.metrics_addr,
                 metrics.serve(config.metrics_port, config.metrics_addr))
    workers = WorkerSet(config.workers(), security, config.max_message_bytes, config.load_poll_s,
                        config.load_timeout_s, metrics)
    affinity = Affinity(config.affinity_max_keys) if config.prefix_affinity else None
    placement = Placement(workers, config.policy, metrics, affinity, config.affinity_slack_tokens)
    service = RouterService(workers, placement, metrics, security, config.request_timeout_s)
    health = new_health()
    server, port, service.health = build_server(pb.DESCRIPTOR.services_by_name["Decode"], service, config.listen,
                                                config.max_message_bytes, token,
                                                server_credentials(config.tls_cert, config.tls_key, config.tls_ca),
                                                health)

    async def follow_workers() -> None:  # SERVING while at least one worker is healthy
        status = SERVING if workers.healthy() and not stop.event.is_set() else NOT_SERVING
        for name in ("", DECODE_SERVICE):
            await health.set(name, status)
        if status == NOT_SERVING and not stop.event.is_set():
            log.warning("no healthy worker: NOT_SERVING (%s)", workers.describe())

    async def reread() -> None:  # SIGHUP: the workers as --worker and --worker-file say now
        if not config.worker_file:
            log.warning("SIGHUP: no --worker-file to read again; the workers stay %s", workers.describe())
            return
        try:
            addrs = config.workers()
            if not addrs:
                raise ValueError("it lists no worker and --worker gives none")
        except ValueError as e:
            log.error("SIGHUP: %s; the workers stay %s", e, workers.describe())
            return
        added, removed = await workers.update(addrs, config.request_timeout_s)
        log.info("SIGHUP: --worker-file read again: added %s, removed %s; now %s", ", ".join(added) or "none",
                 ", ".join(removed) or "none", workers.describe())

    await follow_workers()
    workers.on_change = follow_workers
    workers.open()
    workers.start()
    rereads: set[asyncio.Task] = set()

    def on_hup() -> None:
        task = asyncio.ensure_future(reread())
        rereads.add(task)
        task.add_done_callback(rereads.discard)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hup)
    await server.start()
    front = "mTLS" if config.tls_ca else "TLS" if config.tls_cert else "plaintext"
    n = len(workers.workers)
    log.info("router on port %d (%s%s) over %s (%s, %s), policy %s", port, front, ", token required" if token else "",
             f"{n} decode worker{'s' if n > 1 else ''}", ", ".join(w.addr for w in workers.workers),
             "TLS" if config.worker_tls_ca else "plaintext", config.policy)
    await stop.event.wait()
    await shut_down(server, health, service.running, stop, config.shutdown_grace_s, log, "router")
    await workers.close()


def main(argv: list[str] | None = None) -> None:
    run_main(RouterConfig, argv, "kvtransfer router", serve, log, "kvtransfer-router", parse=from_args)


if __name__ == "__main__":
    main()
