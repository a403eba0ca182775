"""Prometheus metrics for both servers, on a separate port (`--metrics-port`, 0 = off).

Why here: the two servers report the same families (a dashboard needs one name per
figure), and prometheus-client is the well-kept way to expose them. Live values (requests
in flight, buffers held, frames expected) are read at scrape time from the objects that
own them, so a gauge can never drift from the truth it reports; that is also what the
fault tests use to prove that nothing leaks.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("kvtransfer")

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


class Metrics:
    """One registry per server process (tests may build several in one process)."""

    def __init__(self, role: str):
        self.registry = r = CollectorRegistry()
        self.role = role
        Gauge("kvt_info", "constant 1, labelled with the server's role", ["role"], registry=r).labels(role).set(1)
        self.ttft_ms = Histogram("kvt_ttft_ms", "request in -> whole cache and first token on the decode worker",
                                 ["mode"], buckets=_MS_BUCKETS, registry=r)
        self.transfer_ms = Histogram("kvt_transfer_ms", "prefill start -> last layer sent/received", ["mode"],
                                     buckets=_MS_BUCKETS, registry=r)
        self.prefill_ms = Histogram("kvt_prefill_ms", "prefill compute (synchronized)", ["mode"],
                                    buckets=_MS_BUCKETS, registry=r)
        self.bytes = Counter("kvt_transfer_bytes", "KV bytes moved", registry=r)
        self.gbps = Gauge("kvt_transfer_gbps", "achieved GB/s of the last transfer", registry=r)
        self.requests = Counter("kvt_requests", "finished requests by final gRPC status", ["outcome"], registry=r)
        self.failures = Counter("kvt_failures", "remote prefill/transfer failures by cause (whatever the policy "
                                "then did)", ["cause"], registry=r)
        self.inflight = Gauge("kvt_inflight_requests", "requests in flight", registry=r)
        self.waiting = Gauge("kvt_waiting_requests", "decode: requests in the admission queue, waiting for KV memory "
                             "(at most --max-waiting)", registry=r)
        self.buffer_bytes = Gauge("kvt_buffer_bytes", "bytes held in receive/send buffers for requests in flight",
                                  registry=r)
        self.expected = Gauge("kvt_expected_frames", "decode: requests waiting for their cache frame", registry=r)
        self.receivers = Gauge("kvt_receivers_inflight", "decode: data-plane receivers holding buffers", registry=r)
        self.receive_loops = Gauge("kvt_receive_loops", "decode: receive-loop threads alive (old pairings' "
                                   "threads end when the peer closes their group)", registry=r)
        self.peer_up = Gauge("kvt_peer_up", "paired servers only: the peers paired now with their data plane up "
                             "(a decode worker's prefill workers, a prefill worker's decode workers)", registry=r)
        self._peer_up_exported = True
        self.cached_slots = Gauge("kvt_prefix_cached_slots", "decode: free pool slots holding a finished request's "
                                  "KV for reuse", registry=r)
        self.host_cache_bytes = Gauge("kvt_prefix_host_bytes", "decode: host-tier bytes holding evicted contexts",
                                      registry=r)
        self.prefix_hits = Counter("kvt_prefix_hits", "decode: requests that reused a cached prefix, by tier",
                                   ["tier"], registry=r)
        self.prefix_tokens = Counter("kvt_prefix_reused_tokens", "decode: prompt tokens not prefilled (their KV "
                                     "was cached), by tier", ["tier"], registry=r)
        self.reload_bytes = Counter("kvt_prefix_reload_bytes", "decode: KV bytes copied back from the host tier",
                                    registry=r)
        self.host_decisions = Counter("kvt_prefix_host_decisions", "decode: host-tier hits by the break-even "
                                      "rule's choice", ["decision"], registry=r)
        self.pool_slots = Gauge("kvt_kv_pool_slots_used", "decode: KV pool slots held by requests", registry=r)
        self.free_blocks = Gauge("kvt_kv_pool_free_blocks", "decode: KV pool blocks held by no request and no cached "
                                 "context", registry=r)
        self.shared_blocks = Gauge("kvt_kv_pool_shared_blocks", "decode: KV pool blocks held by several requests or "
                                   "cached contexts at once (a shared opening's, held once)", registry=r)
        self.preemptions = Counter("kvt_preemptions", "decode: running requests preempted (a step needed their KV "
                                   "blocks; each was readmitted and continued), by how its context came back: "
                                   "recompute or swap (the host tier)", ["how"], registry=r)
        self.running = Gauge("kvt_decode_running", "decode: sequences in the running batch (or joining it)",
                             registry=r)
        self.prompts_queued = Gauge("kvt_decode_prompts_queued", "decode: prompts whose chunks wait to ride in decode "
                                    "steps (--mixed-prefill), begun or not", registry=r)
        self.batch_size = Histogram("kvt_decode_batch_size", "decode: sequences advanced per step",
                                    buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256), registry=r)
        self.prompt_rows = Counter("kvt_decode_prompt_rows", "decode: prompt tokens that rode in decode steps "
                                   "(--mixed-prefill)", registry=r)
        self.mixed_steps = Counter("kvt_decode_mixed_steps", "decode: steps that carried prompt rows, by the step's "
                                   "size in rows (--prefill-chunk, --mixed-max-rows; 0: eager, no graphs)", ["rows"],
                                   registry=r)
        self.device_s = Counter("kvt_decode_device_seconds", "decode: device time of the decode steps, launch to "
                                "end (CUDA events; over wall time: how busy the scheduler keeps the GPU; an eager "
                                "step's span includes its host launches)", registry=r)
        self.step_device_s = Counter("kvt_decode_step_device_seconds", "decode: the steps' device time by kind: a "
                                     "mixed step's size in rows, or decode (no prompt rows); over "
                                     "kvt_decode_mixed_steps / kvt_decode_decode_only_steps, a kind's mean step",
                                     ["rows"], registry=r)
        self.staging_s = Counter("kvt_decode_step_staging_seconds", "decode: of kvt_decode_device_seconds, the time "
                                 "before each graph's replay: the step's input copies, and the device waiting on "
                                 "the host's launches when the host falls behind (CUDA graphs only)", registry=r)
        self.decode_only_steps = Counter("kvt_decode_decode_only_steps", "decode: steps without prompt rows",
                                         registry=r)
        self.pairings = Counter("kvt_pairings", "pairings with the peer (the first one and every re-pairing)",
                                registry=r)

    def export_peer_up(self, export: bool) -> None:
        """kvt_peer_up belongs to a pair; a server without a peer (colocated) does not export it, since its 0
        would read as a pair that is down."""
        if not export and self._peer_up_exported:
            self.registry.unregister(self.peer_up)
            self._peer_up_exported = False

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP on `addr:port`; returns the port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port

    def finished(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def moved(self, nbytes: int, seconds: float, mode: str) -> None:
        self.bytes.inc(nbytes)
        self.transfer_ms.labels(mode).observe(seconds * 1e3)
        if seconds > 0:
            self.gbps.set(nbytes / seconds / 1e9)

    def stepped(self, stats) -> None:
        """One delivered decode step (kvtransfer.engine.queued.StepStats)."""
        if stats.rows:
            self.batch_size.observe(stats.rows)
        self.prompt_rows.inc(stats.prompt_rows)
        if stats.prompt_rows:
            self.mixed_steps.labels(str(stats.step_rows)).inc()
        else:
            self.decode_only_steps.inc()
        self.device_s.inc(stats.device_s)
        self.staging_s.inc(stats.staging_s)
        self.step_device_s.labels(str(stats.step_rows) if stats.prompt_rows else "decode").inc(stats.device_s)


def check_metrics_flags(port: int, addr: str) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port {port}: use 1..65535, or 0 for no metrics endpoint")
    if not addr:
        raise ValueError("--metrics-addr must not be empty (127.0.0.1 keeps it on this host)")


def start_metrics(role: str, port: int, addr: str):
    """The server's Metrics (always, so code records unconditionally), served on addr:port unless port is 0."""
    metrics = Metrics(role)
    if port:
        try:
            metrics.serve(port, addr)
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {addr}:{port} (--metrics-port/--metrics-addr): {e}") from None
        log.info("metrics on http://%s:%d/metrics", addr, port)
    return metrics
