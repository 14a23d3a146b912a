"""Suffix drafting: propose the continuation of the latest earlier occurrence of the text's own suffix.

Small models repeat themselves (lists, code, restated numbers, loops), so the tokens that followed the last
occurrence of the newest n tokens are often what comes next. `SuffixIndex` finds, over the prompt and the text
generated so far, the longest suffix of up to `max_ngram` tokens that occurred before and proposes up to
`max_tokens` tokens that followed it, in O(max_ngram) per token and no model at all. A proposal is a draft with a
one-hot draft distribution q, so the verifier's rule keeps the output exactly the target's.

`acceptance.SuffixAcceptance` keeps, per match length and proposed token, how often it was accepted, which prices a
proposal against the drafter's block and a plain step (`planner.RoundPolicy`).
"""

from __future__ import annotations


class SuffixIndex:
    """Latest end position of every n-gram (n = 1..max_ngram) of a growing token sequence.

    n-grams are registered one position behind the sequence's end, so a lookup of the current suffix finds an
    earlier occurrence, never the suffix itself.
    """

    def __init__(self, max_ngram: int = 4, max_tokens: int = 7):
        if max_ngram < 1 or max_tokens < 1:
            raise ValueError(f"max_ngram and max_tokens must be at least 1, got {max_ngram} and {max_tokens}.")
        self.max_ngram, self.max_tokens = max_ngram, max_tokens
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self._registered = 0  # n-grams ending before this position are in the index

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)
        # Register n-grams ending at every position but the newest.
        for end in range(self._registered, len(self.tokens) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._last_end[tuple(self.tokens[end - n + 1 : end + 1])] = end
        self._registered = max(self._registered, len(self.tokens) - 1)

    def propose(self, limit: int | None = None) -> tuple[list[int], int]:
        """(continuation of at most `limit` (default `max_tokens`) tokens, match length n); ([], 0) if no match."""
        limit = self.max_tokens if limit is None else min(limit, self.max_tokens)
        if limit <= 0:
            return [], 0
        length = len(self.tokens)
        for n in range(min(self.max_ngram, length), 0, -1):
            end = self._last_end.get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + limit], n
        return [], 0


class SuffixProposer:
    """One request's suffix drafting: its `SuffixIndex` over the text so far, and the scoring of every proposal it
    made against the text that followed, into `acceptance` (a `SuffixAcceptance`), whether or not the proposal was
    verified, so the suffix drafter's statistics never starve while plain steps or the drafter are preferred.

    The batch-1 loop and the engine make one per request and call `extend` with the tokens appended (the prompt,
    then each round's emitted tokens, host ints) and `propose` before each round."""

    def __init__(self, acceptance, max_ngram: int = 4, max_tokens: int = 7):
        self.index = SuffixIndex(max_ngram, max_tokens)
        self.acceptance = acceptance
        self._watched: list[tuple[int, list[int], int]] = []  # (text length when proposed, proposal, match length)

    def propose(self, limit: int, text: list[int] | None = None) -> tuple[list[int], int]:
        """The continuation of the text's longest earlier-seen suffix, at most `limit` tokens, and the match length
        ([], 0) without one; it is scored once the text that follows it is known. `text`: the whole text so far, of
        which the tokens not given yet are appended first."""
        if text is not None and len(text) > len(self.index.tokens):
            self.extend(text[len(self.index.tokens) :])
        proposal, match = self.index.propose(limit)
        if proposal:
            self._watched.append((len(self.index.tokens), proposal, match))
        return proposal, match

    def extend(self, new_tokens) -> None:
        """Append `new_tokens` to the text and score the proposals whose outcome they settle."""
        self.index.extend(new_tokens)
        text, still_open = self.index.tokens, []
        for start, proposal, match in self._watched:
            seen = text[start : start + len(proposal)]
            matched = 0
            while matched < len(seen) and seen[matched] == proposal[matched]:
                matched += 1
            if matched < len(seen) or len(seen) == len(proposal):
                self.acceptance.record(match, len(proposal), matched)  # what verifying it would have accepted
            else:
                still_open.append((start, proposal, match))
        self._watched = still_open
