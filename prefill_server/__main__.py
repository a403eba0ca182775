"""`kvtransfer-prefill`: load the model, join the decode peer's process group, serve Prefill."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvtransfer.compat import local_compat
from kvtransfer.configargs import from_args
from kvtransfer.security import channel_credentials, resolve_token
from kvtransfer.serving import configure_logging, load, new_event_loop, pick_device
from kvtransfer.transport.dist import init_pair
from kvtransfer.transport.links import ADDRESSED, PROCESS_GROUP, resolve, sender_link

from .config import PrefillConfig
from .server import PrefillService, create_server
from .worker import PrefillWorker

log = logging.getLogger("kvtransfer.prefill")


async def serve(config: PrefillConfig) -> None:
    token = resolve_token(config.auth_token, config.auth_token_file)
    device = pick_device(config.device)
    loaded = load(config.spec, device, config.deterministic)
    transport = resolve(config.transport, device)

    data_credentials = channel_credentials(config.data_tls_ca, config.data_tls_cert, config.data_tls_key, "data-tls")

    def connect(address: str = ""):
        return sender_link(transport, device, address, config.layers_per_message, config.grpc_channels,
                           config.checksum, config.send_timeout_s, data_credentials)

    worker = PrefillWorker(loaded, None, config.send_timeout_s)
    if transport in PROCESS_GROUP:
        log.info("model loaded on %s; joining process group at %s as rank 0 (%s)", device, config.dist_init,
                 transport)
        await asyncio.to_thread(init_pair, 0, config.dist_init, device, config.dist_timeout_s)
        worker.link = connect()
        await asyncio.to_thread(worker.warmup, config.warmup_tokens)
    service = PrefillService(config, worker, local_compat(config.spec, loaded.model, loaded.geometry,
                                                          config.deterministic), transport,
                             connect if transport in ADDRESSED else None)
    server, port = await create_server(config, service, token=token)
    await server.start()
    await service.health.set("", _serving())
    log.info("prefill server ready on port %d (%s%s)", port, "mTLS" if config.tls_ca else
             "TLS" if config.tls_cert else "plaintext", ", token required" if token else "")
    await server.wait_for_termination()


def _serving():
    from grpc_health.v1 import health_pb2
    return health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> None:
    config = from_args(PrefillConfig, argv, "kvtransfer prefill worker")
    configure_logging(config.log_level)
    log.info("config %s", config.one_line())
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve(config))
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # a setting that only shows at start-up (device, certificate, token file, port)
        log.error("cannot start: %s", e)
        sys.exit(2)


if __name__ == "__main__":
    main()
