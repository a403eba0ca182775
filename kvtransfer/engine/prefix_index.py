"""Which cached contexts a prompt starts with: a hash chain over fixed-size token blocks, checked token for token.

Why a chain: block i's key hashes block i's tokens together with block i - 1's key, so one dictionary lookup
per block says "some cached context starts with exactly these i + 1 blocks", and a prompt's longest cached
prefix is found by walking its blocks until a key is missing (what vLLM's and SGLang's prefix caches do, over
pages; here the unit of storage is a whole context, a pool slot or a host-tier entry). The keys are
blake2b digests of the token ids' bytes: the same in every process, so a router can compute them too.

A hash only proposes: every hit is then compared token for token with the entry's own tokens, and only the
verified common prefix is used. An entry whose tokens disagree with a key it is filed under (a corrupted
entry) is never used: it is dropped and counted.

Host-side bookkeeping only (no tensors): the pool and the host tier own the KV; an entry names where it is.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

BLOCK_TOKENS = 16  # tokens per hashed block: a prefix is found to within a block, then extended token by token


def block_keys(tokens: np.ndarray, block: int = BLOCK_TOKENS, known: Sequence[bytes] = ()) -> list[bytes]:
    """The chained keys of `tokens`' whole blocks: key[i] covers tokens[0 : (i + 1) * block]. `known`: the keys of
    its first len(known) blocks, already computed (the caller vouches they are of these tokens); the chain goes on
    from them."""
    keys = list(known)
    prev = keys[-1] if keys else b""
    raw = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    step = block * 8
    for i in range(len(keys) * step, len(raw) // step * step, step):
        prev = hashlib.blake2b(prev + raw[i:i + step], digest_size=16).digest()
        keys.append(prev)
    return keys


def known_keys(tokens: np.ndarray, hashed: tuple[np.ndarray, list[bytes]] | None, block: int) -> list[bytes]:
    """The keys of `hashed` (tokens hashed before, block_keys of them) that are `tokens`' own, for block_keys' `known`:
    all of them when `tokens` starts with their blocks, else none."""
    if hashed is None:
        return []
    arr, keys = hashed
    k = min(len(keys), len(tokens) // block)
    n = k * block
    return keys[:k] if np.array_equal(arr[:n], np.asarray(tokens[:n], dtype=np.int64)) else []


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(eq=False)
class Entry:
    """One cached context: `where` names it for its owner (a pool slot, a host-tier entry); `tokens` are the ids
    whose KV it holds, positions 0..len - 1."""

    where: Hashable
    tokens: np.ndarray  # (length,) int64
    keys: list[bytes] = field(repr=False, default_factory=list)
    pins: int = 0  # requests copying out of it now: never evicted while pinned

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Match:
    entry: Entry
    length: int  # verified shared tokens (may run past the last matched block, up to the entry's length)


class PrefixIndex:
    """Entries by block key and in least-recently-used order. Not thread-safe: its owner locks."""

    def __init__(self, block: int = BLOCK_TOKENS):
        self.block = block
        self._by_key: dict[bytes, dict[Hashable, Entry]] = {}
        self._lru: OrderedDict[Hashable, Entry] = OrderedDict()  # oldest first
        self.poisoned = 0  # entries found disagreeing with their keys (dropped)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, where: Hashable) -> bool:
        return where in self._lru

    def add(self, where: Hashable, tokens: Sequence[int] | np.ndarray, known: Sequence[bytes] = ()) -> Entry | None:
        """File a context under its blocks' keys (replacing what `where` held); None when it has no whole block
        (nothing a later prompt could be matched against). `known`: block_keys' of its first blocks, if computed."""
        self.remove(where)
        arr = np.asarray(tokens, dtype=np.int64).copy()
        keys = block_keys(arr, self.block, known)
        if not keys:
            return None
        e = Entry(where, arr, keys)
        for k in keys:
            self._by_key.setdefault(k, {})[where] = e
        self._lru[where] = e
        return e

    def remove(self, where: Hashable) -> Entry | None:
        e = self._lru.pop(where, None)
        if e is not None:
            for k in e.keys:
                holders = self._by_key.get(k)
                if holders is not None:
                    holders.pop(where, None)
                    if not holders:
                        del self._by_key[k]
        return e

    def touch(self, where: Hashable) -> None:
        self._lru.move_to_end(where)

    def oldest(self, accept=lambda e: True) -> Entry | None:
        """The least recently used unpinned entry that `accept` takes."""
        return next((e for e in self._lru.values() if e.pins == 0 and accept(e)), None)

    def entries(self) -> list[Entry]:
        return list(self._lru.values())

    def match(self, tokens: np.ndarray, keys: list[bytes] | None = None) -> list[Match]:
        """The entries sharing the longest run of whole blocks with `tokens`, each with its verified shared length
        (longest first, then most recently used first). Entries whose tokens contradict the matched keys are
        dropped here and counted in `poisoned`."""
        keys = block_keys(tokens, self.block) if keys is None else keys
        best: dict[Hashable, Entry] = {}
        blocks = 0
        for k in keys:
            holders = self._by_key.get(k)
            if not holders:
                break
            best, blocks = holders, blocks + 1
        out, order = [], {w: i for i, w in enumerate(self._lru)}
        for e in list(best.values()):
            n = common_prefix(tokens, e.tokens)
            if n < blocks * self.block:  # its tokens are not what its keys say: never use it
                self.poisoned += 1
                self.remove(e.where)
                continue
            out.append(Match(e, n))
        out.sort(key=lambda m: (-m.length, -order[m.entry.where]))
        return out
