"""`kvtransfer-client`: send one prompt to a decode server, print the tokens and the TTFT.

Why it speaks TLS and tokens too: the front door is configured with the same flags
(docs/security.md), and a client that cannot reach a secured server cannot test it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

from kvtransfer.rpc.configargs import DefaultsHelp, Parser
from kvtransfer.rpc.flagchecks import check_address
from kvtransfer.rpc.modes import Mode
from kvtransfer.rpc.security import ClientSecurity, check_tls_flags, check_token_flags, resolve_token
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

UINT32_MAX, INT64_MIN, INT64_MAX = (1 << 32) - 1, -(1 << 63), (1 << 63) - 1  # GenerateRequest's field types
MODES = {"auto": pb.MODE_AUTO, "layerwise": pb.MODE_LAYERWISE, "bulk": pb.MODE_BULK, "colocated": pb.MODE_COLOCATED}


async def generate(addr: str, token_ids: list[int], max_new_tokens: int, mode: str = "auto",
                   digest: bool = False, timeout: float = 120.0, cache_digest: bool = False,
                   security: ClientSecurity | None = None, sampling: pb.Sampling | None = None,
                   stop_token_ids: list[int] = (), stop_on_eos: bool = False, skip_prefix_cache: bool = False) -> dict:
    """One Generate call; returns tokens, digests, client-side TTFT, the server's timing and why it finished
    ("length" or "stop"). `sampling` None: greedy."""
    security = security or ClientSecurity()
    async with security.channel(addr) as channel:
        stub = pbg.DecodeStub(channel)
        t0 = time.perf_counter()
        ttft = None
        tokens, digests, timing, cache, finish = [], [], None, "", pb.FINISH_REASON_UNSPECIFIED
        req = pb.GenerateRequest(token_ids=token_ids, max_new_tokens=max_new_tokens, mode=MODES[mode],
                                 return_logits_digest=digest, return_cache_digest=cache_digest, sampling=sampling,
                                 stop_token_ids=stop_token_ids, stop_on_eos=stop_on_eos,
                                 skip_prefix_cache=skip_prefix_cache)
        async for msg in stub.Generate(req, timeout=timeout, metadata=security.metadata()):
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            tokens.append(msg.token_id)
            digests.append(msg.logits_digest)
            cache = cache or msg.cache_digest
            finish = msg.finish_reason or finish
            if msg.HasField("timing"):
                timing = msg.timing
    return {"tokens": tokens, "logits_digests": digests if digest else [], "client_ttft_ms": ttft,
            "cache_digest": cache,
            "timing": _timing(timing) if timing else {}, "finish_reason": FINISH_REASONS.get(finish, "")}


FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop"}


def sampling_message(temperature: float, top_p: float | None = None, top_k: int = 0,
                     seed: int | None = None) -> pb.Sampling | None:
    """The request's `sampling` field (None at temperature 0: greedy, the field left out)."""
    if not temperature:
        return None
    return pb.Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def _timing(timing: pb.Timing) -> dict:
    out = {f.name: getattr(timing, f.name) for f in pb.Timing.DESCRIPTOR.fields}
    out["mode"] = Mode.from_proto(timing.mode).value
    out["reuse_tier"] = pb.CacheTier.Name(timing.reuse_tier).removeprefix("CACHE_TIER_").lower()
    return out


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="kvtransfer-client", description="Send a prompt to a kvtransfer decode server",
               formatter_class=DefaultsHelp)
    p.add_argument("--addr", default="127.0.0.1:50051", help="the decode server's front door, HOST:PORT")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="comma-separated token ids")
    src.add_argument("--text", help="text, tokenized with --tokenizer (a local directory)")
    p.add_argument("--tokenizer", help="local tokenizer directory (no downloads)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate, 1..2**32-1 (the server's "
                   "--max-new-tokens caps it)")
    p.add_argument("--mode", choices=sorted(MODES), default="auto",
                   help="how the prompt's cache reaches the decode server: auto (the server chooses), layerwise or "
                        "bulk (from its prefill worker), colocated (prefilled on the decode server itself)")
    p.add_argument("--digest", action="store_true", help="ask for per-step logits digests")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-p", type=float, default=None, help="nucleus, (0, 1] (default: unset, which is 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=None, help="the draw's seed, 0..2**64-1 (default: the server draws)")
    p.add_argument("--stop-token-ids", default="", help="comma-separated ids that end the answer early")
    p.add_argument("--stop-on-eos", action="store_true", help="end early on the model's EOS")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of the call, s")
    p.add_argument("--tls-ca", default="", help="use TLS; verify the server with this CA (PEM)")
    p.add_argument("--tls-cert", default="", help="client certificate (PEM) for a server that requires mTLS")
    p.add_argument("--tls-key", default="", help="private key (PEM) of --tls-cert")
    p.add_argument("--auth-token", default="", help="shared token (prefer --auth-token-file: argv is visible)")
    p.add_argument("--auth-token-file", default="", help="file holding the shared token")
    a = p.parse_args(argv)
    try:
        check_address("--addr", a.addr, allow_port_zero=False)
        if not 1 <= a.max_new_tokens <= UINT32_MAX:
            raise ValueError(f"--max-new-tokens {a.max_new_tokens}: use 1..{UINT32_MAX}")
        if not a.timeout > 0:
            raise ValueError(f"--timeout {a.timeout:g}: must be > 0")
        if not 0 <= a.top_k <= UINT32_MAX:
            raise ValueError(f"--top-k {a.top_k}: use 0..{UINT32_MAX}")
        if a.seed is not None and not 0 <= a.seed < 1 << 64:
            raise ValueError(f"--seed {a.seed}: use 0..2**64-1")
        try:
            stops = [int(x) for x in a.stop_token_ids.split(",") if x.strip()]
        except ValueError:
            raise ValueError("--stop-token-ids must be comma-separated integers") from None
        check_tls_flags("tls", a.tls_cert, a.tls_key, a.tls_ca, server=False)
        check_token_flags("auth", a.auth_token, a.auth_token_file)
        security = ClientSecurity(a.tls_ca, a.tls_cert, a.tls_key, resolve_token(a.auth_token, a.auth_token_file))
    except ValueError as e:
        p.error(str(e))
    tok = None
    if a.text is not None:
        if not a.tokenizer:
            p.error("--text needs --tokenizer DIR (a local tokenizer directory)")
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
        ids = tok(a.text)["input_ids"]
    else:
        try:
            ids = [int(x) for x in a.ids.split(",") if x.strip()]
        except ValueError:
            p.error("--ids must be comma-separated integers")
        if (bad := next((i for i in ids if not INT64_MIN <= i <= INT64_MAX), None)) is not None:
            p.error(f"--ids: {bad} does not fit a token id (int64)")
    try:
        out = asyncio.run(generate(a.addr, ids, a.max_new_tokens, a.mode, a.digest, a.timeout, security=security,
                                   sampling=sampling_message(a.temperature, a.top_p, a.top_k, a.seed),
                                   stop_token_ids=stops, stop_on_eos=a.stop_on_eos))
    except grpc.aio.AioRpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)
    if tok is not None:
        out["text"] = tok.decode(out["tokens"])
    print(f"tokens: {out['tokens']}", file=sys.stderr)
    print(f"TTFT (client) {out['client_ttft_ms']:.2f} ms; server: {out['timing']}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
