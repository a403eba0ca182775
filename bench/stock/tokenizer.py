"""A word-level tokenizer with exactly a preset's vocabulary: text in and out of a preset, for stock load tools.

Why: a preset is the published shapes with seeded random weights, and comes with no tokenizer (nothing is
downloaded). A stock tool (guidellm, `vllm bench serve`) builds prompts of N tokens and counts tokens with a
tokenizer of its own, and the OpenAI front (kvtransfer-api --tokenizer DIR) must count them the same way. With
this one, every token id of the model is one word (`w<id>`, the EOS id its special token), so every generated
token yields text, and a word the vocabulary lacks is one token (`<unk>`, id 0 here). It is not a language
model's tokenizer: it makes any text path of the service runnable, with token counts both sides agree on.

    python -m bench.stock.tokenizer --model qwen2.5-7b --out /tmp/qwen-words
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvtransfer.model.spec import load_config

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def word_tokenizer(vocab_size: int, eos_id: int | None) -> PreTrainedTokenizerFast:
    """id i <-> the word `w<i>`; id 0 is `<unk>`, `eos_id` (when given) is `<|endoftext|>`."""
    words = {f"w{i}": i for i in range(vocab_size)}
    specials = {0: "<unk>"} | ({eos_id: "<|endoftext|>"} if eos_id is not None else {})
    for i, tok in specials.items():
        del words[f"w{i}"]
        words[tok] = i
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|endoftext|>" if eos_id is not None else None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stock.tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a preset (or local model dir): its vocabulary and EOS id")
    p.add_argument("--out", required=True, help="the tokenizer directory to write (AutoTokenizer loads it)")
    args = p.parse_args(argv)
    config = load_config(args.model)
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    fast = word_tokenizer(config.vocab_size, eos)
    fast.save_pretrained(args.out)
    print(json.dumps({"tokenizer": str(Path(args.out).resolve()), "vocab_size": len(fast), "eos_token_id": eos}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
