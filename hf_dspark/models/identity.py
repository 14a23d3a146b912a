"""What kind of drafter a model is, read from its config: the `model_type` of each drafter family hf_dspark has."""

from __future__ import annotations

BLOCK_DRAFTER_TYPE = "dspark"
"""`model_type` of DSpark and DFlash drafters (`DSparkDraftConfig`)."""
EAGLE3_DRAFTER_TYPE = "eagle3_draft"
"""`model_type` of Eagle3 drafters (`Eagle3DraftConfig`)."""
DFLASH2_DRAFTER_TYPE = "dflash2_draft"
"""`model_type` of DFlash 2 drafters (`DFlash2DraftConfig`): the DFlash backbone with per-layer convolutions and a
candidate selector. It drafts through the block path (`drafting_core` gives `BLOCK_DRAFTER_TYPE`)."""
OWN_DRAFTER_TYPES = (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE, DFLASH2_DRAFTER_TYPE)
"""Every `model_type` hf_dspark's own drafter folders (`save_pretrained`, `hf-dspark train`) carry."""


def drafting_core(model) -> str | None:
    """Which drafting core runs a drafter (`generation/round/drafting.py`), named by the `model_type` of its
    family: `BLOCK_DRAFTER_TYPE` (one backbone pass over a block, then slot by slot: DSpark, DFlash and DFlash 2),
    `EAGLE3_DRAFTER_TYPE` (a chain of steps) or None (no hf_dspark drafter). Read from the config rather than the
    class so that a drafter loaded with `trust_remote_code=True` (another copy of our classes) is recognised too.
    Which algorithm a drafter is (`dspark`, `dflash`, `dflash2`, `eagle3`: what `--kind` trains and exports name)
    is `drafter_kind`'s."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == DFLASH2_DRAFTER_TYPE:
        return BLOCK_DRAFTER_TYPE
    return model_type if model_type in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE) else None


def drafter_kind(config) -> str | None:
    """`"dspark"` (any sequential head), `"dflash"`, `"dflash2"` or `"eagle3"` for a drafter config; None for
    anything else."""
    if config.model_type == EAGLE3_DRAFTER_TYPE:
        return "eagle3"
    if config.model_type == DFLASH2_DRAFTER_TYPE:
        return "dflash2"
    if config.model_type == BLOCK_DRAFTER_TYPE:
        return "dflash" if config.markov_head is None else "dspark"
    return None


__all__ = ["BLOCK_DRAFTER_TYPE", "DFLASH2_DRAFTER_TYPE", "EAGLE3_DRAFTER_TYPE", "OWN_DRAFTER_TYPES", "drafter_kind",
           "drafting_core"]
