"""`transformers` candidate generators for hf_dspark drafters.

Each round they take the target's hidden states at the drafter's layers for the positions committed since the
last round (the accepted tokens), and propose the next round's drafts. With a cost table they first decide, from
earlier rounds only, whether the drafter's block, a suffix match over the text so far (`drafter.suffix_drafting`)
or no draft at all (a plain decoding step) gives the most expected tokens per second; the drafter then runs only
in the rounds that use it and catches up on the context rows it skipped in one pass. The user's logits processors
are applied exactly once to each draft slot, with the same context the target's slot will see during
verification, and the processed logits are returned so that the verifier uses the very distribution the tokens
were sampled from (one-hot for a suffix proposal).
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from ..models.common import BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE, DraftContextCache, DraftPreTrainedModel, drafter_type
from ..models.modeling_dspark import DSparkDraftModel
from ..models.modeling_eagle3 import Eagle3DraftModel
from ..scheduling.draft_length import (
    DRAFTER,
    NO_DRAFT,
    SUFFIX,
    ProposalStatistics,
    RoundPlanner,
    ThroughputDraftLength,
)
from .stats import SpeculativeStats
from .suffix import SuffixIndex


class DraftCandidateGenerator(CandidateGenerator):
    """Shared bookkeeping: which target rows the drafter has consumed, the round's proposer, token choice."""

    requires_model_outputs = True

    def __init__(
        self,
        drafter: DraftPreTrainedModel,
        logits_processor: LogitsProcessorList | None,
        generation_config: GenerationConfig,
    ):
        self.drafter = drafter
        self.logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.model_kwargs_overrides = {"output_hidden_states": drafter.target_hidden_state_indices}
        self.cache = DraftContextCache()
        self.context_length = 0  # sequence positions whose target features are in the drafter cache
        self.observed_length = 0  # sequence positions whose target features were taken from a target forward
        self._pending: list[torch.Tensor] = []  # features of positions context_length..observed_length
        self.stats = SpeculativeStats()
        self._round_confidences: list[float] = []
        self._round_source = NO_DRAFT
        self._watched: list[tuple[int, list[int], int]] = []  # suffix proposals not yet scored
        self.suffix = SuffixIndex() if drafter.suffix_drafting else None
        if drafter.proposal_statistics is None:
            drafter.proposal_statistics = ProposalStatistics()  # kept on the drafter: later calls start from it
        self.planner = RoundPlanner(drafter.verification_costs, drafter_has_confidences(drafter),
                                    drafter.proposal_statistics)

    # -- protocol ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """Return (input_ids followed by k drafted tokens, processed draft logits (1, k, V)); k may be 0."""
        if is_first_iteration or model_outputs is None:
            return input_ids, None
        self._observe(input_ids, model_outputs)
        budget = min(self.drafter.draft_length(), self.max_length - input_ids.shape[1] - 1)
        self._round_confidences, self._round_source = [], NO_DRAFT
        if budget <= 0:
            return input_ids, None
        proposal, match = self.suffix.propose(budget) if self.suffix is not None else ([], 0)
        if proposal:
            self._watched.append((len(self.suffix.tokens), proposal, match))
        source, length = DRAFTER, 0
        if self.drafter.round_planning:
            started = time.perf_counter()
            source, length = self.planner.choose(proposal, match)
            self.stats.add_seconds("planning", time.perf_counter() - started)
        if source == SUFFIX:
            self._round_source = SUFFIX
            return self._suffix_candidates(input_ids, proposal[:length])
        if source == NO_DRAFT:
            return input_ids, None
        self._round_source = DRAFTER
        features = torch.cat(self._pending, dim=1)
        self._pending = []
        self.context_length = self.observed_length
        tokens, logits = self._draft(input_ids, features, budget)
        self.planner.record_drafter(self._round_confidences)
        if tokens.shape[1] == 0:
            return input_ids, None
        return torch.cat([input_ids, tokens], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Called after verification: records the round (the draft length is the slots verified)."""
        draft_length = scores.shape[1] - 1
        if self._round_source == DRAFTER:
            self.planner.record_drafter_accepted(int(num_matches), draft_length)
        self.stats.record(draft_length, int(num_matches), self._round_confidences, self._round_source)

    def extend_text(self, new_tokens: torch.LongTensor) -> None:
        """Tell the suffix index about tokens appended to the sequence (the prompt, then each round's output), and
        score the suffix proposals made so far against the text that followed them."""
        if self.suffix is None:
            return
        self.suffix.extend(new_tokens[0].tolist())
        text, still_open = self.suffix.tokens, []
        for start, proposal, match in self._watched:
            seen = text[start : start + len(proposal)]
            matched = 0
            while matched < len(seen) and seen[matched] == proposal[matched]:
                matched += 1
            if matched < len(seen) or len(seen) == len(proposal):
                # What verifying the proposal would have accepted: every round scores the suffix drafter, chosen
                # or not, so its statistics never starve while plain steps or the drafter are preferred.
                self.drafter.proposal_statistics.suffix.record(match, len(proposal), matched)
            else:
                still_open.append((start, proposal, match))
        self._watched = still_open

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
        features = torch.cat([hidden_states[i][:, :new_rows] for i in self.drafter.target_hidden_state_indices], dim=-1)
        self._pending.append(features)
        self.observed_length = anchor_position

    def _suffix_candidates(self, input_ids, proposal: list[int]):
        """A suffix proposal as drafts: each slot's draft distribution is the point mass on its token (sampling
        accepts x with probability min(1, p(x))). Greedy verification compares tokens only, so it gets no logits."""
        tokens = torch.tensor([proposal], dtype=input_ids.dtype, device=input_ids.device)
        if not self.do_sample:
            return torch.cat([input_ids, tokens], dim=-1), None
        vocab = self.drafter.config.vocab_size
        logits = torch.full((1, len(proposal), vocab), float("-inf"), device=input_ids.device)
        logits.scatter_(-1, tokens[..., None], 0.0)
        return torch.cat([input_ids, tokens], dim=-1), logits

    def _choose(self, logits: torch.Tensor, context_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor]:
        """Apply the processors once, then pick the draft token from the processed distribution."""
        processed = self.logits_processor(context_ids, self.drafter.to_target_vocab(logits.float()))
        if self.do_sample:
            token = torch.multinomial(processed.softmax(dim=-1), num_samples=1)
        else:
            token = processed.argmax(dim=-1, keepdim=True)
        return token, processed

    def _draft(self, input_ids, features, budget):  # pragma: no cover - abstract
        raise NotImplementedError


def drafter_has_confidences(drafter) -> bool:
    return getattr(drafter, "confidence_proj", None) is not None


class DSparkCandidateGenerator(DraftCandidateGenerator):
    """DSpark and DFlash: one parallel backbone pass per round, then sequential sampling through the head."""

    drafter: DSparkDraftModel

    def _backbone(self, input_ids, features):
        config = self.drafter.config
        anchor = input_ids[:, -1:]
        block = torch.cat([anchor, anchor.new_full((1, config.block_size - 1), config.mask_token_id)], dim=-1)
        return self.drafter(input_ids=block, target_hidden_states=features, cache=self.cache)

    def _draft(self, input_ids, features, budget):
        started = time.perf_counter()
        out = self._backbone(input_ids, features)
        backbone_done = time.perf_counter()
        self.stats.add_seconds("backbone", backbone_done - started)
        hidden, base_logits = out.last_hidden_state[0], out.base_logits[0]
        head = self.drafter.sequential_head
        threshold = self.drafter.confidence_threshold
        schedule = None
        if self.drafter.confidence_proj is not None and self.drafter.verification_costs is not None:
            schedule = ThroughputDraftLength(self.drafter.verification_costs)

        previous = input_ids[:, -1]
        state = head.initial_state(1, hidden) if head is not None else None
        sequence, tokens, processed_logits = input_ids, [], []
        survival = 1.0
        for slot in range(budget):
            logits, confidence, state = self.drafter.draft_slot(
                hidden[slot : slot + 1], base_logits[slot : slot + 1], previous, state, slot
            )
            if confidence is not None:
                survival *= float(confidence)
                # Stopping on c_1..c_k only (never on x_k itself) keeps the variable draft length lossless.
                if threshold is not None and self.drafter.below_confidence_threshold(survival, float(confidence)):
                    break
                if schedule is not None and not schedule.admit(survival):
                    break
                self._round_confidences.append(float(confidence))
            token, processed = self._choose(logits, sequence)
            tokens.append(token)
            processed_logits.append(processed)
            sequence = torch.cat([sequence, token], dim=-1)
            previous = token[:, 0]
        self.stats.add_seconds("sequential_head", time.perf_counter() - backbone_done)
        if not tokens:
            return input_ids.new_zeros(1, 0), None
        return torch.cat(tokens, dim=-1), torch.stack(processed_logits, dim=1)


class Eagle3CandidateGenerator(DraftCandidateGenerator):
    """Eagle3: context rows in one pass, then one drafter step per drafted token, feeding its own state."""

    drafter: Eagle3DraftModel

    def _context_pass(self, input_ids, features):
        # Row t pairs the target feature at t with the token at t + 1; the features are the newest rows.
        first_row = self.context_length - features.shape[1]
        next_tokens = input_ids[:, first_row + 1 : self.context_length + 1]
        return self.drafter(input_ids=next_tokens, target_hidden_states=features, cache=self.cache)

    def _draft(self, input_ids, features, budget):
        started = time.perf_counter()
        out = self._context_pass(input_ids, features)
        logits, state = out.logits[:, -1], out.hidden_states[:, -1:]
        sequence, tokens, processed_logits = input_ids, [], []
        for step in range(budget):
            token, processed = self._choose(logits, sequence)
            tokens.append(token)
            processed_logits.append(processed)
            sequence = torch.cat([sequence, token], dim=-1)
            if step + 1 < budget:
                out = self.drafter(input_ids=token, hidden_states=state, cache=self.cache)
                logits, state = out.logits[:, -1], out.hidden_states
        self.cache.crop(self.context_length)  # drafted rows were built on the drafter's own states
        self.stats.add_seconds("drafting", time.perf_counter() - started)
        return torch.cat(tokens, dim=-1), torch.stack(processed_logits, dim=1)


def candidate_generator_for(
    drafter: DraftPreTrainedModel, logits_processor: LogitsProcessorList | None, generation_config: GenerationConfig
) -> DraftCandidateGenerator:
    if drafter_type(drafter) == BLOCK_DRAFTER_TYPE:
        return DSparkCandidateGenerator(drafter, logits_processor, generation_config)
    if drafter_type(drafter) == EAGLE3_DRAFTER_TYPE:
        return Eagle3CandidateGenerator(drafter, logits_processor, generation_config)
    raise TypeError(f"no candidate generator for {type(drafter).__name__}")
