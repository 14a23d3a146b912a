"""Configuration of the DFlash 2 drafter: DFlash's backbone with a grouped dynamic causal convolution around each
layer's attention and MLP, and a candidate selector that re-scores each slot's top candidates from the token drafted
before it (z-lab's `DFlash2DraftModel`)."""

from __future__ import annotations

from typing import ClassVar

from huggingface_hub.dataclasses import strict

from .configuration_dspark import DSparkDraftConfig
from .identity import DFLASH2_DRAFTER_TYPE


@strict
class DFlash2DraftConfig(DSparkDraftConfig):
    r"""
    Configuration of a [`DFlash2DraftModel`]. Every field of [`DSparkDraftConfig`] keeps its meaning (the backbone is
    DFlash's: no DSpark sequential head, no confidence head, `layer_style` "llama"), plus:

    Args:
        conv_kernel_size (`int`): Taps K of the causal convolution over a block's slots: slot t mixes slots
            t, t - 1, ..., t - K + 1 of its own block (never the context, never another block).
        conv_group_size (`int`): Channels per group of the convolution's dynamic part: each slot's hidden state
            gives one scalar per (tap, group), added to a learned per-channel kernel. Must divide `hidden_size`.
        selector_rank (`int`): Rank r of the candidate selector's codebooks: a predecessor and a successor row of r
            numbers per target token, and a projection of the slot's hidden state to r numbers.
        selector_top_k (`int`): Candidates the selector re-scores per slot: the backbone's top `selector_top_k`
            tokens; the drafted token is one of them, drawn from the softmax of their scores (that distribution is
            the draft distribution q that verification's rejection sampling reads).
    """

    model_type = DFLASH2_DRAFTER_TYPE
    config_kind = "dflash2"  # DSpark's rules plus DFlash 2's own (`config_checks._dflash2_contradictions`)
    required_saved_fields: ClassVar[dict[str, str]] = {
        **DSparkDraftConfig.required_saved_fields,
        **{name: "DFlash 2's layers and selector are shaped by it and a default would change the drafter's outputs: "
                 "write the value the drafter was trained with."
           for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")},
    }

    # The selector replaces DSpark's sequential head, and DFlash 2 has no confidence head.
    markov_head: str | None = None
    markov_rank: int = 0
    confidence_head: bool = False
    conv_kernel_size: int = 4
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 8

    @property
    def is_dflash(self) -> bool:
        """False: the convolutions and the selector make it more than the plain DFlash backbone."""
        return False


__all__ = ["DFlash2DraftConfig"]
