"""Simulated serving: verification policies under load, from a cost table and a model of the drafter's confidences.

A real run on one machine shows one cost curve. To see what the DSpark scheduler does on other hardware (a GPU,
where verifying 8 tokens costs about as much as 1 until the batch saturates the chip), `simulate_policy` replays
rounds of R concurrent requests: each round draws every request's per-slot conditional acceptance probabilities
c[r, j] from a `ConfidenceModel`, lets the policy pick how many slots each request verifies (with `planning`, the
policy's own classes decide before drafting too, from prices learnt off the simulated seconds), draws acceptance
(slot j survives with probability c[r, j] once its prefix did, or a given function of it), and charges the round
`draft_seconds(R)` when the drafter ran and the forward over R rows padded to the widest. Plain decoding is the
policy that verifies no drafts and pays no drafting.

Throughput is tokens per second over all requests (aggregate); per-user speed is that divided by R (every request
is running all the time). Both come from the same simulated rounds, so policies are compared on equal draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.cost_table import VerificationCostTable
from ..policy.acceptance import ConfidenceShift, SlotAcceptance
from ..policy.costs import CostModel
from ..policy.length_rule import DraftLengthRule
from ..policy.planner import RoundPolicy

POLICIES = ("plain", "all", "fixed", "threshold", "scheduler")


@dataclass
class ConfidenceModel:
    """Per-slot conditional acceptance probabilities c[r, j] ~ Beta with mean `means[j]` and concentration
    `concentration` (lower: requests differ more, which is what a scheduler can exploit)."""

    means: list[float]
    concentration: float = 4.0

    def sample(self, requests: int, generator: torch.Generator) -> torch.Tensor:
        means = torch.tensor(self.means).clamp(1e-3, 1 - 1e-3).expand(requests, -1)
        alpha, beta = means * self.concentration, (1 - means) * self.concentration
        # Beta(a, b) = G_a / (G_a + G_b); torch.distributions takes no generator, _standard_gamma does.
        gamma_a = torch._standard_gamma(alpha.contiguous(), generator=generator)
        gamma_b = torch._standard_gamma(beta.contiguous(), generator=generator)
        return gamma_a / (gamma_a + gamma_b)

    @property
    def draft_length(self) -> int:
        return len(self.means)


def gpu_like_costs(step_seconds: float = 0.012, saturation_tokens: int = 256, sharpness: float = 4.0,
                   max_tokens: int = 4096, draft_fraction: float = 0.15) -> tuple[VerificationCostTable, Callable]:
    """A GPU-shaped cost curve: a forward over B tokens costs `step_seconds` while the chip is memory bound and
    grows linearly once B passes `saturation_tokens` (smoothly, with `sharpness`). Drafting R requests costs
    `draft_fraction` of a target forward over R * draft_length tokens' worth of compute on the same curve (the drafter is
    a few layers against the target's dozens). Returns (verification cost table, draft_seconds(R, draft_length))."""

    def forward(tokens: float) -> float:
        return step_seconds * (1 + (tokens / saturation_tokens) ** sharpness) ** (1 / sharpness)

    table = VerificationCostTable([forward(b) for b in range(1, max_tokens + 1)], description={
        "kind": "simulated GPU-like", "step_seconds": step_seconds, "saturation_tokens": saturation_tokens,
        "sharpness": sharpness})
    return table, lambda requests, draft_length: draft_fraction * forward(requests * draft_length)


@dataclass
class PolicyResult:
    policy: str
    requests: int
    rounds: int
    tokens: int
    seconds: float
    verified_drafts: float
    """Mean drafts verified per request per round."""

    @property
    def aggregate_tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def per_user_tokens_per_second(self) -> float:
        return self.aggregate_tokens_per_second / self.requests


def policy_lengths(policy: str, policy_arg, confidences: torch.Tensor) -> torch.LongTensor:
    """Drafts each request verifies this round under `policy` (the engine's own `DraftLengthRule`, every slot
    drafted; ``"plain"`` verifies none)."""
    requests, draft_length = confidences.shape
    if policy == "plain":
        return torch.zeros(requests, dtype=torch.long)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    budget = torch.full((requests,), draft_length, dtype=torch.long)
    return DraftLengthRule(policy, policy_arg).lengths(confidences, budget)


class _Clock:
    """Simulated seconds, read by the policy as it reads the real clock."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Text:
    tokens: list[int] = []


def simulate_policy(policy: str, policy_arg, *, requests: int, rounds: int, confidence_model: ConfidenceModel,
                    costs: VerificationCostTable, draft_seconds: Callable[[int, int], float], seed: int = 0,
                    planning: bool = False, acceptance: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> PolicyResult:
    """`rounds` rounds of `requests` always-busy requests under one policy (same seed: same confidence draws).

    `planning`: the policy also decides before drafting (`RoundPolicy`, as `generate()`'s defaults do), from prices
    it learns off the simulated seconds, and ``"scheduler"`` without a scheduler of its own is the admission rule on
    those prices with its confidence calibration. `acceptance`: the chance each drafted slot is accepted given its
    confidence (None: the confidence itself, a calibrated head)."""
    generator = torch.Generator().manual_seed(seed)
    draft_length = confidence_model.draft_length
    clock, model, shift = _Clock(), CostModel(), ConfidenceShift()
    learnt = SlotAcceptance.empty(draft_length)  # the rule looks ahead at the rates the policy learns, as the loops'
    rule = DraftLengthRule(policy, policy_arg, costs=model, calibration=shift, acceptance=learnt
                           ) if policy != "plain" else None
    plans = RoundPolicy(draft_length, planning=planning, costs=model, drafter_acceptance=learnt,
                        calibration=shift, clock=clock, rule=rule)
    tokens, verified = 0, 0
    for _ in range(rounds):
        confidences = confidence_model.sample(requests, generator)
        accepted = torch.rand(requests, draft_length, generator=generator) < (
            confidences if acceptance is None else acceptance(confidences))
        plan = plans.plan(list(range(requests)), [_Text] * requests, [draft_length if rule else 0] * requests)
        budget = torch.tensor(plan.lengths)
        lengths = rule.lengths(confidences, budget) if plan.use_drafter else budget
        if plan.use_drafter:
            clock.now += draft_seconds(requests, draft_length)
        started = clock.now
        width = int(lengths.max()) + 1
        clock.now += costs.round_seconds(requests * width) - costs.draft_seconds  # rows padded to the widest
        in_prefix = torch.arange(draft_length).expand(requests, -1) < lengths[:, None]
        survived = (accepted & in_prefix).long().cumprod(dim=-1).sum(dim=-1)
        tokens += int(survived.sum()) + requests  # accepted drafts plus one target token each
        verified += int(lengths.sum())
        plans.record(plan, list(range(requests)), lengths.tolist(), survived.tolist(), width, started, True,
                     [confidences[r, : int(lengths[r])].tolist() for r in range(requests)])
    return PolicyResult(policy, requests, rounds, tokens, clock.now, verified / (rounds * requests))


def expected_tau(means: list[float]) -> float:
    """Tokens per round when every slot is verified: 1 + sum_k prod_{j<=k} E[c_j] (independent slots)."""
    return 1 + sum(math.prod(means[: k + 1]) for k in range(len(means)))
