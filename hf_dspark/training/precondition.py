"""Preconditioning of the context fusion `fc` for training: every fused target feature trains at the same scale.

A target's residual stream carries a few "massive activation" dimensions (in SmolLM2-135M, dimension 507 sits
near 500 in layers 14-27 while a typical entry is 2-10) and layers grow in scale with depth. `fc` reads them
raw, and Adam moves every weight by about the learning rate whatever the size of its input, so a step changes
the fused context about 100x more through those few columns than through the informative ones: at
initialisation they dominate the fused row (after the RMSNorm every context row looks alike) and in training
their noise drowns the rest.

The fix reparametrises the weight, not the model: training holds `V` and the forward uses `W = V diag(1/s)`,
with `s` a robust per-column scale of the fused features (their median magnitude over sampled training tokens).
The function and the saved layout are unchanged (`fold_context_preconditioning` writes `W` back as a plain
`fc.weight` before saving), so exports to vLLM, SGLang and llama.cpp stay what they were; only the optimiser's
geometry changes. A drafter continued with `--init-from` keeps its function exactly (`V = W diag(s)`); a fresh
one starts with `V` at the usual initialisation, so each column starts in proportion to its feature's scale.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class ScaledColumns(nn.Module):
    """Parametrisation `W = V * inverse_scale` (one factor per input column)."""

    def __init__(self, inverse_scale: torch.Tensor):
        super().__init__()
        self.register_buffer("inverse_scale", inverse_scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.inverse_scale.to(weight.dtype)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.inverse_scale.to(weight.dtype)


@torch.no_grad()
def fused_feature_scales(dataset, features_of, max_tokens: int = 32768, floor: float = 1e-2) -> torch.Tensor:
    """Per-column median |x| of the fused target features over up to `max_tokens` answer tokens of `dataset`
    (evenly spread over its examples). The median ignores the few attention-sink tokens whose norms are 100x the
    rest; `floor` (relative to the median column) keeps a column that is almost always zero from being blown up.
    `features_of(example)` returns an example's (length, columns) features."""
    count = len(dataset)
    if count == 0:
        raise ValueError("cannot precondition the context fusion on an empty dataset")
    rows, gathered = 0, []
    stride = max(1, count // 64)
    for index in range(0, count, stride):
        example = dataset[index]
        features, mask = features_of(example), torch.as_tensor(example["loss_mask"]) > 0
        length = min(len(features), len(mask))
        features = features[:length][mask[:length]].float()
        gathered.append(features)
        rows += len(features)
        if rows >= max_tokens:
            break
    features = torch.cat(gathered)[:max_tokens]
    scale = features.abs().median(dim=0).values
    return scale.clamp_min(floor * float(scale.median()))


def precondition_context_fusion(drafter, scales: torch.Tensor, fresh: bool) -> None:
    """Train `drafter.fc` as `V diag(1/scales)`. `fresh`: start V at the drafter's initialisation (a new drafter);
    otherwise keep the current function (a continued drafter)."""
    fc = drafter.fc
    if parametrize.is_parametrized(fc, "weight"):
        raise ValueError("the context fusion is already preconditioned")
    if scales.shape != (fc.in_features,):
        raise ValueError(f"{scales.numel()} feature scales for an fc reading {fc.in_features} columns")
    initial = fc.weight.detach().clone()
    parametrize.register_parametrization(fc, "weight", ScaledColumns(1.0 / scales.to(fc.weight.device, torch.float32)))
    if fresh:
        with torch.no_grad():
            fc.parametrizations.weight.original.copy_(initial)


def fold_context_preconditioning(drafter) -> bool:
    """Write the effective weight back as a plain `fc.weight` (before saving); returns whether there was one."""
    if not parametrize.is_parametrized(drafter.fc, "weight"):
        return False
    parametrize.remove_parametrizations(drafter.fc, "weight", leave_parametrized=True)
    return True
