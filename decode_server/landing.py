"""Where a remote prefill's cache lands in the decode worker's KV pool.

Why a function of its own: the pool has two layouts (kvtransfer/engine/pool.py). In the slot layout a request's
positions of one layer are one strided view, so transports receive straight into it (or copy once per layer into
it). Paged, a request's positions are spread over blocks: the layer is received into staging and handed to the
pool, which scatters it into the request's blocks (one indexed copy per K and V per layer, as the copy before).
"""

from __future__ import annotations

from kvtransfer.engine.pool import KVPool
from kvtransfer.transport.landing import Landed


def pool_destination(pool: KVPool, slot: int, seq_len: int):
    """The destination a transport fills for `slot`'s first `seq_len` positions: per layer (k, v) views of the
    pool (the slot layout), else a hand-off that scatters each received layer into the slot's blocks."""
    if pool.fixed:
        return pool.views(slot, seq_len)
    if pool.blocks_for(seq_len) > len(pool.row_blocks(slot)):
        raise ValueError(f"{seq_len} tokens do not fit the {len(pool.row_blocks(slot))} blocks slot {slot} holds")
    return Landed(lambda i, k, v: pool.write_layer(slot, i, 0, k, v))
