"""`transformers` candidate generators for hf_dspark drafters.

Each round they read the target's hidden states at the drafter's layers from the previous target forward
(only the rows of tokens that were accepted), extend the drafter's context cache with them, and draft up to
gamma tokens. The user's logits processors are applied exactly once to each draft slot, with the same context
the target's slot will see during verification, and the processed logits are returned so that the verifier
uses the very distribution the tokens were sampled from.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from .common import BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE, DraftContextCache, DraftPreTrainedModel, drafter_type
from .modeling_dspark import DSparkDraftModel
from .modeling_eagle3 import Eagle3DraftModel
from .draft_length import ThroughputDraftLength
from .stats import SpeculativeStats


class DraftCandidateGenerator(CandidateGenerator):
    """Shared bookkeeping: which target rows the drafter has consumed, the draft budget, token choice."""

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
        self.stats = SpeculativeStats()
        self._round_confidences: list[float] = []

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
        features = self._new_context_features(input_ids, model_outputs)
        budget = min(self.drafter.draft_length(), self.max_length - input_ids.shape[1] - 1)
        self._round_confidences = []
        if budget <= 0:
            self._consume_context_only(input_ids, features)
            return input_ids, None
        tokens, logits = self._draft(input_ids, features, budget)
        if tokens.shape[1] == 0:
            return input_ids, None
        return torch.cat([input_ids, tokens], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Called after verification: records the round (the draft length is the slots verified)."""
        self.stats.record(scores.shape[1] - 1, int(num_matches), self._round_confidences)

    # -- helpers ----------------------------------------------------------------------------------------------

    def _new_context_features(self, input_ids: torch.LongTensor, model_outputs) -> torch.Tensor:
        """Concatenated target features of the positions accepted since the last round (all before the anchor)."""
        anchor_position = input_ids.shape[1] - 1
        new_rows = anchor_position - self.context_length
        hidden_states = model_outputs.hidden_states
        features = torch.cat([hidden_states[i] for i in self.drafter.target_hidden_state_indices], dim=-1)
        if new_rows < 1 or features.shape[1] < new_rows:
            raise RuntimeError(
                f"drafter context is out of step with the sequence: {self.context_length} rows consumed, anchor at "
                f"{anchor_position}, {features.shape[1]} new target rows"
            )
        self.context_length = anchor_position
        return features[:, :new_rows]

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

    def _consume_context_only(self, input_ids, features) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class DSparkCandidateGenerator(DraftCandidateGenerator):
    """DSpark and DFlash: one parallel backbone pass per round, then sequential sampling through the head."""

    drafter: DSparkDraftModel

    def _backbone(self, input_ids, features):
        config = self.drafter.config
        anchor = input_ids[:, -1:]
        block = torch.cat([anchor, anchor.new_full((1, config.block_size - 1), config.mask_token_id)], dim=-1)
        return self.drafter(input_ids=block, target_hidden_states=features, cache=self.cache)

    def _consume_context_only(self, input_ids, features) -> None:
        self._backbone(input_ids, features)

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
                if threshold is not None and survival < threshold:
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

    def _consume_context_only(self, input_ids, features) -> None:
        self._context_pass(input_ids, features)

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
