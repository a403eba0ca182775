"""Text <-> token ids for the front: prompts and chat messages in, generated ids out as text, piece by piece.

Why the tokenizers library's DecodeStream: a byte-level token may hold half a UTF-8 character ("漢" is three
bytes, often two or three tokens); decoding each token alone gives replacement characters, and decoding the
whole output at every step costs O(n^2). DecodeStream keeps the offsets and yields text only once it is whole;
the last few prompt ids seed it, so a tokenizer that drops a leading space at the start of a text does not drop
it at the start of the answer. A seed must not end inside a character (a token-id prompt may): DecodeStream
compares each new decode with the seed's, and a seed ending in U+FFFD is no prefix of the text once the answer's
first token completes the character, so the whole seed would be sent again as answer. The ids of that unfinished
character are stepped after the seed instead, unsent: the character the answer completes is the answer's. Ids
the model may emit but the tokenizer does not know (vocabularies padded past the tokenizer's) decode to
nothing. Only local directories are read (`local_files_only`): nothing is downloaded.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvtransfer.api")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # a tokenizer's
PREFIX_IDS = 6  # prompt ids that seed a Detokenizer (enough context for any merge at the boundary)


class Detokenizer:
    """One request's generated ids -> text pieces; `step` per id, `flush` at the end for anything held back."""

    def __init__(self, backend, size: int, prefix: list[int], pending: list[int] = ()):
        """`prefix`: prompt ids that end on a whole character (the seed); `pending`: the prompt's last ids after
        it, the start of a character the answer may complete (fed to the stream, never sent on their own)."""
        from tokenizers.decoders import DecodeStream

        self._backend, self._size, self._prefix = backend, size, prefix
        self._stream = DecodeStream(ids=prefix or None, skip_special_tokens=True)
        self._ids: list[int] = list(pending)  # decoded after the seed with the answer's ids, for flush
        for t in pending:
            self._stream.step(backend, t)  # nothing comes out: every step ends inside the unfinished character
        self._sent: list[str] = []
        self._held = False  # the answer's last step returned nothing: it may end in an incomplete character

    def step(self, token_id: int) -> str:
        if not 0 <= token_id < self._size:
            return ""
        self._ids.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        self._held = piece is None
        if piece:
            self._sent.append(piece)
        return piece or ""

    def flush(self) -> str:
        """Text DecodeStream still holds (bytes that never formed a whole character decode as U+FFFD, as a
        one-shot decode of the same ids would). The seed never ends inside a character, so its decode is the
        start of the whole one and what follows it is the answer's."""
        if not self._held:
            return ""
        self._held = False
        base = self._backend.decode(self._prefix, skip_special_tokens=True) if self._prefix else ""
        full = self._backend.decode(self._prefix + self._ids, skip_special_tokens=True)
        sent = "".join(self._sent)
        if not full.startswith(base) or not full[len(base):].startswith(sent):
            return ""
        rest = full[len(base) + len(sent):]
        if rest:
            self._sent.append(rest)
        return rest


class TextCodec:
    """A local Hugging Face tokenizer: prompts and chats to ids, ids to text."""

    def __init__(self, tokenizer, path: str = ""):
        self.tok, self.path = tokenizer, path
        self.backend = tokenizer.backend_tokenizer
        self.size = self.backend.get_vocab_size(with_added_tokens=True)
        eos = tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else []

    @classmethod
    def load(cls, path: str, flag: str = "--tokenizer") -> TextCodec:
        """Raises ValueError, one line naming the flag and the directory, when it holds no fast tokenizer (the
        library's own message runs over several lines: it is joined into this one)."""
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, ImportError) as e:
            if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
                why = f"it has none of {', '.join(TOKENIZER_FILES)}: name a local tokenizer or model directory"
            else:
                why = f"{type(e).__name__}: {' '.join(str(e).split())}"
            raise ValueError(f"{flag} {path!r}: cannot load a tokenizer from it ({why})") from None
        if getattr(tok, "backend_tokenizer", None) is None:
            raise ValueError(f"{flag} {path!r}: {type(tok).__name__} is not a fast tokenizer (tokenizer.json); "
                             "streaming detokenization needs one")
        return cls(tok, path)

    def encode(self, text: str) -> list[int]:
        """A completion prompt: the tokenizer's special tokens (BOS) added, as `tokenizer(text)` adds them."""
        return list(self.tok(text)["input_ids"])

    def chat(self, messages: list[dict]) -> list[int]:
        """Messages through the tokenizer's chat template, with the assistant's turn opened; the template places
        any BOS itself. Raises ValueError when there is no template or it refuses the messages."""
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"the tokenizer in {self.path!r} has no chat template: use /v1/completions")
        from jinja2 import TemplateError

        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as e:
            raise ValueError(f"the chat template refused these messages: {e}") from None
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def detokenizer(self, prompt_ids: list[int]) -> Detokenizer:
        """Seeded with the prompt's last ids, cut back to the last whole character (no seed when none ends in
        them); the ids cut off are the start of a character the answer may finish."""
        tail = prompt_ids[-PREFIX_IDS:]
        if not all(0 <= t < self.size for t in tail):
            return Detokenizer(self.backend, self.size, [])
        cut = len(tail)
        while cut and self.backend.decode(tail[:cut], skip_special_tokens=True).endswith("\ufffd"):
            cut -= 1
        return Detokenizer(self.backend, self.size, tail[:cut], tail[cut:] if cut else [])

    def decode(self, ids: list[int]) -> str:
        """A whole output at once (tests; the front streams through `detokenizer`)."""
        return self.backend.decode([t for t in ids if 0 <= t < self.size], skip_special_tokens=True)
