"""What kind of drafter a model is, read from its config: the `model_type` of each drafter family hf_dspark has."""

from __future__ import annotations

BLOCK_DRAFTER_TYPE = "dspark"
"""`model_type` of DSpark and DFlash drafters (`DSparkDraftConfig`)."""
EAGLE3_DRAFTER_TYPE = "eagle3_draft"
"""`model_type` of Eagle3 drafters (`Eagle3DraftConfig`)."""


def drafter_type(model) -> str | None:
    """`BLOCK_DRAFTER_TYPE`, `EAGLE3_DRAFTER_TYPE` or None. Read from the config rather than the class so that
    a drafter loaded with `trust_remote_code=True` (another copy of our classes) is recognised too."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if model_type in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE) else None


def drafter_kind(config) -> str | None:
    """`"dspark"` (any sequential head), `"dflash"` or `"eagle3"` for a drafter config; None for anything else."""
    if config.model_type == EAGLE3_DRAFTER_TYPE:
        return "eagle3"
    if config.model_type == BLOCK_DRAFTER_TYPE:
        return "dflash" if config.markov_head is None else "dspark"
    return None


__all__ = ["BLOCK_DRAFTER_TYPE", "EAGLE3_DRAFTER_TYPE", "drafter_kind", "drafter_type"]
