"""Prefix affinity: which worker last served a context that a prompt starts with, so the next turn of a
conversation goes back to the worker whose prefix cache holds its KV (docs/prefix-cache.md, docs/router.md).

Why the decode workers' own keys: a worker finds a cached prefix by the chained block keys of
kvtransfer.engine.prefix_index (block i's key hashes block i's tokens and block i - 1's key), and says its block
size in Info.prefix_block_tokens. Computing the same keys here (numpy and hashlib only) makes "this worker served
a context starting with these blocks" one dictionary lookup per block, with nothing sent to the worker. When a
request ends OK, the keys of what its worker then holds (the prompt and every generated token but the last, whose
KV no step wrote) are filed under that worker; a later prompt's deepest known key names the worker to prefer.

It only proposes: the worker checks token for token and reuses only what it still holds (an entry evicted since
costs a full prefill there, nothing more). Bounded: the least recently used keys go first (--affinity-max-keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtransfer.engine.prefix_index import block_keys


class Affinity:
    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block key -> worker address, oldest first

    def __len__(self) -> int:
        return len(self._owner)

    @staticmethod
    def keys(tokens: Sequence[int], block: int) -> list[bytes]:
        return block_keys(np.asarray(tokens, dtype=np.int64), block) if block > 0 else []

    def lookup(self, tokens: Sequence[int], candidates: dict[str, int]) -> tuple[str, int] | None:
        """(worker, tokens matched) of the deepest known block of `tokens` whose worker is a candidate
        ({address: its block size}), or None."""
        best = None
        for block in sorted(set(candidates.values()) - {0}):
            for depth, key in reversed(list(enumerate(self.keys(tokens, block), 1))):
                addr = self._owner.get(key)
                if addr is not None and addr in candidates and candidates[addr] == block:
                    self._owner.move_to_end(key)
                    if best is None or depth * block > best[1]:
                        best = (addr, depth * block)
                    break
        return best

    def file(self, tokens: Sequence[int], block: int, addr: str) -> None:
        """`addr` now holds the KV of `tokens` (a finished request's context): file its blocks under it."""
        for key in self.keys(tokens, block):
            self._owner[key] = addr
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)
