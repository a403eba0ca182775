"""Prometheus metrics for both servers, on a separate port (`--metrics-port`).

Why here: the two servers report the same families (a dashboard needs one name per
figure), and prometheus-client is the well-kept way to expose them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


class Metrics:
    """One registry per server process (tests may build several in one process)."""

    def __init__(self, role: str):
        self.registry = r = CollectorRegistry()
        self.role = role
        self.ttft_ms = Histogram("kvt_ttft_ms", "request in -> whole cache and first token on the decode worker",
                                 ["mode"], buckets=_MS_BUCKETS, registry=r)
        self.transfer_ms = Histogram("kvt_transfer_ms", "prefill start -> last layer sent/received", ["mode"],
                                     buckets=_MS_BUCKETS, registry=r)
        self.prefill_ms = Histogram("kvt_prefill_ms", "prefill compute (synchronized)", ["mode"],
                                    buckets=_MS_BUCKETS, registry=r)
        self.bytes = Counter("kvt_transfer_bytes", "KV bytes moved", registry=r)
        self.gbps = Gauge("kvt_transfer_gbps", "achieved GB/s of the last transfer", registry=r)
        self.requests = Counter("kvt_requests", "requests by outcome", ["outcome"], registry=r)
        self.failures = Counter("kvt_failures", "failed requests by cause", ["cause"], registry=r)
        self.inflight = Gauge("kvt_inflight_requests", "requests in flight", registry=r)
        self.buffer_bytes = Gauge("kvt_buffer_bytes", "bytes held in receive/staging buffers", registry=r)
        self.peer_up = Gauge("kvt_peer_up", "1 while the peer is connected", registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP; port 0 picks a free one. Returns the port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port
