"""Where generation stops: `generate`'s stopping criteria read once per call, for the batch-1 loop and the engine.

`generate` builds a `MaxLengthCriteria` and an `EosTokenCriteria` from its options; both are decided on the host
from the tokens a round emits (which the loop reads anyway) instead of a device check per token. Any other
criterion (`max_time`, `stop_strings`, a user's) runs per token at batch 1, exactly as in plain decoding, and is
refused by the batched engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


@dataclass
class StopLimits:
    """`generate`'s own limits (the smallest max_length, every EOS id) and the criteria that are not those."""

    max_length: int | None = None
    eos: list[int] = field(default_factory=list)
    others: list = field(default_factory=list)

    @classmethod
    def read(cls, stopping_criteria: StoppingCriteriaList) -> "StopLimits":
        limits = cls()
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                limits.max_length = criterion.max_length if limits.max_length is None \
                    else min(limits.max_length, criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                limits.eos += criterion.eos_token_id.flatten().tolist()
            else:
                limits.others.append(criterion)
        return limits


class HostStoppingRule:
    """Max length and EOS decided on the host from a round's emitted tokens."""

    def __init__(self, max_length: int | None, eos: set[int]):
        self.max_length, self.eos = max_length, eos

    @classmethod
    def from_limits(cls, limits: StopLimits) -> "HostStoppingRule | None":
        """The rule, or None when a criterion of another kind must see every token."""
        return None if limits.others else cls(limits.max_length, set(limits.eos))

    def first_stop(self, tokens: list[int], length: int) -> tuple[int, bool]:
        """(how many of `tokens` to append after a sequence of `length`, whether generation ends there)."""
        for j, token in enumerate(tokens):
            if token in self.eos or (self.max_length is not None and length + j + 1 >= self.max_length):
                return j + 1, True
        return len(tokens), False


def append_until_stop(sequence, new_tokens, emitted: list[int], stop_rule, stopping_criteria, processed,
                      target_logits, scores, raw_logits):
    """Append a round's `emitted` tokens to `sequence` up to where plain decoding would stop, with their processed
    scores and raw logits when those are collected (`scores` / `raw_logits` not None). Returns (sequence, how many
    were appended, whether generation ends there, scores, raw_logits)."""
    if stop_rule is not None:
        count, finished = stop_rule.first_stop(emitted, sequence.shape[1])
        sequence = torch.cat([sequence, new_tokens[:, :count]], dim=-1)
        if scores is not None:
            scores += tuple(processed[:, j] for j in range(count))
        if raw_logits is not None:
            raw_logits += tuple(target_logits[:, j] for j in range(count))
        return sequence, count, finished, scores, raw_logits
    # A criterion of the user's: it sees every token and its score, as in plain decoding.
    for j in range(len(emitted)):
        sequence = torch.cat([sequence, new_tokens[:, j : j + 1]], dim=-1)
        if scores is not None:
            scores += (processed[:, j],)
        if raw_logits is not None:
            raw_logits += (target_logits[:, j],)
        if bool(stopping_criteria(sequence, scores).all()):
            return sequence, j + 1, True, scores, raw_logits
    return sequence, len(emitted), False, scores, raw_logits
