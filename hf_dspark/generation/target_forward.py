"""The target's forward passes in the batch-1 loop: prefill, verification of a round's tokens, cache cropping.

`target_runner_for` picks how: the default runs the target eagerly on the `DynamicCache` that `generate` made.
"""

from __future__ import annotations

import torch


class DynamicTargetRunner:
    """Eager forwards on a `DynamicCache`: every call appends its tokens; `crop` drops the rejected ones."""

    def __init__(self, target, cache, layer_indices: list[int]):
        self.target, self.cache, self.layer_indices = target, cache, layer_indices
        self._kwargs = {"logits_to_keep": None} if target._supports_logits_to_keep() else {}
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()  # sliding-window layers keep what a crop may need

    def forward(self, tokens: torch.LongTensor, keep: int):
        """Run `tokens` (1, N) after the cached ones; returns (model outputs with the drafter's hidden states,
        float32 logits of the last `keep` positions (1, keep, V))."""
        kwargs = {"logits_to_keep": keep} if self._kwargs else {}
        out = self.target(input_ids=tokens, cache=self.cache, use_cache=True,
                          output_hidden_states=self.layer_indices, **kwargs)
        return out, out.logits[:, -keep:].float()

    def crop(self, length: int) -> None:
        """Keep the first `length` cache entries (the committed sequence but its newest token)."""
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)


def target_runner_for(target, cache, generation_config, layer_indices: list[int]):
    """The runner for this `generate` call."""
    return DynamicTargetRunner(target, cache, layer_indices)
