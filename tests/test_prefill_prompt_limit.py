"""The prefill worker's --max-prompt-tokens holds whatever the decode worker's prefix cache holds (issue #36,
item 7), in real processes on CPU (`tiny`, gloo, the decode worker's prefix cache on).

Why it did not: a prompt whose cached prefix leaves little to prefill is prefilled on the decode worker itself
(--local-suffix-max-tokens), so the prefill worker never saw it, and the same prompt was refused or served by what
the cache happened to hold. Now the prefill worker announces its limit at the handshake and the decode worker
refuses a longer disaggregated prompt itself, INVALID_ARGUMENT naming the flag, cached or not.
"""

from __future__ import annotations

import asyncio
import random

import grpc

from decode_server.client import generate
from support.faultkit import Pair

LIMIT = 200  # the prefill worker's --max-prompt-tokens (its warm-up is 128)


def ask(addr: str, ids: list[int]) -> tuple[grpc.StatusCode, str, dict]:
    try:
        return grpc.StatusCode.OK, "", asyncio.run(generate(addr, ids, 2, timeout=60))
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), {}


def test_a_prompt_over_the_prefill_workers_limit_is_refused_cached_or_not(tmp_path):
    rng = random.Random(3)
    base = [rng.randrange(3, 512) for _ in range(LIMIT - 10)]
    with Pair(tmp_path, prefill_args=["--max-prompt-tokens", str(LIMIT)], prefix_cache=True) as pair:
        pair.start()
        code, details, out = ask(pair.addr, base)  # under the limit: prefilled remotely, then cached here
        assert code == grpc.StatusCode.OK and out["timing"]["mode"] in ("layerwise", "bulk"), (code, details)
        longer = base + [rng.randrange(3, 512) for _ in range(30)]  # over the limit; its prefix is cached here
        fresh = [rng.randrange(3, 512) for _ in range(LIMIT + 30)]  # over the limit; nothing of it cached
        for ids in (longer, fresh):
            code, details, out = ask(pair.addr, ids)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (len(ids), code, out.get("timing"), pair.log_text())
            assert f"accepts at most {LIMIT}" in details and "--max-prompt-tokens" in details, details
            assert pair.prefill_addr in details, details
