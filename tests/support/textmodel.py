"""A local Hugging Face model directory with a real tokenizer, built offline: the `tiny` preset's weights plus a
byte-level BPE trained here on a few paragraphs.

Why: the OpenAI-compatible front (api_server/) turns text into token ids and back, and tests of it need a
tokenizer that `AutoTokenizer.from_pretrained(dir, local_files_only=True)` loads; nothing may be downloaded. A
byte-level BPE is the kind whose tokens split multi-byte characters, which the incremental detokenizer must
join again. The model's EOS is the tokenizer's, so `stop_on_eos` and the front agree on one id.
"""

from __future__ import annotations

from pathlib import Path

BOS, EOS = "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL = (BOS, EOS, *ROLE_TOKENS)
VOCAB_SIZE = 512  # the tiny preset's vocabulary: every id the model can emit has a token

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

TEXT = """\
The quick brown fox jumps over the lazy dog. A decode server streams one token at a time, and the prefill
worker runs the whole prompt in one pass. The key and value cache moves from one device to the other, layer by
layer, while the next layers still compute. Every moved cache decodes to the same tokens as one device would.
Once upon a time there was a small model with random weights; it spoke no language at all, yet it answered every
question with great confidence. The servers start, pair, serve and stop; a client asks, the server answers.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14159 2.71828. Punctuation: , . ; : ! ? ( ) [ ] { } - _
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Tokens, words, sentences and paragraphs; letters and bytes; streams and batches; requests and responses.
Café, naïve, résumé, déjà vu, über, São Paulo, Zürich, smörgåsbord.
"""


def train_tokenizer():
    """A byte-level BPE of exactly VOCAB_SIZE tokens (the special ones first: <s> 0, </s> 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([line for _ in range(4) for line in TEXT.splitlines()], trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise AssertionError(f"trained {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}: add text to TEXT")
    return tok


def save_tokenizer(d: Path):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(d)
    return fast


def build_text_model(d: Path) -> Path:
    """`d` becomes a model directory the servers load (--model d) and the front tokenizes with (--tokenizer d)."""
    from kvtransfer.model.spec import ModelSpec, load_model

    d = Path(d)
    fast = save_tokenizer(d)
    model = load_model(ModelSpec("tiny", "float32", 0))
    if model.config.vocab_size != VOCAB_SIZE:
        raise AssertionError(f"the tiny preset has {model.config.vocab_size} tokens, the tokenizer {VOCAB_SIZE}")
    model.config.bos_token_id, model.config.eos_token_id = fast.bos_token_id, fast.eos_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.bos_token_id = fast.bos_token_id
        model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(d)
    return d
