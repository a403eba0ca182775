"""Stop strings over streamed text: cut at the earliest match, and never send a prefix of one that may complete.

Why held back: tokens end anywhere in a stop string ("\\n\\nUser:" may arrive as "\\n", "\\nUs", "er:"). Text
that could still be the start of a match is kept until the next piece says whether it is one; a client must
never receive text that a later piece turns into part of the stop string. The stop string itself is not sent
(OpenAI's behaviour). Matching is on characters, after detokenization, so a stop string may span tokens.
"""

from __future__ import annotations


class StopMatcher:
    """Feed text pieces in order; each call returns the text safe to send now and whether a stop string matched."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return text[:cut], True
        keep = self._partial(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The generation ended without a match: what was held back is plain text after all."""
        out, self._held = self._held, ""
        return out

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
