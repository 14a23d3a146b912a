"""What `generate()` with an hf_dspark drafter returns under `return_dict_in_generate=True`."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..round.stats import SpeculativeStats


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    r"""
    speculative_stats ([`SpeculativeStats`]):
        Draft length and accepted count of every verification round (tau, per-slot acceptance); for a batch, every
        request's rounds merged.
    request_stats (`list[SpeculativeStats]`, batches only):
        One `SpeculativeStats` per prompt of the batch, in order.
    verified_tokens_per_round (`list[int]`, batches only):
        Per engine round, the tokens verified over all active rows, sum(k_r + 1): the batch B the scheduler prices.
    """

    speculative_stats: SpeculativeStats | None = None
    request_stats: list[SpeculativeStats] | None = None
    verified_tokens_per_round: list[int] | None = None
