"""Where a request's prefill peer is chosen.

Why a file of its own: the front door asks one question per remote request, "which prefill worker takes this
one?", and the answer is a policy that grows (today: the one paired peer while it is up; with several peers, the
least loaded of the healthy ones). A peer that is down is refused here at once, naming why, so that the
--on-failure policy (fail, or recompute here) decides without waiting on a dead link.
"""

from __future__ import annotations

import grpc

from decode_server.peer.pairing import DecodePairing
from decode_server.peer.remote import PeerFailure


def choose_peer(pairing: DecodePairing) -> DecodePairing:
    """The peer that prefills the next request: the paired one while it is up (PeerFailure otherwise)."""
    if not pairing.up:
        raise PeerFailure("peer_down", grpc.StatusCode.UNAVAILABLE, f"the prefill worker at "
                          f"{pairing.config.prefill_addr} is unavailable: {pairing.why_down()}")
    return pairing
