"""Decode server configuration: one frozen dataclass, validated once, CLI flags map 1:1.

Why two sets of TLS/token flags: the front door (users, the bench) and the channel to the
prefill worker (a peer inside the deployment) are different trust relationships; each is
configured on its own, and each is plaintext unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvtransfer.engine.engine import check_options
from kvtransfer.engine.runner import GEMV_CHOICES
from kvtransfer.model.loaded import resolve_dtype
from kvtransfer.model.spec import ModelSpec
from kvtransfer.rpc.configargs import LOG_LEVELS, check_choices, flag, flag_name, one_line
from kvtransfer.rpc.flagchecks import check_address, check_device, check_dist_init, check_positive, check_seconds
from kvtransfer.rpc.limits import CONTROL_MESSAGE_LIMIT, MAX_WAITING, check_message_limit
from kvtransfer.rpc.metrics import check_metrics_flags
from kvtransfer.rpc.security import check_tls_flags, check_token_flags
from kvtransfer.transport.registry import options_from

ON_FAILURE = ("fail", "recompute")


@dataclass(frozen=True)
class DecodeConfig:
    listen: str = flag("127.0.0.1:50051", "the front door, HOST:PORT (loopback unless told otherwise)")
    prefill_addr: str = flag("127.0.0.1:50061", "the prefill workers' control planes, HOST:PORT[,HOST:PORT...]: "
                             "pairs with each; a request's prefill goes to the least loaded one that is up")
    colocated: bool = flag(False, "no prefill peer: this worker prefills itself (the baseline)")
    model: str = flag("tiny", "a preset (tiny, smollm2-135m, qwen2.5-7b: seeded random weights) or a local "
                      "Hugging Face directory; must match the prefill worker's")
    dtype: str = flag("auto", "weights and KV cache dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, "
                      "bfloat16, float16; must match the prefill worker's")
    seed: int = flag(0, "seed of a preset's random weights; must match the prefill worker's")
    device: str = flag("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    transport: str = flag("auto", "data plane: auto (nccl on cuda, gloo on cpu), nccl, gloo, grpc, cuda_ipc")
    data_listen: str = flag("127.0.0.1:0", "grpc / cuda_ipc: where the data plane listens (announced at the handshake)")
    data_tls_cert: str = flag("", "grpc data plane: serve TLS with this certificate chain (PEM)")
    data_tls_key: str = flag("", "grpc data plane: private key of --data-tls-cert (PEM)")
    data_tls_ca: str = flag("", "grpc data plane: require prefill client certificates signed by this CA (PEM)")
    ipc_slots: int = flag(2, "cuda_ipc: receive slots of --max-prompt-tokens each")
    grpc_listener_workers: int = flag(64, "grpc: concurrent data streams (>= the peer's channels x requests in flight)")
    dist_op_timeout_s: float = flag(0.0, "nccl/gloo: one group operation's timeout, s (0: a week on NCCL, "
                                    "--dist-timeout-s on gloo)")
    dist_init: str = flag("env://", "nccl/gloo rendezvous hosted by the prefill worker: env://, tcp://HOST:PORT "
                          "or file:///PATH; with several --prefill-addr, one each, comma-separated, in their order")
    max_prompt_tokens: int = flag(32768, "longest prompt accepted; longer: INVALID_ARGUMENT")
    max_new_tokens: int = flag(4096, "most tokens one request may ask for")
    max_inflight: int = flag(0, "requests in the server at once, waiting ones included; beyond it: "
                             "RESOURCE_EXHAUSTED at once (0: no cap; --max-waiting bounds the queue)")
    max_waiting: int = flag(MAX_WAITING, "requests that may wait for KV memory, admitted in arrival order, each as "
                            "long as its deadline allows; beyond it: RESOURCE_EXHAUSTED at once (0: none waits)")
    max_batch: int = flag(0, "KV pool rows: requests decoded together (more wait in arrival order); 0: 256 on CUDA "
                          "(half a mixed step's rows), 16 on CPU; --kv-block-tokens 0: slots of --max-seq-len")
    max_seq_len: int = flag(0, "tokens per KV pool slot: prompt + max_new_tokens must fit; 0: the model's context, "
                            "capped by the pool (CPU: at most 4096)")
    kv_pool_gib: float = flag(0.0, "KV pool size, GiB; 0: what --gpu-memory-utilization leaves after the weights "
                              "and a prefill workspace (CUDA), 16 slots (CPU)")
    kv_block_tokens: int = flag(64, "the KV pool in blocks of this many tokens: a request takes the blocks its "
                                "prompt and answer need as it goes, not a whole --max-seq-len slot (docs/paging.md); "
                                "0: one slot of --max-seq-len per request")
    gpu_memory_utilization: float = flag(0.9, "share of the GPU's memory this server may hold (weights, KV pool, "
                                         "workspace); two servers on one GPU: split it between them")
    cuda_graphs: bool = flag(True, "capture the decode step as CUDA graphs per batch bucket (CUDA only)")
    gemv: str = flag("auto", "batch-1 projections by the Triton GEMV (CUDA): auto times it against cuBLAS at start "
                     "and keeps it where >= 5%% faster (two servers may pick differently, and then differ in the "
                     "last bits); on: every projection; off: cuBLAS only. Servers whose outputs must agree: give "
                     "each the same on or off (--deterministic: off)", choices=GEMV_CHOICES)
    prefill_chunk: int = flag(-1, "colocated/recompute prefill: tokens per chunk between decode steps (0: whole; "
                              "-1: --mixed-prefill steps of up to 512 rows on CUDA, whole on CPU)")
    mixed_prefill: bool | None = flag(None, "prompt chunks ride in the decode steps' forward (Sarathi-style piggybacking) "
                               "instead of running between two steps; --prefill-chunk is then the rows of such a "
                               "step, decode rows included (>= 2 x --max-batch; 256 on an H200). Default: on with CUDA when --prefill-chunk "
                               "is -1")
    exact: bool = flag(False, "whole-prompt prefill only (no chunked or mixed prefill): a request alone decodes "
                       "bit-identically colocated and disaggregated (with --deterministic on GPU)")
    batch_invariant: bool = flag(False, "a request's logits the same bits whatever runs beside it, however its "
                                 "prompt is cut into steps, cached or not: every projection by a batch-invariant "
                                 "GEMM, every prompt row attending as a decode row, prompts prefilled in the steps "
                                 "(docs/batch-invariance.md); a prefill worker must run it too (handshake). CPU "
                                 "and CUDA (Triton kernels on CUDA)")
    mixed_max_rows: int = flag(0, "with --mixed-prefill: also capture steps of 2, 4 .. x --prefill-chunk rows, up to "
                               "this; a step takes the largest size that the prompt tokens waiting fill (drains a "
                               "burst of prompts in fewer steps; those steps' ITL grows). 0: --prefill-chunk only")
    prefix_cache: bool = flag(True, "keep a finished request's KV in its pool slot while no request needs the slot, "
                              "and prefill only what a later prompt adds to a cached prefix (docs/prefix-cache.md)")
    host_cache_gib: float = flag(0.0, "pinned host RAM for contexts evicted from the pool, GiB, copied back on a hit "
                                 "when that beats recomputing them (measured at start); 0: off")
    local_suffix_max_tokens: int = flag(1024, "disaggregated: a prompt whose cached prefix leaves at most this many "
                                        "tokens to prefill is prefilled here after the prefix; a longer one goes "
                                        "to the prefill worker whole (0: never reuse here)")
    admission_wait_s: float = flag(0.0, "longest wait for KV memory, s; then RESOURCE_EXHAUSTED (0: as long as the "
                                   "request's deadline allows)")
    stream_buffer_tokens: int = flag(1024, "tokens a client may leave unread; then its request ends")
    max_receive_bytes: int = flag(64 << 30, "one transfer's receive buffer limit; larger caches: RESOURCE_EXHAUSTED")
    max_message_bytes: int = flag(CONTROL_MESSAGE_LIMIT, "gRPC send/receive limit, both directions and to the peer")
    request_timeout_s: float = flag(120.0, "each request ends before this, s (unless the client's deadline is sooner)")
    on_failure: str = flag("fail", "peer or data plane failed a request: fail (UNAVAILABLE) or recompute here",
                           choices=ON_FAILURE)
    peer_timeout_s: float = flag(30.0, "longest wait for the prefill worker's answer + cache, s; then --on-failure")
    peer_keepalive_s: float = flag(2.0, "ping the prefill worker this often, s; unanswered as long: the link is down")
    handshake_timeout_s: float = flag(120.0, "at start, wait this long for the prefill worker (--prefill-addr) to "
                                      "answer the handshake, s; then exit 2")
    dist_timeout_s: float = flag(120.0, "nccl/gloo: joining the process group at --dist-init, s")
    shutdown_grace_s: float = flag(20.0, "on SIGTERM/SIGINT: time in-flight requests get to finish, s; the rest "
                                   "end UNAVAILABLE")
    tls_cert: str = flag("", "front door: PEM certificate chain, serve TLS")
    tls_key: str = flag("", "front door: PEM private key of --tls-cert")
    tls_ca: str = flag("", "front door: require client certificates signed by this CA (mTLS)")
    auth_token: str = flag("", "front door: shared secret required as `authorization: Bearer ...` (prefer the file)")
    auth_token_file: str = flag("", "front door: file holding that secret (first line)")
    prefill_tls_ca: str = flag("", "to the prefill worker: use TLS, verify its certificate with this CA")
    prefill_tls_cert: str = flag("", "to the prefill worker: client certificate (when it requires mTLS)")
    prefill_tls_key: str = flag("", "to the prefill worker: private key of --prefill-tls-cert")
    prefill_auth_token: str = flag("", "to the prefill worker: the token its --auth-token expects")
    prefill_auth_token_file: str = flag("", "to the prefill worker: file holding that token")
    metrics_port: int = flag(0, "Prometheus /metrics on this port (0: off)")
    metrics_addr: str = flag("127.0.0.1", "where /metrics listens (loopback unless told otherwise)")
    deterministic: bool = flag(False, "deterministic kernels (run-to-run identical logits on GPU; slower)")
    log_level: str = flag("INFO", "log level", choices=LOG_LEVELS)
    fail_scheduler_after_steps: int = flag(-1, "fault injection (tests): the scheduler thread dies after this many "
                                           "decode steps (-1: off)", hidden=True)

    @property
    def prefill_addrs(self) -> list[str]:
        """--prefill-addr's addresses, in order."""
        return [a.strip() for a in self.prefill_addr.split(",") if a.strip()]

    def unused_when_colocated(self) -> list[str]:
        """The peer's flags given beside --colocated, which has no peer (the server warns at start, and serves)."""
        peer_only = ("prefill_addr", "transport", "data_listen", "data_tls_cert", "data_tls_key", "data_tls_ca",
                     "grpc_listener_workers", "dist_init", "ipc_slots", "on_failure",
                     "peer_timeout_s", "peer_keepalive_s", "handshake_timeout_s", "dist_timeout_s",
                     "dist_op_timeout_s", "local_suffix_max_tokens", "prefill_tls_ca", "prefill_tls_cert",
                     "prefill_tls_key", "prefill_auth_token", "prefill_auth_token_file")
        defaults = {f.name: f.default for f in fields(self)}
        return [flag_name(f) for f in peer_only if self.colocated and getattr(self, f) != defaults[f]]

    @property
    def dist_inits(self) -> list[str]:
        """One rendezvous per prefill address (a single --dist-init serves them all: grpc/cuda_ipc ignore it)."""
        inits = [i.strip() for i in self.dist_init.split(",")]
        return inits if len(inits) > 1 else inits * len(self.prefill_addrs)

    def __post_init__(self):
        ModelSpec(self.model, "float32" if self.dtype == "auto" else self.dtype, self.seed)
        options_from(self, self.transport)  # the backend's options; refuses another backend's flags
        for name in ("max_prompt_tokens", "max_new_tokens", "max_receive_bytes",
                     "max_message_bytes", "stream_buffer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_batch < 0:
            raise ValueError("--max-batch must be >= 1, or 0 to fit the pool")
        if self.max_seq_len < 0 or self.max_seq_len == 1:
            raise ValueError("--max-seq-len must be >= 2 (a prompt token and a generated one), or 0 for the model's "
                             "context")
        if self.kv_pool_gib < 0 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--kv-pool-gib must be >= 0 (0: fit the device) and --gpu-memory-utilization in (0, 1]")
        if self.kv_block_tokens < 0 or self.kv_block_tokens == 1:
            raise ValueError("--kv-block-tokens must be >= 2 (a power of two such as 64 reads fastest), or 0 for one "
                             "slot of --max-seq-len per request")
        if self.kv_pool_gib and self.max_batch and self.max_seq_len and not self.kv_block_tokens:
            raise ValueError("--kv-pool-gib, --max-batch and --max-seq-len: give at most two, the third follows")
        if self.prefill_chunk < -1:
            raise ValueError("--prefill-chunk must be >= 0 (0: prefill in one piece), or -1 for the device's default")
        if self.exact and (self.prefill_chunk > 0 or self.mixed_prefill):
            raise ValueError("--exact prefills whole prompts: drop --prefill-chunk/--mixed-prefill, or drop --exact")
        if self.batch_invariant and (self.exact or self.mixed_prefill is False):
            raise ValueError("--batch-invariant prefills prompts in the decode steps on this server: drop --exact "
                             "and --no-mixed-prefill")
        if self.fail_scheduler_after_steps < -1:
            raise ValueError("--fail-scheduler-after-steps must be >= 0, or -1 (off)")
        check_options(max_batch=self.max_batch, prefill_chunk=self.prefill_chunk, mixed_prefill=self.mixed_prefill,
                      mixed_max_rows=self.mixed_max_rows)
        if self.host_cache_gib < 0 or (self.host_cache_gib and not self.prefix_cache):
            raise ValueError("--host-cache-gib must be >= 0, and holds what the prefix cache evicts: drop "
                             "--no-prefix-cache, or --host-cache-gib")
        if self.local_suffix_max_tokens < 0:
            raise ValueError("--local-suffix-max-tokens must be >= 0 (0: a reused prefix only when colocated)")
        if self.admission_wait_s < 0 or self.max_inflight < 0 or self.max_waiting < 0:
            raise ValueError("--admission-wait-s, --max-inflight and --max-waiting must be >= 0 (0: no time limit, "
                             "no cap, no queue)")
        check_positive(self, "request_timeout_s", "handshake_timeout_s", "peer_timeout_s", "peer_keepalive_s",
                       "dist_timeout_s")
        if self.dist_op_timeout_s < 0 or self.shutdown_grace_s < 0:
            raise ValueError("--dist-op-timeout-s and --shutdown-grace-s must be >= 0")
        check_seconds(self, "dist_op_timeout_s", "shutdown_grace_s", "admission_wait_s")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"--on-failure {self.on_failure!r}: choose fail (end the request with UNAVAILABLE) or "
                             "recompute (prefill on this worker instead)")
        check_choices(self)
        check_device("--device", self.device)
        check_metrics_flags(self.metrics_port, self.metrics_addr)
        check_address("--listen", self.listen)
        check_address("--data-listen", self.data_listen)
        if not self.colocated:
            addrs = self.prefill_addrs
            for a in addrs:
                check_address("--prefill-addr", a, allow_port_zero=False)
            if len(set(addrs)) != len(addrs):
                raise ValueError(f"--prefill-addr {self.prefill_addr}: an address is listed twice")
            inits = [i.strip() for i in self.dist_init.split(",")]
            if len(inits) not in (1, len(addrs)) or (len(inits) == 1 and len(addrs) > 1 and self.transport not in
                                                      ("grpc", "cuda_ipc")):
                raise ValueError(f"--dist-init {self.dist_init}: nccl/gloo (and auto) need one rendezvous per "
                                 f"--prefill-addr ({len(addrs)}), comma-separated, in the same order (each prefill "
                                 "worker hosts its own)")
            for i in inits:
                check_dist_init("--dist-init", i)
            if len(addrs) > 1 and not self.data_listen.endswith(":0") and ":" in self.data_listen:
                raise ValueError(f"--data-listen {self.data_listen}: with several --prefill-addr each pair listens "
                                 "on its own port; give port 0 (HOST:0)")
        check_message_limit(self.max_message_bytes, self.max_prompt_tokens)
        check_tls_flags("tls", self.tls_cert, self.tls_key, self.tls_ca, server=True)
        check_tls_flags("data-tls", self.data_tls_cert, self.data_tls_key, self.data_tls_ca, server=True)
        check_tls_flags("prefill-tls", self.prefill_tls_cert, self.prefill_tls_key, self.prefill_tls_ca, server=False)
        check_token_flags("auth", self.auth_token, self.auth_token_file)
        check_token_flags("prefill-auth", self.prefill_auth_token, self.prefill_auth_token_file)

    def spec(self, device) -> ModelSpec:
        """The model on `device`: --dtype auto resolved there."""
        return ModelSpec(self.model, resolve_dtype(self.dtype, device), self.seed)

    def one_line(self) -> str:
        return one_line(self)
