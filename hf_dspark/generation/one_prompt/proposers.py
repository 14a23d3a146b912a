"""Draft proposers of the batch-1 loop, one per drafter kind.

Each round they take the target's hidden states at the drafter's layers for the positions committed since the
last round (the accepted tokens), and propose the next round's drafts. The round is planned as in the batched engine,
by the same `policy.planner.RoundPolicy` at R = 1: from earlier rounds only, the drafter's block, a suffix match
over the text so far (`dspark_suffix_drafting`) or no draft at all (a plain decoding step), priced by what it is
expected to emit per second; the drafter then runs only in the rounds that use it and catches up on the context rows
it skipped in one pass. The user's logits processors are applied exactly once to each draft slot, with the same
context the target's slot will see during verification, and the distributions are returned so that the verifier uses
the very distribution the tokens were sampled from (one-hot for a suffix proposal). DSpark and DFlash draft through
the same core as the batched engine (`round.drafting.draft_block`, R = 1) and verify the length the plan's
`DraftLengthRule` picks; a round reads the device once here (the verified length and its confidences) and once in the
loop (the verification's outcome). Every setting comes from the call's `DraftingPlan`; what rounds learn goes to its
`DraftingState`.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList

from ...models.drafter_base import DraftPreTrainedModel
from ...models.identity import BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE, drafter_type
from ...models.layers import DraftContextCache
from ...models.modeling_dspark import DSparkDraftModel
from ...models.modeling_eagle3 import Eagle3DraftModel
from ...policy.planner import DRAFTER, NO_DRAFT, SUFFIX, RoundPlan
from ..round.drafting import Drafts, draft_block, draft_input_block, one_hot_probs
from ..engine.eagle3 import context_pass, draft_chain
from ..call.plan import DraftingPlan
from ..round.sampling import ProcessorSampling
from ..round.stats import PhaseClock, SpeculativeStats


class DraftCandidateGenerator:
    """Shared bookkeeping: which target rows the drafter has consumed, the round's proposer, token choice."""

    def __init__(
        self,
        drafter: DraftPreTrainedModel,
        logits_processor: LogitsProcessorList | None,
        generation_config: GenerationConfig,
        plan: DraftingPlan,
    ):
        self.drafter, self.plan = drafter, plan
        self.sampling = ProcessorSampling(logits_processor, bool(generation_config.do_sample))
        self.do_sample = self.sampling.any_sampled
        self.max_length = generation_config.max_length
        self.cache = DraftContextCache()
        self.context_length = 0  # sequence positions whose target features are in the drafter cache
        self.observed_length = 0  # sequence positions whose target features were taken from a target forward
        self._pending: list[torch.Tensor] = []  # features of positions context_length..observed_length
        self.stats = SpeculativeStats()
        self.clock = PhaseClock(drafter.device, plan.settings.time_phases)
        self._round_confidences: list[float] = []
        costs = plan.cost_model(timed=self.clock.enabled)
        self.rule = plan.length_rule(costs)
        self.planning = plan.round_policy(self.rule.max_slots(plan.draft_length), costs)
        self.text = _OnePrompt(generation_config.max_length)
        self._round = RoundPlan(False, [NO_DRAFT], [0])
        self._verification_started = 0.0
        self._draft_timed = True

    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, model_outputs) -> Drafts:
        """The next round's drafts after the committed `input_ids` (1, L): `Drafts` with `lengths` (1,) and, as
        `drafts.length`, the verified length on the host. `model_outputs` is the last target forward's."""
        self._observe(input_ids, model_outputs)
        self.sampling.sequence = input_ids
        budget = min(self.plan.draft_length, self.max_length - input_ids.shape[1] - 1)
        self._round_confidences = []
        started = self.clock.now()
        self._round = plan = self.planning.plan([0], [self.text], [max(budget, 0)], drafter_possible=budget > 0)
        self.clock.lap(self.stats, "planning", started)
        source, length = plan.sources[0], plan.lengths[0]
        if source == SUFFIX:
            drafts = self._suffix_drafts(input_ids, self.planning.suffix_rows(plan, [0])[0])
        elif source == DRAFTER:
            features = torch.cat(self._pending, dim=1)
            self._pending = []
            self.context_length = self.observed_length
            # A pass that catches up on more rows than a round commits (every prompt row, on a call's first pass)
            # costs what a round does not: not timed.
            self._draft_timed = features.shape[1] <= self.drafter.config.num_draft_slots + 1
            drafts = self._draft(input_ids, features, length)
        else:
            drafts = Drafts.empty(1, input_ids.device)
        self._verification_started = self.planning.drafted()
        return drafts

    def record_round(self, num_accepted: int, draft_length: int, emitted: int) -> None:
        """After verification (host values): what the round taught the planner (its acceptance, its passes' costs,
        timed from the plan to this read) and the round's statistics. `num_accepted` drafts were accepted and
        `emitted` of them kept before a stop."""
        self.planning.record(self._round, [0], [draft_length], [num_accepted], draft_length + 1,
                             self._verification_started, self._draft_timed, [self._round_confidences])
        self.stats.record(draft_length, emitted, self._round_confidences, self._round.sources[0])

    def extend_text(self, new_tokens: list[int], prompt: bool = False) -> None:
        """Tokens appended to the sequence (the prompt, then each round's output, as host ints), which the planner's
        suffix proposer reads (scoring its proposals so far against the text that followed them)."""
        self.text.tokens.extend(new_tokens)
        if prompt:
            self.text.prompt_length = len(new_tokens)

    # -- helpers ----------------------------------------------------------------------------------------------

    def _observe(self, input_ids: torch.LongTensor, model_outputs) -> None:
        """Keep the target features of the positions committed by the last forward (all before the anchor)."""
        anchor_position = input_ids.shape[1] - 1
        new_rows = anchor_position - self.observed_length
        hidden_states = model_outputs.hidden_states
        width = hidden_states[self.drafter.target_hidden_state_indices[0]].shape[1]
        if new_rows < 1 or width < new_rows:
            raise RuntimeError(
                f"drafter context is out of step with the sequence: {self.observed_length} rows observed, anchor at "
                f"{anchor_position}, {width} new target rows"
            )
        # With a device_map the layers' states live on their layers' devices; the drafter sits by the LM head.
        device = self.drafter.device
        features = torch.cat([hidden_states[i][:, :new_rows].to(device) for i in self.drafter.target_hidden_state_indices],
                             dim=-1)
        self._pending.append(features)
        self.observed_length = anchor_position

    def _suffix_drafts(self, input_ids, proposal: list[int]) -> Drafts:
        """A suffix proposal as drafts: each slot's draft distribution is the point mass on its token (sampling
        accepts x with probability min(1, p(x))). Greedy verification compares tokens only, so it gets none."""
        tokens = torch.tensor([proposal], dtype=input_ids.dtype, device=input_ids.device)
        probs = one_hot_probs(tokens, self.drafter.config.vocab_size) if self.do_sample else None
        lengths = torch.full((1,), len(proposal), dtype=torch.long, device=input_ids.device)
        return Drafts(tokens, probs, lengths, length=len(proposal))

    def _draft(self, input_ids, features, budget) -> Drafts:  # pragma: no cover - abstract
        raise NotImplementedError


class DSparkCandidateGenerator(DraftCandidateGenerator):
    """DSpark and DFlash: one parallel backbone pass per round, then the sequential head through the shared
    drafting core, then the draft-length rule on the device."""

    drafter: DSparkDraftModel

    def _backbone(self, input_ids, features):
        block = draft_input_block(input_ids[:, -1], self.drafter.config)
        return self.drafter(input_ids=block, target_hidden_states=features, cache=self.cache)

    def _draft(self, input_ids, features, budget) -> Drafts:
        started = self.clock.now()
        out = self._backbone(input_ids, features)
        started = self.clock.lap(self.stats, "backbone", started)
        budget = min(budget, self.rule.max_slots(budget))
        tokens, probs, confidences = draft_block(self.drafter, out, input_ids[:, -1], budget, self.sampling)
        budgets = torch.full((1,), budget, dtype=torch.long, device=input_ids.device)
        lengths = self.rule.lengths(confidences, budgets)
        if confidences is None:
            length = budget
        else:
            # The round's one read of the device: the verified length and the confidences of its slots.
            values = torch.cat([lengths.to(confidences.dtype), confidences[0]]).tolist()
            length = int(values[0])
            self._round_confidences = values[1 : 1 + length]
        self.clock.lap(self.stats, "sequential_head", started)
        return Drafts(tokens, probs, lengths, confidences, length)


class Eagle3CandidateGenerator(DraftCandidateGenerator):
    """Eagle3: context rows in one pass, then one drafter step per drafted token, feeding its own state: the
    engine's steps (`engine.eagle3.context_pass`, `draft_chain`) at R = 1, on a cache without holes."""

    drafter: Eagle3DraftModel

    def _draft(self, input_ids, features, budget) -> Drafts:
        started = self.clock.now()
        budget = self.rule.max_slots(budget)  # ("fixed", k): a chain drafts only what is verified
        # Row t pairs the target feature at t with the token at t + 1; the features are the newest rows.
        first_row = self.context_length - features.shape[1]
        next_tokens = input_ids[:, first_row + 1 : self.context_length + 1]
        logits, state = context_pass(self.drafter, next_tokens, features, self.cache)
        tokens, probs = draft_chain(self.drafter, logits, state, budget, self.sampling, None, self.cache)
        self.clock.lap(self.stats, "drafting", started)
        if not budget:  # ("fixed", 0): the context is consumed, nothing is drafted
            return Drafts.empty(1, input_ids.device)
        lengths = torch.full((1,), budget, dtype=torch.long, device=input_ids.device)
        return Drafts(tokens, probs, lengths, length=budget)


def candidate_generator_for(
    drafter: DraftPreTrainedModel, logits_processor: LogitsProcessorList | None, generation_config: GenerationConfig,
    plan: DraftingPlan,
) -> DraftCandidateGenerator:
    if drafter_type(drafter) == BLOCK_DRAFTER_TYPE:
        return DSparkCandidateGenerator(drafter, logits_processor, generation_config, plan)
    if drafter_type(drafter) == EAGLE3_DRAFTER_TYPE:
        return Eagle3CandidateGenerator(drafter, logits_processor, generation_config, plan)
    raise TypeError(f"no candidate generator for {type(drafter).__name__}")


class _OnePrompt:
    """The text as the round planner reads a request: its tokens so far (prompt first), the tokens it may emit
    (`max_new_tokens`) and has emitted, both derived from the call's `max_length`."""

    def __init__(self, max_length: int):
        self.tokens: list[int] = []
        self.max_length, self.prompt_length = max_length, 0

    @property
    def max_new_tokens(self) -> int:
        return self.max_length - self.prompt_length

    @property
    def emitted(self) -> int:
        return len(self.tokens) - self.prompt_length
