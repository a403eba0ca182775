"""`--batch-invariant` under preemption (issue #40), in a real colocated server on CPU (tiny): a pool of a few blocks.

What is claimed (and tested here): 16 requests at once on a pool of 24 blocks of 8 tokens (each request grows to
6-7 blocks, so most of them are preempted and resumed: swapped through the host tier or recomputed in the steps),
greedy and seeded, each make the same tokens **and the same logits digest at every step** as alone on the same
server (one run counted 16 swaps and 7 recomputes). Without the mode (`--mixed-prefill` in its place) the digests
differ and this test fails (tests/test_preempt_servers.py compares tokens only): a resumed request's rows ride in
other steps than alone, which the mode makes the same bits.
"""

from __future__ import annotations

import asyncio

from decode_server.client import generate
from support.servers import colocated_server, free_port
from test_preempt_servers import BOUND_S, NEW, POOL, TINY_BYTES_PER_TOKEN, preemptions_counted, prompts, seeded

HOST_GIB = 16 * 256 * TINY_BYTES_PER_TOKEN / 2**30  # 16 host-tier pages of 256 tokens


def key(r: dict) -> tuple:
    return r["tokens"], r["logits_digests"]


def test_preempted_requests_in_the_mode_make_the_bits_they_make_alone(tmp_path):
    port = free_port()
    ps = prompts(512)
    args = [*POOL, "--batch-invariant", "--prefill-chunk", "32", "--host-cache-gib", repr(HOST_GIB),
            "--metrics-port", str(port)]
    with colocated_server(tmp_path, args=args, prefix_cache=True) as run:
        async def burst():
            return await asyncio.gather(*(generate(run.addr, p, NEW, digest=True, sampling=seeded(i),
                                                   timeout=BOUND_S) for i, p in enumerate(ps)))
        together = [key(r) for r in asyncio.run(burst())]
        swaps, recomputes = preemptions_counted(port, "swap"), preemptions_counted(port, "recompute")
        alone = [key(asyncio.run(generate(run.addr, p, NEW, digest=True, sampling=seeded(i), timeout=BOUND_S,
                                          skip_prefix_cache=True))) for i, p in enumerate(ps)]
    assert swaps + recomputes > 0, "nothing was preempted: the test proves nothing"
    assert all(len(t) == NEW and all(d) for t, d in together)
    assert together == alone
