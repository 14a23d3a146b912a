"""The batch-1 loop's one row as a round sees it (`round.skeleton.RoundRows`): the target cache is cropped after every
round (no holes, no masks, no positions), and the drafter reads the target's features at its layers for the
positions committed since it last ran.

Each verification's features wait (`commit` queues those of the committed positions) until a round drafts: the
drafter then catches up on every queued row in its one pass. The drafter kinds' passes are the engine's at R = 1:
DSpark, DFlash and DFlash 2 through the block core (`round.drafting.draft_block`), Eagle3 through the chain
(`context_pass`, `draft_chain`).
"""

from __future__ import annotations

import torch

from ...models.identity import EAGLE3_DRAFTER_TYPE, drafting_core
from ...models.layers import DraftContextCache
from ..round.drafting import Drafts, context_pass, draft_block, draft_chain, draft_input_block, drafting_pass
from ..round.stats import PhaseClock, SpeculativeStats


class OnePromptRows:
    """One prompt: its sequence so far, the target runner (the verification forward, the cache's crop) and the
    drafter's context cache, with the queued features of the positions it has not read yet. Phases are timed into
    `stats` by `clock`."""

    def __init__(self, drafter, runner, sequence: torch.LongTensor, cost_table, clock: PhaseClock,
                 stats: SpeculativeStats):
        self.drafter, self.runner, self.sequence, self.cost_table = drafter, runner, sequence, cost_table
        self.clock, self.stats = clock, stats
        self.eagle3 = drafting_core(drafter) == EAGLE3_DRAFTER_TYPE
        self.cache = DraftContextCache()
        self.context_length = 0  # sequence positions whose target features are in the drafter cache
        self.observed_length = 0  # sequence positions whose target features were taken from a target forward
        self._queued: list[torch.Tensor] = []  # features of positions context_length..observed_length
        self._outputs = None  # the newest target forward's outputs

    @property
    def anchor(self) -> torch.LongTensor:
        return self.sequence[:, -1]

    def queued_context(self) -> int:
        return self.observed_length - self.context_length

    def prefill(self) -> torch.Tensor:
        """The prompt through the target; returns the logits after it (1, 1, V)."""
        self._outputs, logits = self.runner.forward(self.sequence, keep=1)
        return logits

    def commit(self, sequence: torch.LongTensor) -> None:
        """The round's tokens are appended (`sequence`): crop the target cache to every position but the newest
        token, as after plain decoding, and queue the features of the positions the last forward committed."""
        self.sequence = sequence
        anchor_position = sequence.shape[1] - 1
        self.runner.crop(anchor_position)
        new_rows = anchor_position - self.observed_length
        hidden_states = self._outputs.hidden_states
        layers = self.drafter.target_hidden_state_indices
        width = hidden_states[layers[0]].shape[1]
        if new_rows < 1 or width < new_rows:
            raise RuntimeError(f"drafter context is out of step with the sequence: {self.observed_length} rows "
                               f"observed, anchor at {anchor_position}, {width} new target rows")
        # With a device_map the layers' states live on their layers' devices; the drafter sits by the LM head.
        device = self.drafter.device
        self._queued.append(torch.cat([hidden_states[i][:, :new_rows].to(device) for i in layers], dim=-1))
        self.observed_length = anchor_position

    def draft(self, budget: torch.LongTensor, slots: int, rule, sampling, generator) -> Drafts:
        """The drafter's pass over the queued features, `slots` slots drafted (see the module)."""
        features = torch.cat(self._queued, dim=1)
        self._queued = []
        self.context_length = self.observed_length
        started = self.clock.now()
        if self.eagle3:
            # Row t pairs the target feature at t with the token at t + 1; the features are the newest rows.
            first_row = self.context_length - features.shape[1]
            next_tokens = self.sequence[:, first_row + 1 : self.context_length + 1]
            logits, state = context_pass(self.drafter, next_tokens, features, self.cache)
            tokens, probs = draft_chain(self.drafter, logits, state, slots, sampling, generator, self.cache)
            self.clock.lap(self.stats, "drafting", started)
            return Drafts(tokens, probs, rule.lengths(None, budget))
        block = draft_input_block(self.anchor, self.drafter.config)
        out = self.drafter(input_ids=block, target_hidden_states=features, cache=self.cache,
                           logits_mask=drafting_pass(block.device))
        started = self.clock.lap(self.stats, "backbone", started)
        tokens, probs, confidences = draft_block(self.drafter, out, self.anchor, slots, sampling, generator)
        lengths = rule.lengths(confidences, budget)
        self.clock.lap(self.stats, "sequential_head", started)
        return Drafts(tokens, probs, lengths, confidences)

    def verify_forward(self, tokens: torch.LongTensor, drafts: Drafts, width: int) -> torch.Tensor:
        started = self.clock.now()
        if self.cost_table is not None and not self.runner.pads_to_buckets:
            # Pad to the cheapest forward size: later dummy tokens cannot change earlier logits (causal), their
            # features are never read and their cache entries are cropped with the rejected drafts.
            padded = self.cost_table.padded_tokens(width)
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - width)], dim=-1)
        self._outputs, logits = self.runner.forward(tokens, keep=tokens.shape[1])
        self.clock.lap(self.stats, "verification", started)
        return logits[:, :width]


class OnePromptText:
    """The text as the round policy reads a request: its tokens so far (prompt first), the tokens it may emit
    (`max_new_tokens`) and has emitted, both derived from the call's `max_length`."""

    def __init__(self, tokens: list[int], max_length: int):
        self.tokens = list(tokens)
        self.max_length, self.prompt_length = max_length, len(tokens)

    @property
    def max_new_tokens(self) -> int:
        return self.max_length - self.prompt_length

    @property
    def emitted(self) -> int:
        return len(self.tokens) - self.prompt_length
