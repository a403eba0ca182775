"""The router's Prometheus figures, per decode worker, on --metrics-port (0: off).

Why per worker: the questions a router's operator asks are "where did the traffic go", "which worker fails, and
how", "how often did a retry save a request" and "did the conversations find their cache"; a total would hide the
one worker that is down or overloaded. The last Load report of each worker is exported too, so a dashboard shows
the figures placement decided on, not another sample of them. Every series is labelled `worker` (its --worker
address); `kvt_router_requests_total{outcome}` counts each caller's request once, by its final status.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from proto import kvtransfer_pb2 as pb

# LoadResponse's counts (every field but `serving`): summed over the workers by Load, and exported as gauges
# kvt_router_worker_<field>{worker}. Read from the message itself, so a field added to it is never left out.
LOAD_FIELDS = tuple(f.name for f in pb.LoadResponse.DESCRIPTOR.fields if f.name != "serving")


class RouterMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvt_router_requests", "caller requests by final gRPC status", ["outcome"],
                                registry=r)
        self.inflight = Gauge("kvt_router_inflight_requests", "caller requests in flight", registry=r)
        self.routed = Counter("kvt_router_routed", "Generate calls placed on a worker (a retry counts again, on "
                              "its new worker)", ["worker", "reason"], registry=r)
        self.failed = Counter("kvt_router_failed", "Generate calls a worker ended with an error, by status code "
                              "(before or after the first token)", ["worker", "code"], registry=r)
        self.retried = Counter("kvt_router_retried", "calls that failed on this worker before their first token "
                               "and were sent to another one", ["worker"], registry=r)
        self.affinity_hits = Counter("kvt_router_affinity_hits", "requests sent to this worker because it served "
                                     "their longest known prefix", ["worker"], registry=r)
        self.affinity_skipped = Counter("kvt_router_affinity_skipped", "requests whose prefix this worker holds, "
                                        "sent elsewhere: it was --affinity-slack-tokens more loaded", ["worker"],
                                        registry=r)
        self.up = Gauge("kvt_router_worker_up", "1 while the worker's last Load poll answered serving", ["worker"],
                        registry=r)
        self.own = Gauge("kvt_router_worker_placed_tokens", "this router's requests in flight on the worker, "
                         "prompt + max_new_tokens each", ["worker"], registry=r)
        self.load_tokens = Gauge("kvt_router_worker_load_tokens", "what least_loaded compares: the worker's last "
                                 "report less this router's requests in it, plus those in flight now", ["worker"],
                                 registry=r)
        self.load = {f: Gauge(f"kvt_router_worker_{f}", f"the worker's last Load report: {f}", ["worker"],
                              registry=r) for f in LOAD_FIELDS}

    def serve(self, port: int, addr: str) -> int:
        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {addr}:{port} (--metrics-port/--metrics-addr): {e}") from None
        return server.server_port

    def finished(self, outcome: str) -> None:
        """One caller request ended (kvtransfer.rpc.lifecycle.RunningRequests counts each once)."""
        self.requests.labels(outcome).inc()

    def placed(self, w) -> None:
        """A request was placed on or left worker `w` (router.workers.Worker), or a report came."""
        self.own.labels(w.addr).set(w.own_tokens())
        self.load_tokens.labels(w.addr).set(w.load_tokens())

    def reported(self, worker: str, up: bool, load=None) -> None:
        self.up.labels(worker).set(1 if up else 0)
        if load is not None:
            for f, g in self.load.items():
                g.labels(worker).set(getattr(load, f))
