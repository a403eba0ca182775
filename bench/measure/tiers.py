"""Host tiers: move a KV cache off the model device and back, as the offload baseline.

Why: reloading a cache from GPU memory, pinned or pageable host RAM, or a local file is
the yardstick every transport is judged against (is moving the cache cheaper than a
prefill?) and the known-correct oracle for byte equality. Each tier allocates one flat
buffer in `prepare` (untimed); `offload` and `reload` are then pure copies into
preallocated memory, so a timer around them measures the link, not the allocator.
Copies may be asynchronous: call `tier.sync()` before reading any timer.

Layout in every flat buffer: layer i is (2, batch, kv_heads, seq, head_dim), K then V,
layers back to back -- the physical layout of `StreamingCache.block`, so a cache that
lives in one block moves in one copy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from bench.measure.pagecache import drop_page_cache, read_file, write_file
from kvtransfer.determinism import sync

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): (batch, kv_heads, seq, head_dim)


def contiguous_span(layers) -> torch.Tensor | None:
    """A flat uint8 view over all of K0, V0, K1, ... when they lie back to back in one storage."""
    tensors = [t for kv in layers for t in kv]
    if not tensors or not all(t.is_contiguous() for t in tensors):
        return None
    first, ptr = tensors[0], tensors[0].data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.data_ptr() != ptr:
            return None
        ptr += t.nbytes
    byte_off = first.data_ptr() - first.untyped_storage().data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(), byte_off, (ptr - first.data_ptr(),))


def flat_views(flat: torch.Tensor, like: Layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Typed (K, V) views over a flat uint8 buffer, shaped and ordered like `like`."""
    out, off = [], 0
    for k, v in like:
        pair = []
        for t in (k, v):
            pair.append(flat[off:off + t.nbytes].view(t.dtype).view(t.shape))
            off += t.nbytes
        out.append((pair[0], pair[1]))
    return out


def copy_layers(dst: torch.Tensor, dst_views: Layers, src: Layers, span: torch.Tensor | None,
                non_blocking: bool) -> None:
    """Copy a cache into a flat buffer: one copy when the source is one `span`, else one per tensor."""
    if span is not None:
        dst.copy_(span, non_blocking=non_blocking)
        return
    for (dk, dv), (sk, sv) in zip(dst_views, src, strict=True):
        dk.copy_(sk, non_blocking=non_blocking)
        dv.copy_(sv, non_blocking=non_blocking)


def _indexed(device) -> torch.device:
    """`cuda` -> `cuda:N` (the current device), so two names for one GPU compare equal."""
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device == torch.device("cuda") else device


class Tier:
    """One place to park a cache. Subclasses set `kind` and define `_storage`, `_offload`, `_reload`."""

    kind = "tier"
    label = "tier"  # what it is on this device, for the tables
    skip_reason: str | None = None  # set when the tier cannot run on this machine

    def __init__(self, device: torch.device | str):
        self.device = _indexed(device)
        self.devices = [self.device]
        self.nbytes = 0
        self.out: torch.Tensor | None = None  # (nbytes,) uint8 on self.device: reload target
        self.out_layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def available(self) -> bool:
        return self.skip_reason is None

    def prepare(self, layers: Layers) -> None:
        """Allocate the tier's buffer and the device reload target for caches shaped like `layers`."""
        if not self.available:
            raise RuntimeError(f"tier {self.kind} is unavailable: {self.skip_reason}")
        self._like = [(k.detach(), v.detach()) for k, v in layers]
        self._src = tuple(t for kv in layers for t in kv)  # offloading these again skips checks
        self._span = contiguous_span(layers)
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        self.out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.out_layers = flat_views(self.out, layers)
        self._storage()

    def _source_span(self, layers: Layers) -> torch.Tensor | None:
        """The one-copy span of `layers`, after checking they match what `prepare` saw (cheap when same)."""
        flat = [t for kv in layers for t in kv]
        if len(flat) == len(self._src) and all(a is b for a, b in zip(flat, self._src)):
            return self._span
        if len(layers) != len(self._like) or any(
                (k.shape, k.dtype, v.shape, v.dtype) != (a.shape, a.dtype, b.shape, b.dtype)
                for (k, v), (a, b) in zip(layers, self._like)):
            raise ValueError(f"tier {self.kind}: cache does not match the shapes it was prepared for")
        return contiguous_span(layers)

    def offload(self, layers: Layers) -> None:
        """Copy the cache into the tier (may be asynchronous: `sync()` before a timer)."""
        self._offload(layers, self._source_span(layers))

    def before_reload(self) -> dict:
        """Untimed work before a reload; returns what it found (the disk tier drops the page cache)."""
        return {}

    def reload(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copy the cache back into the preallocated device tensors and return them (views of `out`)."""
        self._reload()
        return self.out_layers

    def sync(self) -> None:
        for d in self.devices:
            sync(d)

    def close(self) -> None:
        self.sync()
        self.out, self.out_layers, self._like, self._src, self._span = None, [], [], (), None


class MemoryTier(Tier):
    """A flat buffer on a device (`gpu`), in pinned host RAM (`pinned`) or pageable RAM (`pageable`)."""

    def __init__(self, kind: str, device, peer: torch.device | str | None = None):
        super().__init__(device)
        self.kind = kind
        cuda = self.device.type == "cuda"
        if kind == "gpu":
            self.where = _indexed(peer) if peer is not None else self.device
            if self.where != self.device:
                self.devices.append(self.where)
        elif kind in ("pinned", "pageable"):
            self.where = torch.device("cpu")
            if kind == "pinned" and not cuda:
                self.skip_reason = ("pinned host memory needs a CUDA device "
                                    + ("(model device is cpu)" if torch.cuda.is_available()
                                       else "(CUDA not available)"))
        else:
            raise ValueError(f"unknown memory tier {kind!r}")
        self.label = {"gpu": f"gpu buffer ({self.where})" if self.where.type == "cuda"
                      else f"device buffer ({self.where}: no GPU, a second copy in RAM)",
                      "pinned": "pinned host RAM", "pageable": "pageable host RAM"}[kind]
        # D2H into pageable memory must not be asynchronous: the host could read before the copy.
        self.non_blocking = cuda and kind != "pageable"

    def _storage(self) -> None:
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.where,
                               pin_memory=self.kind == "pinned")
        self.buf_layers = flat_views(self.buf, self._like)

    def _offload(self, layers: Layers, span: torch.Tensor | None) -> None:
        copy_layers(self.buf, self.buf_layers, layers, span, self.non_blocking)

    def _reload(self) -> None:
        self.out.copy_(self.buf, non_blocking=self.non_blocking)

    def close(self) -> None:
        super().close()
        self.buf, self.buf_layers = None, []


class DiskTier(Tier):
    """A local file, written with or without fsync; reloaded after an attempt to drop it from the page cache.

    Offload copies into a host staging buffer (pinned on CUDA) and writes it; reload reads the
    file into pinned staging then copies H2D on CUDA, or straight into the reload target on CPU.
    """

    def __init__(self, device, directory: str, fsync: bool):
        super().__init__(device)
        self.kind = "disk-fsync" if fsync else "disk"
        self.label = "local disk, fsync'd" if fsync else "local disk"
        self.fsync = fsync
        self.path = os.path.join(directory, f"kvcache-{self.kind}-{os.getpid()}-{id(self):x}.bin")
        self.fd: int | None = None

    def _storage(self) -> None:
        # Host staging, never the reload target: a reload must really read the file.
        self.stage = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.stage_layers = flat_views(self.stage, self._like)
        self.stage_mv = memoryview(self.stage.numpy()).cast("B")
        # On CPU the file is read straight into the reload target; on CUDA into pinned staging.
        self.read_mv = self.stage_mv if self.device.type == "cuda" else memoryview(self.out.numpy()).cast("B")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def _offload(self, layers: Layers, span: torch.Tensor | None) -> None:
        copy_layers(self.stage, self.stage_layers, layers, span, non_blocking=False)
        write_file(self.fd, self.stage_mv, self.fsync)

    def before_reload(self) -> dict:
        return drop_page_cache(self.fd, self.nbytes)

    def _reload(self) -> None:
        if self.device.type != "cuda":
            read_file(self.fd, self.read_mv)
            return
        torch.cuda.current_stream(self.device).synchronize()  # a previous H2D may still read stage
        read_file(self.fd, self.read_mv)
        self.out.copy_(self.stage, non_blocking=True)

    def close(self) -> None:
        super().close()
        if self.fd is not None:
            os.close(self.fd)
            os.unlink(self.path)
            self.fd = None
        self.stage, self.stage_layers, self.stage_mv, self.read_mv = None, [], None, None


TIER_KINDS = ("gpu", "pinned", "pageable", "disk", "disk-fsync")


def make_tiers(device, directory: str, peer: torch.device | str | None = None,
               kinds: Sequence[str] = TIER_KINDS) -> list[Tier]:
    """The tiers in `kinds`, in order; unavailable ones carry a `skip_reason` instead of raising.

    `peer` puts the `gpu` tier's buffer on another device (default: the model device).
    """
    tiers: list[Tier] = []
    for kind in kinds:
        if kind in ("gpu", "pinned", "pageable"):
            tiers.append(MemoryTier(kind, device, peer if kind == "gpu" else None))
        elif kind in ("disk", "disk-fsync"):
            tiers.append(DiskTier(device, directory, fsync=kind == "disk-fsync"))
        else:
            raise ValueError(f"unknown tier {kind!r}; choose from {', '.join(TIER_KINDS)}")
    return tiers
