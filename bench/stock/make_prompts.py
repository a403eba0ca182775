"""Write a JSONL prompt file for guidellm's `--data kind=json_file`: one row per request, each prompt EXACTLY
N tokens of the given local tokenizer (N uniform in [min, max], seeded), and `output_tokens_count` (guidellm then
sends max_tokens=that + ignore_eos=true, as with its synthetic data).

Why not guidellm's own synthetic_text: it writes English (Faker) text, encodes it, cuts it to N tokens and decodes
with skip_special_tokens=True. With a tokenizer that has no English in it -- bench/stock/tokenizer.py's word
tokenizer for the presets, where every word is `w<id>` and anything else is `<unk>` -- every word is `<unk>`,
which the decode drops, and every prompt is sent EMPTY. Here the prompt is random vocabulary tokens instead, so
any tokenizer works: for a word-level tokenizer each sampled id is one word and the count is exact at once; for a
BPE one the text is decoded, re-encoded and trimmed until encode(text) has exactly N ids (kept exact or dropped).

    python bench/stock/make_prompts.py --tokenizer DIR --out prompts.jsonl --count 1024 --min 512 --max 1536 \
        --output-tokens 128 [--seed 42]

Needs transformers (the python that runs guidellm has it); reads the tokenizer from DIR only (HF_HUB_OFFLINE).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def candidate_ids(tok) -> list[int]:
    """Ids that are not special and decode to printable text that encodes back to the id alone (plain words)."""
    special = set(tok.all_special_ids)
    out = []
    for i in range(len(tok)):
        if i in special:
            continue
        text = tok.decode([i])
        # printable words only (a byte-level BPE's lone bytes decode to control characters)
        if text.strip() and text.isprintable() and tok.encode(text, add_special_tokens=False) == [i]:
            out.append(i)
    if not out:
        raise SystemExit("make_prompts: no vocabulary id round-trips through decode/encode alone")
    return out


def exact_prompt(tok, ids: list[int], rng: random.Random, n: int, tries: int = 20) -> str | None:
    """Text whose encoding (no special tokens added) is exactly n ids, or None."""
    seq = [rng.choice(ids) for _ in range(n)]
    for _ in range(tries):
        text = tok.decode(seq)
        got = tok.encode(text, add_special_tokens=False)
        if len(got) == n:
            return text
        seq = got[:n] if len(got) > n else got + [rng.choice(ids) for _ in range(n - len(got))]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="local tokenizer directory")
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--min", type=int, required=True, help="fewest prompt tokens")
    ap.add_argument("--max", type=int, required=True, help="most prompt tokens")
    ap.add_argument("--output-tokens", type=int, required=True)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)
    if not 1 <= args.min <= args.max:
        ap.error("need 1 <= --min <= --max")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = candidate_ids(tok)
    rng = random.Random(args.seed)
    lengths, written = [], 0
    with open(args.out, "w") as f:
        while written < args.count:
            n = rng.randint(args.min, args.max)
            text = exact_prompt(tok, ids, rng, n)
            if text is None:
                continue
            f.write(json.dumps({"prompt": text, "prompt_tokens_count": n,
                                "output_tokens_count": args.output_tokens}) + "\n")
            lengths.append(n)
            written += 1
    print(json.dumps({"prompts": args.out, "count": written, "prompt_tokens_min": min(lengths),
                      "prompt_tokens_max": max(lengths), "prompt_tokens_mean": round(sum(lengths) / written, 1),
                      "vocab_ids_used": len(ids)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
