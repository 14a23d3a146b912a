"""One speculative round, the same at every batch size: plan, propose, verify in one target forward, read the
outcome once, learn. Both loops run it (`one_prompt/loop.py` with R = 1, `engine/speculative_engine.py` with R rows);
what differs between them is their rows (`RoundRows`): one prompt on a cache cropped after every round
(`one_prompt/prompt_rows.py`), or R requests on caches with holes (`engine/passes.py` `EngineRows`).

1. Plan (`policy.planner.RoundPolicy.plan`, from earlier rounds only): per row the drafter's block, a suffix match of
   its own text, or nothing, and at most how many tokens each verifies.
2. Propose: one drafter pass for every row when some row drafts (`RoundRows.draft`: the drafting cores of
   `drafting.py`, then the policy's `DraftLengthRule` on the device), the suffix rows' proposals laid over them; the verified
   lengths (and confidences) read once, when the drafter's rule decided them on the device.
3. Verify: the anchor and the drafts in one target forward (`RoundRows.verify_forward`), accepted by the rule of
   `verification.py`, merged with the target's token (`round_tokens`).
4. Read the accepted counts and tokens once, and teach the policy what the round measured.

Committing the outcome (the caches, the rows' texts, stopping) is the loop's: it needs the stops, which only the
loop knows (a batch-1 call's own stopping criteria, each request's EOS and length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...policy.length_rule import DraftLengthRule
from ...policy.planner import DRAFTER, RoundPlan, RoundPolicy
from .drafting import Drafts, one_hot_probs, pad_to, round_tokens, to_device
from .verification import verify_drafts


class RoundRows(Protocol):
    """What a round needs of a loop's rows."""

    anchor: torch.LongTensor  # (R,) each row's newest committed token, the first the target verifies

    def queued_context(self) -> int:
        """Target positions the drafter's next pass catches up on (more than a round commits: an untimed pass)."""

    def draft(self, budget: torch.LongTensor, slots: int, rule: DraftLengthRule, sampling,
              generator: torch.Generator | None) -> Drafts:
        """One drafter pass for every row over its queued context, `slots` slots drafted, each row verifying at most
        its `budget` (R,) as `rule` decides on the device."""

    def verify_forward(self, tokens: torch.LongTensor, drafts: Drafts, width: int) -> torch.Tensor:
        """The target's logits (R, width, V) over `tokens` (R, width): each row's anchor then its drafts."""


@dataclass
class RoundOutcome:
    """A round's result. Host values: `plan`, `lengths` (verified per row), `accepted` (per row), `tokens` (per row,
    the accepted drafts then the target's token, then unused entries), `confidences` (per row, of its verified slots,
    or None). Device tensors: `new_tokens` (R, width) as `tokens`, `num_accepted` (R,), `logits` (R, width, V) the
    target's and `processed` their processed scores (batch 1's `output_scores`; None in the engine)."""

    plan: RoundPlan
    lengths: list[int]
    accepted: list[int]
    tokens: list[list[int]]
    confidences: list[list[float] | None]
    width: int
    new_tokens: torch.LongTensor
    num_accepted: torch.LongTensor
    logits: torch.Tensor
    processed: torch.Tensor | None


def speculative_round(rows: RoundRows, policy: RoundPolicy, request_ids: list[int], texts,
                      budgets: list[int], sampling, generator: torch.Generator | None,
                      vocab_size: int, left: list[int] | None = None) -> RoundOutcome:
    """One round for every row (see the module). `texts`: per row what the policy reads of it (`tokens`, the
    committed text, for suffix matches); `budgets`: per row the most tokens it may draft (its length limit leaves at
    least one for the target); `vocab_size`: the draft distributions' width for suffix proposals; `left`: per row the
    most tokens it may still emit (the policy's `plan`)."""
    plan = policy.plan(request_ids, texts, budgets, drafter_possible=max(budgets, default=0) > 0, left=left)
    # A pass that catches up on more context than a round commits (a prompt, or many plain rounds) costs what later
    # rounds do not: not timed.
    draft_timed = rows.queued_context() <= policy.draft_length + 1
    drafts, lengths, confidences = _proposals(rows, plan, policy, request_ids, sampling, generator, vocab_size)
    verification_started = policy.drafted()
    width = max(lengths) + 1
    tokens = torch.cat([rows.anchor[:, None], drafts.tokens[:, : width - 1].to(rows.anchor.device)], dim=1)
    logits = rows.verify_forward(tokens, drafts, width)
    num_accepted, next_token, processed = verify_drafts(sampling, logits, drafts, generator)
    new_tokens = round_tokens(tokens[:, 1:], num_accepted, next_token)
    values = torch.cat([num_accepted[:, None], new_tokens], dim=1).tolist()  # the round's one read of its outcome
    accepted = [row[0] for row in values]
    policy.record(plan, request_ids, lengths, accepted, width, verification_started, draft_timed, confidences)
    return RoundOutcome(plan, lengths, accepted, [row[1:] for row in values], confidences, width, new_tokens,
                        num_accepted, logits, processed)


def _proposals(rows: RoundRows, plan: RoundPlan, policy: RoundPolicy, request_ids: list[int], sampling, generator,
               vocab_size: int) -> tuple[Drafts, list[int], list]:
    """The round's drafts as planned: the drafter's rows drafted (one pass for every row, only when some row drafts),
    the suffix rows' proposals laid over them. Returns (drafts, verified lengths on the host, per row the confidences
    of its verified slots or None)."""
    num_rows, device = len(request_ids), rows.anchor.device
    drafter_budgets = [length if source == DRAFTER else 0 for source, length in zip(plan.sources, plan.lengths)]
    if plan.use_drafter:
        budget = to_device(drafter_budgets, device)
        drafts = rows.draft(budget, max(drafter_budgets), policy.rule, sampling, generator)
    else:  # the context stays queued for the drafter's next pass
        drafts = Drafts.empty(num_rows, device)
    suffix_rows = policy.suffix_rows(plan, request_ids)
    if suffix_rows:
        drafts = with_suffix_drafts(drafts, suffix_rows, vocab_size, sampling.any_sampled)
    if not plan.use_drafter or drafts.confidences is None:
        # Every length is known on the host: without confidences the rule keeps each budget (the plan's are within
        # the loop's `slots`, which the rule's own cap already bounds).
        lengths = [len(suffix_rows[row]) if row in suffix_rows else budget
                   for row, budget in enumerate(drafter_budgets)]
        return drafts, lengths, [None] * num_rows
    lengths, confidences = read_lengths(drafts)  # the round's first read
    return drafts, lengths, [c if source == DRAFTER else None for c, source in zip(confidences, plan.sources)]


def read_lengths(drafts: Drafts) -> tuple[list[int], list[list[float]]]:
    """The round's first read of the device: each row's verified length, with the confidences of those slots."""
    values = torch.cat([drafts.lengths[:, None].to(drafts.confidences.dtype), drafts.confidences], dim=1).tolist()
    lengths = [int(row[0]) for row in values]
    return lengths, [row[1 : 1 + length] for row, length in zip(values, lengths)]


def with_suffix_drafts(drafts: Drafts, suffix_rows: dict[int, list[int]], vocab_size: int, sampled: bool) -> Drafts:
    """`drafts` with the suffix rows' proposals laid over them: their tokens, their lengths, and (when some row
    samples) point-mass draft distributions, so rejection sampling accepts a token x with probability min(1, p(x)).
    Built on the host and copied without waiting; nothing is read back."""
    num_rows, device = drafts.tokens.shape[0], drafts.tokens.device
    width = max(drafts.tokens.shape[1], max(len(tokens) for tokens in suffix_rows.values()))
    host_tokens = torch.zeros(num_rows, width, dtype=torch.long)
    host_lengths = torch.zeros(num_rows, dtype=torch.long)
    is_suffix = torch.zeros(num_rows, dtype=torch.bool)
    for row, tokens in suffix_rows.items():
        host_tokens[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        host_lengths[row], is_suffix[row] = len(tokens), True
    suffix_tokens = host_tokens.to(device, non_blocking=True)
    is_suffix = is_suffix.to(device, non_blocking=True)
    tokens = torch.where(is_suffix[:, None], suffix_tokens, pad_to(drafts.tokens, width, 1))
    lengths = torch.where(is_suffix, host_lengths.to(device, non_blocking=True), drafts.lengths)
    probs = None
    if sampled:
        vocab = drafts.probs.shape[-1] if drafts.probs is not None else vocab_size
        base = drafts.probs if drafts.probs is not None else torch.zeros(num_rows, 0, vocab, device=device)
        probs = torch.where(is_suffix[:, None, None], one_hot_probs(suffix_tokens, vocab), pad_to(base, width, 1))
    return Drafts(tokens, probs, lengths, drafts.confidences)
