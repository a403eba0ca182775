"""Where the next token is chosen: from a step's logits to each row's next token, on the device.

Why a file of its own: the choice is made in three places that must agree, or a request would decode
differently colocated and disaggregated: the decode step's rows (queued.py, gathered on the device for the
step after, with no host sync), a prompt's first token at the end of a local prefill (engine.py, mixed.py's
last chunk) and at the end of a remote one (the prefill worker). All three call the functions here.

Greedy (no SamplingParams, or temperature 0) is argmax; ties go to the lowest id, as in HF's greedy search. A
step whose rows are all greedy runs argmax and nothing else (`next_tokens`, `first_token`).

Sampling (`sample`) is one draw per row by inverse CDF over a kept set defined by thresholds (ties kept, so no
tie order matters; vLLM's top-k keeps every logit >= the k-th value alike). Per row: l the logits as float32, M
= max(l), t the temperature, w_i = exp((l_i - M) / t) (float32), Z = sum w.
- top_k in (0, vocab): tau_k = the k-th largest value of l (with multiplicity); else -inf.
- top_p < 1: tau_p = the largest value v of the row with sum_{l_i >= v} w_i >= top_p * Z; else -inf.
- kept = {i : l_i >= max(tau_k, tau_p)}: never empty (the max is kept), every tie of the threshold in it.
- the token: the first id, in id order, whose running sum of w over the kept ids passes u x (the kept mass);
  past the end (rounding) the last kept id.
The one uniform u of a row is a counter-based hash of (seed, position) alone (`uniform`: SplitMix64 keyed by the
seed, its position-th output). "position" is the number of tokens before the drawn one: the prompt's length for
the first token, and for a decode row whose input token sits at index `length` of its slot, length + 1.

Two implementations of that one definition: on CUDA with triton, a fixed sequence of six launches
(kvtransfer/kernels/triton_sample.py: no sort, each row cut over several programs, the threshold found by a
search over the row's values, the masses summed exactly in int64 fixed point, the uniform hashed in the kernel);
elsewhere (CPU, CUDA without triton) `sample_ref` in torch (a sort finds the thresholds; sums in float64). Each is
deterministic and row-wise, so given its logits a row's token depends on nothing else in its batch, nor on how
many programs its row was cut into (the logits themselves do depend on the batch, within the batching tolerance:
docs/architecture.md, "Exactness and determinism"): a seeded request's draw is a function of (seed, position,
logits) alone, colocated or disaggregated. The two sum differently, so they give the same token except where a
mass sum lands within rounding (about vocab x 2^-40 of the row's mass) of a threshold (top_p * Z) or of the
target (u x kept mass).

On CUDA the decode step's draw is `Sampler`: `sample` captured as CUDA graphs per batch bucket, replayed after the
step when the batch has a sampling row. Each bucket has a graph that reads the step graph's own logits buffer in
place (the plain decode step: no copy of the (n, vocab) logits), and one over a buffer of the Sampler's own that
other logits are copied into (a mixed step's rows with its finished prompts' last rows). The per-row parameters
go up in one host-to-device copy (`Draws.packed`) into a static buffer. Eagerly (CPU, --no-cuda-graphs, a batch
past the largest bucket, a prompt's first token) `sample` runs as it is: the same function, the same kernel, the
same bits.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.kernels._checks import last_dim_unit
from kvtransfer.kernels.backend import triton_available

log = logging.getLogger("kvtransfer.decode.graphs")
_U64 = 1 << 64


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= _U64 - 1
    return x - _U64 if x >= 1 << 63 else x


GAMMA = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment
MIX1 = _signed(0xBF58476D1CE4E5B9)
MIX2 = _signed(0x94D049BB133111EB)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens past argmax (a request without one is greedy)."""

    temperature: float = 0.0  # 0: greedy; > 0: softmax(logits / temperature)
    top_p: float = 1.0  # (0, 1]: the smallest set of likeliest tokens whose mass reaches it
    top_k: int = 0  # keep the k likeliest tokens (0: all)
    seed: int = 0  # 0 .. 2**64 - 1: with the position, the row's uniform

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_params(temperature: float, top_p: float | None = None, top_k: int = 0,
                    seed: int | None = None) -> SamplingParams | None:
    """A request's sampling as the servers take it from the wire: None (greedy) at temperature 0; a missing seed is
    drawn here (the decode server calls this at admission, and sends the seed on to the prefill worker)."""
    if temperature == 0:
        return None
    return SamplingParams(float(temperature), 1.0 if top_p is None else float(top_p), int(top_k),
                          secrets.randbits(63) if seed is None else int(seed))


def next_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits (n, vocab) -> (n,) int64 on the same device, greedy; no host sync."""
    return logits.argmax(dim=-1)


def first_token(logits: torch.Tensor, sampling: SamplingParams | None = None, position: int = 0) -> torch.Tensor:
    """A prompt's last-row logits (vocab,) or (1, vocab) -> its first generated token, a 0-d int64 tensor.
    `position`: the prompt's length (the tokens before this one)."""
    if sampling is None or sampling.greedy:
        return logits.reshape(-1).argmax()
    row = logits.reshape(1, -1)  # (1, vocab)
    params = Draws([sampling], [position]).packed().to(row.device, non_blocking=True)  # (1, 4)
    return sample(row, *columns(params))[0]


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 bits (products wrap mod 2**64, as uint64 ones do)."""
    z = (z ^ _srl(z, 30)) * MIX1
    z = (z ^ _srl(z, 27)) * MIX2
    return z ^ _srl(z, 31)


def uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """(n,) int64 seeds (uint64 bits) and positions -> (n,) float64 in [0, 1): the position-th output (counting
    from 0) of SplitMix64 started at mix(seed), its top 53 bits. A pure function of (seed, position)."""
    z = _mix(_mix(seed) + (position + 1) * GAMMA)
    return _srl(z, 11).double() * 2.0 ** -53


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seed: torch.Tensor, position: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """logits (n, vocab), per row: temperature and top_p (n,) float32, top_k, seed, position (n,) int64 -> (n,)
    int64 tokens. Temperature-0 rows take argmax (exactly `next_tokens`); the others draw as the module says. No
    host sync, no host-made tensor: capturable as a CUDA graph. use_triton: None = the Triton kernel where
    `triton_available` (CUDA and an importable triton), else `sample_ref`; True/False force one (True on CPU
    tensors: the Triton interpreter, in tests)."""
    if triton_available(logits.device) if use_triton is None else use_triton:
        from kvtransfer.kernels.triton_sample import sample_triton

        return sample_triton(last_dim_unit(logits), temperature, top_p, top_k, seed, position)
    return sample_ref(logits, temperature, top_p, top_k, seed, position)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
               seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """`sample` in torch ops (CPU, and CUDA without triton): the module's definition with the thresholds read off
    the row sorted by value (only values: the kept set is by value, so no tie order enters) and the masses summed
    in float64."""
    vocab = logits.shape[1]
    greedy = temperature == 0  # (n,)
    x = logits.float()  # (n, vocab)
    top = x.max(dim=-1, keepdim=True).values  # (n, 1): M
    t = torch.where(greedy, 1.0, temperature.float())[:, None]  # (n, 1): greedy rows draw too, at 1, then argmax
    w = ((x - top) / t).exp()  # (n, vocab) float32, 1 at the max
    sv = x.sort(dim=-1, descending=True).values  # (n, vocab)
    cum = ((sv - top) / t).exp().double().cumsum(-1)  # (n, vocab): cum[r] = the mass of the r + 1 largest
    neg = torch.full_like(top, float("-inf"))
    k = top_k.clamp(1, vocab)[:, None] - 1  # (n, 1)
    tau_k = torch.where(((top_k > 0) & (top_k < vocab))[:, None], sv.gather(1, k), neg)  # the k-th largest
    # tau_p: the value at the first rank whose cum reaches top_p * Z; its whole tie group's mass (>= cum there)
    # reaches it too, and every larger value's group ends before that rank
    r = (cum < top_p.double()[:, None] * cum[:, -1:]).sum(-1, keepdim=True).clamp(max=vocab - 1)  # (n, 1)
    tau_p = torch.where((top_p < 1)[:, None], sv.gather(1, r), neg)
    keep = x >= torch.maximum(tau_k, tau_p)  # (n, vocab)
    c = torch.where(keep, w, 0.0).double().cumsum(-1)  # (n, vocab): the kept mass's running sum, in id order
    target = uniform(seed, position)[:, None] * c[:, -1:]  # (n, 1) in [0, kept mass)
    j = (c <= target).sum(-1)  # (n,): the first id whose running sum passes the target (vocab: none)
    last = vocab - 1 - keep.flip(-1).to(torch.uint8).argmax(-1)  # (n,): the last kept id
    tok = torch.where(j < vocab, j, last)
    return torch.where(greedy, logits.argmax(dim=-1), tok)


@dataclass(frozen=True)
class Draws:
    """One call's rows as `sample` reads them, built on the host: each row's SamplingParams (None: greedy) and
    position (the tokens before the one drawn)."""

    params: Sequence[SamplingParams | None]
    positions: Sequence[int]

    @staticmethod
    def of(params: Sequence[SamplingParams | None], positions: Sequence[int]) -> Draws | None:
        """None when every row is greedy: the caller then runs argmax and nothing of this."""
        if all(p is None or p.greedy for p in params):
            return None
        return Draws(params, positions)

    def tensors(self, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, 2) float32 [temperature, top_p] and (rows, 3) int64 [top_k, seed, position] on the host; rows
        past the call's (padding up to a graph's bucket) are greedy."""
        floats, ints = [], []
        for p, pos in zip(self.params, self.positions):
            if p is None or p.greedy:
                floats.append((0.0, 1.0))
                ints.append((0, 0, pos))
            else:
                floats.append((p.temperature, p.top_p))
                ints.append((p.top_k, _signed(p.seed), pos))
        pad = max(rows - len(floats), 0)
        return (torch.tensor(floats + [(0.0, 1.0)] * pad, dtype=torch.float32),
                torch.tensor(ints + [(0, 0, 0)] * pad, dtype=torch.long))

    def packed(self, rows: int = 0) -> torch.Tensor:
        """`tensors` as one (rows, 4) int64 host tensor, for one copy: [temperature and top_p (two float32s' bits),
        top_k, seed, position]; `columns` reads it back."""
        floats, ints = self.tensors(rows)
        return torch.cat([floats.view(torch.int64), ints], dim=1)  # (rows, 2) float32 -> (rows, 1) int64 bits


def columns(packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`Draws.packed`'s (rows, 4) int64 (on any device) -> temperature, top_p (float32), top_k, seed, position, each
    (rows,): views, no copy."""
    floats = packed[:, :1].view(torch.float32)  # (rows, 1) int64 -> (rows, 2) float32, row stride 8
    return floats[:, 0], floats[:, 1], packed[:, 1], packed[:, 2], packed[:, 3]


class Sampler:
    """`sampler(logits, draws)` -> (n,) int64: `sample` over a step's rows, as CUDA graphs per size in `sizes` (the
    step's batch buckets) when `cuda_graphs` on CUDA, else eager. `outputs` {size: the step graph's logits buffer
    (size, vocab)}: those sizes also get a graph reading that buffer in place, replayed when the logits handed in
    are its leading rows. The graphed result is a view into the graph's output buffer: valid until the next call
    (like the step's logits)."""

    def __init__(self, vocab: int, dtype: torch.dtype, device: torch.device, sizes: list[int], cuda_graphs: bool,
                 outputs: dict[int, torch.Tensor] | None = None):
        self.vocab, self.dtype, self.device, self.sizes = vocab, dtype, device, sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # over self.logits (copied in)
        self.direct: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}  # (graph, out, input)
        if cuda_graphs and device.type == "cuda" and self.sizes:
            self._capture({b: x for b, x in (outputs or {}).items() if b in self.sizes})

    def _inputs(self, logits: torch.Tensor, b: int) -> tuple[torch.Tensor, ...]:
        return (logits[:b], *columns(self.params[:b]))

    def _capture(self, outputs: dict[int, torch.Tensor]) -> None:
        rows, dev = self.sizes[-1], self.device
        self.logits = torch.zeros(rows, self.vocab, dtype=self.dtype, device=dev)
        self.params = torch.zeros(rows, 4, dtype=torch.long, device=dev)  # Draws.packed's columns
        warm = Draws([SamplingParams(1.0, 0.9)] * rows, [0] * rows).packed()  # every op of the sampling path runs
        self.params.copy_(warm)  # once before capture
        torch.cuda.synchronize(dev)
        before, t0 = torch.cuda.memory_allocated(dev), time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()  # its own: never shared with the step's graphs
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for b in self.sizes:
                sample(*self._inputs(self.logits, b))
        torch.cuda.current_stream(dev).wait_stream(side)
        for b in reversed(self.sizes):  # the largest first: it sizes the shared pool
            for x, into in ((self.logits, None), (outputs.get(b), self.direct)):
                if x is None:
                    continue
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=mempool):
                    out = sample(*self._inputs(x, b))
                if into is None:
                    self.graphs[b] = (g, out)
                else:
                    into[b] = (g, out, x)
        torch.cuda.synchronize(dev)
        log.info("captured %d sampling CUDA graphs (rows %s; %d reading the step's logits in place) in %.1f s, "
                 "%.0f MiB", len(self.graphs) + len(self.direct), ",".join(map(str, self.sizes)), len(self.direct),
                 time.perf_counter() - t0, (torch.cuda.memory_allocated(dev) - before) / 2**20)

    def __call__(self, logits: torch.Tensor, draws: Draws) -> torch.Tensor:
        n = logits.shape[0]
        b = next((s for s in self.sizes if s >= n), 0) if self.graphs else 0
        params = draws.packed(b)  # (max(n, b), 4) on the host
        if logits.device.type == "cuda":  # pinned: a copy from pageable memory may wait for the queued step
            params = params.pin_memory()
        if not b:
            return sample(logits, *columns(params.to(logits.device, non_blocking=True)))
        self.params[:b].copy_(params, non_blocking=True)
        direct = self.direct.get(b)
        if direct is not None and logits.data_ptr() == direct[2].data_ptr() and logits.stride() == direct[2].stride():
            g, out, _ = direct  # the step's own buffer: read in place
        else:
            self.logits[:n].copy_(logits)
            g, out = self.graphs[b]
        g.replay()
        return out[:n]
