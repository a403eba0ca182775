"""Compatibility fingerprint exchanged at the handshake.

Why: two workers that disagree on weights, dtype or cache layout would exchange caches
that decode to wrong tokens without any error. The handshake compares everything that
decides the bytes on the wire and refuses a mismatched peer with a message that says
which flag to fix.

Why `relayed`: the prefill worker words a refusal from its own side (`dtype: here 'float32',
peer 'bfloat16'`, here = the prefill worker); the decode worker logs and exits with that text
too, where "here" would read as itself. It rewrites each difference with both sides named.
"""

from __future__ import annotations

import os
import re

from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec, weights_fingerprint
from proto import kvtransfer_pb2 as pb

PROTOCOL_VERSION = 2  # 2: PrefillRequest.sampling (a worker of 1 would choose a seeded first token greedily)
LAYOUT = "l2bhsd"  # (layers, K|V, batch, kv_heads, seq, head_dim), K and V of a layer adjacent


def local_compat(spec: ModelSpec, model, geometry: CacheGeometry, deterministic: bool,
                 batch_invariant: bool = False) -> pb.Compat:
    return pb.Compat(batch_invariant=batch_invariant,
        model=os.path.basename(os.path.normpath(spec.name)), dtype=str(geometry.dtype).removeprefix("torch."),
        weights_fingerprint=weights_fingerprint(model), geometry_digest=geometry.digest(),
        num_layers=geometry.num_layers, kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
        layout=LAYOUT, protocol_version=PROTOCOL_VERSION, deterministic=deterministic)


# Each field the handshake compares, and the fix it needs when the peers differ in it. Listed in that order.
_VERSION = "the same kvtransfer version"
_MODEL = "the same --model (preset name or local model directory)"
FIXES = {
    "protocol_version": _VERSION, "layout": _VERSION,
    "model": _MODEL, "num_layers": _MODEL, "kv_heads": _MODEL, "head_dim": _MODEL,
    "dtype": "the same --dtype",
    "weights_fingerprint": "the same weights: the same --seed for a preset's random weights, the same files for a "
                           "local model directory",
    "batch_invariant": "--batch-invariant on both or neither",
}
# Fingerprints of other fields: listed only when none of those differs (else they differ because it does).
DERIVED = {"geometry_digest": ("num_layers", "kv_heads", "head_dim", "dtype", "layout"),
           "weights_fingerprint": ("model", "num_layers", "kv_heads", "head_dim", "dtype")}


def mismatch(mine: pb.Compat, theirs: pb.Compat, here: str = "here", peer: str = "peer") -> str | None:
    """None when the peers can exchange caches, else what differs (`mine` as `here`, `theirs` as `peer`) and how
    to fix it: each root difference (a fingerprint only when nothing it covers differs) and the flags for it."""
    differ = [f for f in (*FIXES, "geometry_digest") if getattr(mine, f) != getattr(theirs, f)]
    if not differ:
        return None
    shown = [f for f in differ if not set(DERIVED.get(f, ())) & set(differ)]
    problems = [f"{f}: {here} {getattr(mine, f)!r}, {peer} {getattr(theirs, f)!r}" for f in shown]
    fixes = list(dict.fromkeys(FIXES.get(f, "the same kvtransfer version") for f in shown))
    hidden = [f for f in differ if f not in shown]
    also = f"; {', '.join(hidden)} differ with it" if hidden else ""
    return f"{peer} is incompatible ({'; '.join(problems)}{also}). Start both workers with {'; '.join(fixes)}."


# One difference as a worker words it with the default labels: `field: here VALUE, peer VALUE` (VALUE a repr:
# a quoted string, a number or a bool), as `mismatch` and the prefill worker's transport check write it.
_VALUE = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+|True|False"
_DIFF = re.compile(rf"\b(\w+): here ({_VALUE}), peer ({_VALUE})")


def relayed(refusal: str, speaker: str = "prefill worker", listener: str = "this decode worker") -> str:
    """`refusal` as written by `speaker` ("here" = the speaker, "peer" = the listener), reworded for the listener's
    own log: each difference names both sides (`dtype: this decode worker 'bfloat16', prefill worker 'float32'`)."""
    text = _DIFF.sub(lambda m: f"{m[1]}: {listener} {m[3]}, {speaker} {m[2]}", refusal)
    return text.replace("peer is incompatible (", "incompatible (", 1)
