"""The prefill worker's device work: prompt -> cache, streamed layer by layer, -> first token.

Why a class apart from the gRPC servicer: this is the only code that touches the model
and the data plane, it runs on one thread that owns the device, and tests and the bench
can drive it without a server.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvtransfer.determinism import sync
from kvtransfer.engine.sampler import SamplingParams, first_token
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import logits_digest, prefill, random_prompt
from kvtransfer.model.streaming import cache_layers
from kvtransfer.transport import TransferError, TransferHeader

log = logging.getLogger("kvtransfer.prefill")

WARMUP_REQUEST_ID = 0  # the decode side's receive loop drops this frame


@dataclass
class PrefillResult:
    first_token: int
    first_logits_digest: str
    prefill_ms: float
    send_done_ms: float
    mode: str


class PrefillWorker:
    def __init__(self, loaded: LoadedModel, send_timeout_s: float = 60.0, fault=None, invariant=None):
        """`invariant`: kvtransfer.engine.invariant_prefill.InvariantPrefill (--batch-invariant): the prompt runs
        through it (layer-wise: each layer goes out from its last piece's forward)."""
        self.m = loaded
        self.invariant = invariant
        self.send_timeout_s = send_timeout_s
        self.fault = fault  # faults.StallFault, for the fault tests
        self.sending_bytes = 0  # the cache being sent (held until the transfer ends)

    def header(self, request_id: int, seq_len: int) -> TransferHeader:
        g = self.m.geometry
        return TransferHeader(request_id=request_id, seq_len=seq_len, num_layers=g.num_layers,
                              kv_heads=g.kv_heads, head_dim=g.head_dim, dtype=g.dtype)

    def run(self, link, request_id: int, token_ids: list[int], mode: str, want_digest: bool,
            sampling: SamplingParams | None = None) -> PrefillResult:
        """Prefill and ship the cache over `link` (the asking decode worker's). `mode` is "layerwise" or "bulk"; `sampling` chooses the first token (None:
        greedy), at position len(token_ids), as the decode server's local prefill does. Raises
        TransferError/ValueError."""
        ids = torch.tensor([token_ids], dtype=torch.long).to(self.m.device, non_blocking=True)  # (1, seq)
        header = self.header(request_id, len(token_ids))
        sender = _transport_errors(link.open)(header)
        send = _transport_errors(sender.send_layer)
        if self.fault is not None and request_id != WARMUP_REQUEST_ID:
            send = self.fault.wrap(request_id, header.num_layers, send)
        self.sending_bytes = header.layer_bytes() * header.num_layers
        try:
            sync(self.m.device)
            t0 = time.perf_counter()
            if self.invariant is not None:  # per layer (k, v): (1, kv_heads, n, head_dim)
                layers, logits = self.invariant.run(ids, on_layer=send if mode == "layerwise" else None)
            elif mode == "layerwise":
                cache, logits = prefill(self.m.model, ids, on_layer=send)
            else:
                cache, logits = prefill(self.m.model, ids)
                layers = cache_layers(cache)
            first = first_token(logits, sampling, len(token_ids))
            if mode == "bulk":
                for i, (k, v) in enumerate(layers):
                    send(i, k, v)
            token = int(first)  # host waits for the compute stream: prefill is done
            t_prefill = time.perf_counter()
            _transport_errors(sender.finish)(timeout=self.send_timeout_s)
            t_sent = time.perf_counter()
        except BaseException as e:
            try:
                sender.abort(f"prefill failed: {e}")
            except Exception as abort_error:  # a broken data plane may refuse the abort too; the first error wins
                log.warning("request %d: abort after a failure failed too: %s", request_id, abort_error)
            raise
        finally:
            self.sending_bytes = 0
        digest = logits_digest(logits) if want_digest else ""
        return PrefillResult(token, digest, (t_prefill - t0) * 1e3, (t_sent - t0) * 1e3, mode)

    def warmup(self, tokens: int, link) -> None:
        """One transfer of the real pattern over `link` so its first request pays no communicator set-up."""
        if tokens <= 0:
            return
        ids = random_prompt(self.m.model.config.vocab_size, tokens).view(-1).tolist()
        for mode in ("layerwise", "bulk"):
            self.run(link, WARMUP_REQUEST_ID, ids, mode, want_digest=False)
        log.info("warm-up transfers done (%d tokens, layerwise and bulk)", tokens)


def _transport_errors(fn):
    """A transport op whose RuntimeError (e.g. gloo's "Connection closed by peer") becomes TransferError("peer")."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TransferError:
            raise
        except RuntimeError as e:
            raise TransferError("peer", f"data plane failed: {e}") from e
    return call
