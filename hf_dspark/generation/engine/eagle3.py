"""Eagle3 drafting for R rows at once in the batched engine: the chain's two steps (`round.drafting.context_pass`,
`draft_chain`, which the batch-1 loop runs too) over rows whose drafter cache has holes.

In the engine the drafter cache keeps holes like the target's (`BatchRows.draft_valid`): the context pass attends to
the valid cached columns and, causally, to the valid queued ones (every queued row also sees itself, so a hole's
state stays finite for the layers after the first), at the queued entries' own positions; the chain's steps sit
at the anchor's position and on. The token after each queued feature is staged beside it
(`BatchRows.pending_tokens`); a row's newest queued entry is followed by its anchor, and its output starts the
row's chain, so that entry stays queued when rows project their context before a merge (`project_queued`).
Nothing here reads the device.
"""

from __future__ import annotations

import torch

from ...models.identity import EAGLE3_DRAFTER_TYPE, drafting_core
from ...models.modeling_eagle3 import Eagle3DraftModel
from ...policy.length_rule import DraftLengthRule
from .rows import BatchRows
from ..round.drafting import Drafts, context_pass, draft_chain


def newest_column(newest: torch.BoolTensor) -> torch.LongTensor:
    """(R,) the column of each row's one newest queued entry (`BatchRows.newest_entries`)."""
    return newest.long().argmax(dim=1)


def context_mask(cached_valid: torch.BoolTensor, queued_valid: torch.BoolTensor) -> torch.BoolTensor:
    """(R, 1, M, C + M): queued row i sees the valid cached columns and the valid queued rows up to itself, and
    itself always (a hole's row then attends somewhere: no NaN enters the layers after the first)."""
    width = queued_valid.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=queued_valid.device).tril()
    own = causal & queued_valid[:, None, :] | torch.eye(width, dtype=torch.bool, device=queued_valid.device)
    return torch.cat([cached_valid[:, None, :].expand(-1, width, -1), own], dim=-1)[:, None]


def draft_rows(drafter: Eagle3DraftModel, rows: BatchRows, budget: torch.LongTensor, slots: int,
               rule: DraftLengthRule, sampling, generator: torch.Generator | None) -> Drafts:
    """The engine's Eagle3 round for every row: one context pass over every row's queued context, then `slots`
    chain steps over all rows at once; each row verifies `rule.lengths(None, budget)` of them (no confidences)."""
    newest = rows.newest_entries()
    context_valid = torch.cat([rows.draft_valid, rows.pending_valid], dim=1)
    logits, state = context_pass(drafter, rows.next_tokens(newest), rows.pending, rows.draft_cache,
                                 rows.pending_positions, context_mask(rows.draft_valid, rows.pending_valid),
                                 newest_column(newest))
    rows.draft_valid = context_valid  # the queued context is in the cache now; verification queues the next
    rows.take_context()
    tokens, probs = draft_chain(drafter, logits, state, slots, sampling, generator, rows.draft_cache,
                                rows.target_length, context_valid)
    return Drafts(tokens, probs, rule.lengths(None, budget))


def project_queued(drafter: Eagle3DraftModel, rows: BatchRows) -> None:
    """Move the queued context into the drafter cache now (`passes.project_context`, before rows join),
    except each row's newest entry, which stays queued alone: its output starts the row's next chain. Its column
    is projected too, as a hole (the columns of the others vary by row), so the next pass appends one column."""
    if rows.pending.shape[1] <= 1:  # one column: every row's newest entry, nothing else
        return
    newest = rows.newest_entries()
    older = rows.pending_valid & ~newest
    none = older.new_zeros(0, dtype=torch.long)  # no logits are needed (an index: a mask would read the device)
    drafter(input_ids=rows.pending_tokens, target_hidden_states=rows.pending, position_ids=rows.pending_positions,
            attention_mask=context_mask(rows.draft_valid, older), cache=rows.draft_cache, logits_mask=(none, none))
    rows.draft_valid = torch.cat([rows.draft_valid, older], dim=1)
    column = newest_column(newest)[:, None]
    rows.pending = rows.pending.gather(1, column[..., None].expand(-1, -1, rows.pending.shape[-1]))
    rows.pending_valid, rows.pending_positions = newest.gather(1, column), rows.pending_positions.gather(1, column)
    rows.pending_tokens = rows.pending_tokens.gather(1, column)


def row_drafter_for(drafter):
    """The engine's drafting pass for `drafter` when it is an Eagle3 drafter (`draft_rows`), else None."""
    return draft_rows if drafting_core(drafter) == EAGLE3_DRAFTER_TYPE else None


__all__ = ["context_mask", "draft_rows", "project_queued", "row_drafter_for"]
