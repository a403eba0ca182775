"""What a Generate request must keep before it is admitted: one function, the refusal in the flag's words.

Why apart from the servicer: the checks are a table of limits (the prompt's, shared with the prefill worker in
kvtransfer/rpc/limits.py; sampling; max_new_tokens against the model's context and this server's slot; the mode;
the prefill workers' own --max-prompt-tokens; the receive buffer), each with the status it ends in and the flag
that would change it; the servicer only aborts.
"""

from __future__ import annotations

import grpc

from kvtransfer.rpc.limits import prompt_problem, sampling_problem
from kvtransfer.rpc.modes import REQUEST_MODES
from proto import kvtransfer_pb2 as pb

KNOWN_MODES = {m.proto for m in REQUEST_MODES}


def request_problem(request, config, engine, vocab: int, peers) -> tuple[grpc.StatusCode, str] | None:
    """(status, message) refusing `request`, or None when it may be admitted. `peers`: the prefill peers
    (decode_server/peer/peers.py; None: colocated, no peer configured); a disaggregated prompt over the smallest
    --max-prompt-tokens they announced is refused here, whatever the prefix cache holds."""
    n, c, new = len(request.token_ids), config, request.max_new_tokens
    context_len = engine.m.model.config.max_position_embeddings
    # the limits the prefill server enforces too (kvtransfer/rpc/limits.py), then this server's own
    problem = prompt_problem(request.token_ids, c.max_prompt_tokens, context_len, vocab)
    if problem is None:
        sm = request.sampling  # all defaults when absent: greedy
        problem = sampling_problem(sm.temperature, sm.top_p if sm.HasField("top_p") else None, sm.top_k,
                                   request.stop_token_ids, vocab)
    if problem is not None:
        return grpc.StatusCode.INVALID_ARGUMENT, problem
    code = grpc.StatusCode.INVALID_ARGUMENT
    if not 1 <= new <= c.max_new_tokens:
        problem = f"max_new_tokens is {new}; use 1..{c.max_new_tokens} (--max-new-tokens)"
    elif n + new > min(context_len, slot := engine.pool.max_seq):  # advise the bound that binds
        if slot >= context_len:
            problem = (f"prompt ({n}) + max_new_tokens ({new}) exceeds the model's context of {context_len} "
                       f"tokens; ask for at most {context_len - n} new tokens")
        elif n >= slot:
            problem = (f"prompt ({n}) leaves no room to generate in this server's KV slot of {slot} tokens "
                       f"(--max-seq-len); send at most {slot - 1} prompt tokens or raise --max-seq-len")
        else:
            problem = (f"prompt ({n}) + max_new_tokens ({new}) = {n + new} tokens exceeds this server's KV slot "
                       f"of {slot} tokens (--max-seq-len); ask for at most {slot - n} new tokens or raise "
                       "--max-seq-len")
    elif request.mode not in KNOWN_MODES:
        problem = f"unknown mode {request.mode}; use AUTO, LAYERWISE, BULK or COLOCATED"
    elif request.mode != pb.MODE_COLOCATED and not c.colocated:
        limit, where = peers.prompt_limit() if peers is not None else (0, "")
        if peers is None:
            problem, code = "no prefill peer configured", grpc.StatusCode.FAILED_PRECONDITION
        elif limit and n > limit:
            problem = (f"prompt has {n} tokens; the prefill worker at {where} accepts at most {limit} (its "
                       "--max-prompt-tokens): send a shorter prompt, or raise that flag on the prefill workers")
        elif (size := engine.m.geometry.cache_bytes(n)) > c.max_receive_bytes:
            problem, code = (f"a {n}-token cache is {size} bytes, over this server's --max-receive-bytes "
                             f"{c.max_receive_bytes}; send a shorter prompt"), grpc.StatusCode.RESOURCE_EXHAUSTED
    return (code, problem) if problem is not None else None
