"""Distillation losses for drafters, on the supervised slots only.

DSpark: `w_ce * CE + w_tv * TV + w_bce * BCE(confidence)` (+ optional `w_kl * soft CE to p_target`), each term weighted per slot k (0-based) by
`exp(-k / decay)` and normalised by the sum of weights. TV is `||p_draft - p_target||_1` on the
sequential-head-corrected logits; the confidence label is `1 - 0.5 * ||p_draft - p_target||_1` (detached),
i.e. the probability that rejection sampling accepts the slot.
DFlash is the same with `w_tv = w_bce = 0`. Eagle3 uses soft cross-entropy per unrolled step, weighted `decay**s`.
DFlash 2 is DFlash's loss on the backbone's logits plus `w_sel * CE` over its candidate selector's scores of the
candidates it serves (the backbone's top-k, the label put in place of the weakest when missing), per slot weighted
alike (`selector_candidates`): the drafted token is drawn among those candidates, so that is the choice to teach.

With a draft vocabulary S the drafter's distribution is zero outside S, so
`||q - p||_1 = sum_{v in S} |q_v - p_v| + (1 - p(S))` and hard labels outside S give no CE term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TargetDistribution:
    """The target's next-token distribution on supervised rows: `probs` on the draft vocabulary (not
    renormalised: the rest of the mass lies outside it), or on the full vocabulary, and the target's `argmax`
    as target ids. Built from full logits online, or from a target cache without them."""

    probs: torch.Tensor
    argmax: torch.Tensor

    @classmethod
    def from_logits(cls, target_logits: torch.Tensor, draft_to_target: torch.Tensor | None = None):
        return cls(target_probs_on_draft_vocab(target_logits, draft_to_target), target_logits.argmax(-1))

    @classmethod
    def from_cache(cls, target_draft_logits: torch.Tensor, logsumexp: torch.Tensor, argmax: torch.Tensor):
        """`target_draft_logits` are the target logits on the draft vocabulary, `logsumexp` over the full one."""
        return cls((target_draft_logits.float() - logsumexp.float()[:, None]).exp(), argmax)


def _as_distribution(target, draft_to_target) -> TargetDistribution:
    return target if isinstance(target, TargetDistribution) else TargetDistribution.from_logits(target, draft_to_target)


def position_weights(slot_index: torch.Tensor, decay: float) -> torch.Tensor:
    return torch.exp(-slot_index.float() / decay)


def target_probs_on_draft_vocab(target_logits: torch.Tensor, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    """p_target restricted to the draft vocabulary (not renormalised), or the full p_target."""
    log_probs = target_logits.float().log_softmax(dim=-1)
    if draft_to_target is not None:
        log_probs = log_probs[:, draft_to_target]
    return log_probs.exp()


def l1_distance(draft_probs: torch.Tensor, target_probs_subset: torch.Tensor) -> torch.Tensor:
    """||q - p||_1 per row, where both are given on the draft vocabulary and q has no mass outside it."""
    outside = (1.0 - target_probs_subset.sum(dim=-1)).clamp_min(0.0)
    return (draft_probs - target_probs_subset).abs().sum(dim=-1) + outside


def draft_labels(labels: torch.Tensor, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    """Map target-vocabulary labels into the draft vocabulary; -100 where a label is not drafted."""
    if draft_to_target is None:
        return labels
    vocab_size = max(int(labels.max()) if labels.numel() else 0, int(draft_to_target.max())) + 1
    lookup = torch.full((vocab_size,), -100, dtype=torch.long, device=labels.device)
    lookup[draft_to_target] = torch.arange(draft_to_target.numel(), device=labels.device)
    return lookup[labels]


def dspark_loss(
    draft_logits: torch.Tensor,
    target: torch.Tensor | TargetDistribution,
    labels: torch.Tensor,
    slot_index: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    *,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    bce_weight: float = 1.0,
    kl_weight: float = 0.0,
    decay: float = 4.0,
    draft_to_target: torch.Tensor | None = None,
    total_weight: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All inputs are per supervised slot: draft_logits (N, V_draft), target logits (N, V) or a
    `TargetDistribution`, labels (N,) target ids,
    slot_index (N,), confidence_logits (N,). Returns (loss, detached per-slot quantities for logging).

    `total_weight` normalises the weighted sums instead of these slots' own weight sum: the trainer passes the sum
    over every process divided by their number, so that averaging the processes' gradients (DDP, FSDP) gives the
    gradient of the mean over the global batch, as DeepSpec normalises by the all-reduced weight sum."""
    weights = position_weights(slot_index, decay)
    total_weight = (weights.sum() if total_weight is None else torch.as_tensor(total_weight)).clamp_min(1e-8)
    draft_probs = draft_logits.float().softmax(dim=-1)
    target = _as_distribution(target, draft_to_target)
    target_probs = target.probs
    distance = l1_distance(draft_probs, target_probs)

    mapped = draft_labels(labels, draft_to_target)
    ce = F.cross_entropy(draft_logits.float(), mapped, ignore_index=-100, reduction="none")
    loss = ce_weight * (weights * ce).sum() / total_weight + tv_weight * (weights * distance).sum() / total_weight
    if kl_weight:
        # Soft cross-entropy to the target distribution: strong gradients while q is far from p, and the right
        # label on off-policy text, where the hard next token is not the target's own choice.
        soft = _soft_cross_entropy(draft_logits, target_probs)
        loss = loss + kl_weight * (weights * soft).sum() / total_weight
    acceptance = (1.0 - 0.5 * distance).clamp(0.0, 1.0).detach()
    details = {"ce": ce.detach(), "l1": distance.detach(), "acceptance": acceptance}
    if confidence_logits is not None and bce_weight:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), acceptance, reduction="none")
        loss = loss + bce_weight * (weights * bce).sum() / total_weight
        details["bce"] = bce.detach()
        details["confidence"] = torch.sigmoid(confidence_logits.detach().float())
    full_draft_argmax = draft_logits.argmax(-1) if draft_to_target is None else draft_to_target[draft_logits.argmax(-1)]
    details["top1"] = (full_draft_argmax == target.argmax).float()
    return loss, details


def soft_cross_entropy(draft_logits: torch.Tensor, target: torch.Tensor | TargetDistribution,
                       draft_to_target: torch.Tensor | None = None) -> torch.Tensor:
    """-sum_v p_target(v) log q(v) per row, over the draft vocabulary (p outside it cannot be matched)."""
    return _soft_cross_entropy(draft_logits, _as_distribution(target, draft_to_target).probs)


def _soft_cross_entropy(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    return -(target_probs * draft_logits.float().log_softmax(dim=-1)).sum(dim=-1)


def selector_candidates(base_logits: torch.Tensor, labels: torch.Tensor, top_k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash 2's training candidates: the backbone's top-k (N, k) output-vocabulary indices, the weakest replaced
    by the label (N,) when the label is not among them (-100, a label outside the draft vocabulary, keeps them),
    and where each row's label sits (N,; -100 for no label)."""
    candidates = base_logits.detach().topk(top_k, dim=-1).indices
    has_label = labels >= 0
    found = candidates == labels[:, None]
    missing = has_label & ~found.any(dim=-1)
    candidates[:, -1] = torch.where(missing, labels, candidates[:, -1])
    position = torch.where(missing, top_k - 1, found.long().argmax(dim=-1))
    return candidates, torch.where(has_label, position, torch.full_like(position, -100))


def selector_cross_entropy(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per row, -log softmax(scores)[position] over the C candidates (0 where the position is -100)."""
    return F.cross_entropy(scores.float(), positions, ignore_index=-100, reduction="none")
