"""One choice's text as its tokens arrive: decoded incrementally, cut exactly at the first stop string, and released
only where no later token can change it.

Tokens are decoded one by one with the Rust tokenizer's `DecodeStream` (as `transformers serve` does; it holds an
incomplete UTF-8 character back until its last byte comes), so a step costs its own tokens, not the whole answer;
a tokenizer without a Rust backend decodes the whole output each time instead. The text after each token is
recorded, so a stop string is traced to the token that completed it (`completion_tokens`). What is held back from a
stream: the longest end of the text that could still grow into a stop string, so that no part of a stop string is
ever sent, even when it arrives split across tokens, steps or chunks. When the choice ends the whole output is
decoded once more, so the answer is exactly `tokenizer.decode(ids, skip_special_tokens=True)` (cut at the stop).
"""

from __future__ import annotations

from bisect import bisect_left

REPLACEMENT = "\ufffd"


class ChoiceText:
    def __init__(self, tokenizer, stop: list[str] | None = None, prefix: str = ""):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.prefix = prefix  # text shown before the completion (`echo`), sent with the first piece
        self.ids: list[int] = []
        self.text = ""  # the completion decoded so far, cut at a stop string once one is found
        self.ends: list[int] = []  # len(text) after each token
        self.sent = 0  # characters of `prefix + text` sent
        self.stopped = False  # a stop string ended the choice
        self.stop_tokens: int | None = None  # the tokens up to and including the one that completed the stop
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream([], skip_special_tokens=True)

    @property
    def completion_tokens(self) -> int:
        return self.stop_tokens if self.stop_tokens is not None else len(self.ids)

    def _decoded(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _step(self, token_id: int) -> str:
        """The text `token_id` adds (empty while it leaves a character incomplete)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        whole = self._decoded(self.ids)
        whole = whole.rstrip(REPLACEMENT)
        return whole[len(self.text):] if whole.startswith(self.text) else ""

    def feed(self, token_ids: list[int]) -> str:
        """Add a step's tokens; returns the text that can be sent now (possibly empty). After a stop string the
        choice is over: `stopped` is True and later tokens are ignored."""
        if self.stopped or not token_ids:
            return ""
        searched = len(self.text)
        for token_id in token_ids:
            self.ids.append(token_id)
            self.text += self._step(token_id)
            self.ends.append(len(self.text))
        if self.stop and self._cut_at_stop(max(0, searched - self.longest_stop + 1)):
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The choice ended (EOS, length, stop): the exact text, and everything of it not yet sent."""
        if not self.stopped:
            whole = self._decoded(self.ids)
            if whole.startswith(self.text):  # adds what an incomplete last character decodes to
                self.text = whole
        return self._release(len(self.text))

    def full_text(self) -> str:
        return self.prefix + self.text

    def _cut_at_stop(self, start: int) -> bool:
        """Cut `text` before the earliest stop string found at or after `start`; count the tokens it took."""
        found = [(position, stop) for stop in self.stop if (position := self.text.find(stop, start)) >= 0]
        if not found:
            return False
        position, stop = min(found)
        self.stopped = True
        self.stop_tokens = bisect_left(self.ends, position + len(stop)) + 1
        self.text = self.text[:position]
        return True

    def _held_back(self) -> int:
        """Characters at the end of `text` that may still turn out to start a stop string."""
        text = self.text
        for length in range(min(self.longest_stop - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0

    def _release(self, upto: int) -> str:
        """The text from what was sent up to `upto` characters of the completion (the prefix first)."""
        whole = self.prefix + self.text[: max(0, upto)]
        if len(whole) <= self.sent:
            return ""
        piece, self.sent = whole[self.sent:], len(whole)
        return piece
