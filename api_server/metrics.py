"""The front's Prometheus figures: requests by endpoint and HTTP code, time to first token, inter-token latency.

Why these three and measured here: they are what an HTTP client sees (JSON, detokenization and the gRPC hop
included), which the decode server's own kvt_ttft_ms cannot say. The code is read from the response as it
leaves (one small ASGI wrapper), so a refusal by any handler is counted once, under its real code; a stream
that fails after its 200 has been sent counts as 200, as the client saw it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")


class ApiMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvt_api_requests", "HTTP requests by endpoint and response code",
                                ["endpoint", "code"], registry=r)
        self.ttft_ms = Histogram("kvt_api_ttft_ms", "request in -> first generated token back from the decode server",
                                 ["endpoint"], buckets=_MS_BUCKETS, registry=r)
        self.itl_ms = Histogram("kvt_api_itl_ms", "between two generated tokens of one request, as the front gets "
                                "them", buckets=_MS_BUCKETS, registry=r)

    def serve(self, port: int, addr: str) -> int:
        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {addr}:{port} (--metrics-port/--metrics-addr): {e}") from None
        return server.server_port


class CountResponses:
    """ASGI middleware: count each HTTP response by endpoint and status code."""

    def __init__(self, app, metrics: ApiMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
