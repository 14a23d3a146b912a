"""Batched speculative decoding: R requests drafted and verified together by a DSpark or DFlash drafter.

Rows accept different numbers of drafts each round, so their sequences drift apart. Instead of cropping each row's
cache separately, both caches keep **holes**: every round appends the same number of entries to every row (its
newest token and drafts, padded to the longest row), and a per-row validity mask marks which entries are real.
Rejected drafts and padding stay in the caches, masked out of every later attention. Positions are explicit per
row (a row's next position is the number of its valid entries), so a hole never shifts a row's rotary phase.

* Target: one `DynamicCache` of width W for all rows and a (R, W) validity mask, passed as the 2D attention mask
  (transformers builds the causal 4D mask from it; the causal order is the cache order, which is each row's order).
* Drafter: one `DraftContextCache` and a (R, C) validity mask over its context rows. Each round appends, per row,
  the target features of the entries that became valid (the context strictly before the next anchor), then runs
  the backbone on `[anchor, MASK x (gamma-1)]` with a boolean mask allowing valid context and the whole block, and
  the sequential head slot by slot, vectorised over rows.

A finished request (EOS or `max_new_tokens`) is removed from every tensor and cache, so rounds only pay for the
requests still running. The verification rule is `greedy_verify` / `rejection_sample`, the same as at batch size 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer

from ..models.common import DraftContextCache
from ..models.modeling_dspark import DSparkDraftModel
from .stats import SpeculativeStats
from .verification import greedy_verify, rejection_sample

POLICIES = ("all", "fixed", "threshold", "scheduler")
_HOLE_SAFE_ATTENTION = ("sdpa", "eager")


@dataclass
class BatchedOutput:
    """What `batched_speculative_generate` returns.

    sequences: per request, its prompt (without padding) followed by the new tokens.
    stats: per request, one `SpeculativeStats` entry per verification round it took part in.
    verified_tokens_per_round: per round, the tokens in the target forward summed over active requests,
        sum(k_r + 1) (padding excluded): the verification batch B the scheduler prices.
    """

    sequences: list[torch.LongTensor]
    stats: list[SpeculativeStats]
    verified_tokens_per_round: list[int] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------------------------


def _check_inputs(target, drafter, input_ids, attention_mask, policy, policy_arg, max_new_tokens) -> None:
    if not isinstance(drafter, DSparkDraftModel):
        raise ValueError(
            f"Batched speculative decoding supports DSpark/DFlash drafters (DSparkDraftModel), got "
            f"{type(drafter).__name__}. Use target.generate(..., assistant_model=drafter) per prompt for Eagle3."
        )
    if target.config.is_encoder_decoder:
        raise ValueError("hf_dspark drafters serve decoder-only targets; this target is encoder-decoder.")
    implementation = target.config._attn_implementation
    if implementation not in _HOLE_SAFE_ATTENTION:
        raise ValueError(
            f"Batched speculative decoding keeps holes in the target cache, which needs an attention that takes an "
            f"arbitrary padding mask ({' or '.join(_HOLE_SAFE_ATTENTION)}); this target uses {implementation!r}. "
            f"Load it with attn_implementation='sdpa'."
        )
    if input_ids.ndim != 2 or attention_mask is None or attention_mask.shape != input_ids.shape:
        raise ValueError("input_ids and attention_mask must both have shape (batch, prompt_length).")
    mask = attention_mask.bool()
    if not bool(mask[:, -1].all()) or bool((mask[:, 1:].long() < mask[:, :-1].long()).any()):
        raise ValueError(
            "Prompts must be left-padded (attention_mask 0s then 1s, ending in a real token); tokenize with "
            "padding_side='left'."
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be non-negative, got {max_new_tokens}.")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    if policy == "fixed" and not (isinstance(policy_arg, int) and policy_arg >= 0):
        raise ValueError(f"policy 'fixed' takes the number of slots to verify (an int >= 0), got {policy_arg!r}.")
    if policy == "threshold" and not (isinstance(policy_arg, (int, float)) and 0 <= policy_arg <= 1):
        raise ValueError(f"policy 'threshold' takes a survival threshold in [0, 1], got {policy_arg!r}.")
    if policy == "scheduler" and not hasattr(policy_arg, "select_lengths"):
        raise ValueError("policy 'scheduler' takes a hf_dspark.scheduling.DSparkScheduler as policy_arg.")
    if policy in ("threshold", "scheduler") and drafter.confidence_proj is None:
        raise ValueError(
            f"policy {policy!r} needs the drafter's confidence head; this drafter has none (DFlash). "
            "Use policy 'all' or 'fixed'."
        )


def _new_target_cache(target) -> DynamicCache:
    """A cache whose layers all keep every entry: a sliding window counts cache slots, holes included, so it would
    attend to fewer real tokens than the target's own decoding does."""
    cache = DynamicCache(config=target.config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            "Batched speculative decoding does not support targets with sliding-window or other non-full attention "
            "layers (their caches drop entries by slot count, which holes would distort); decode them per prompt."
        )
    return cache


def _eos_ids(target, eos_token_id) -> set[int]:
    """Like `generate`: None falls back to the target's generation config."""
    if eos_token_id is None:
        eos_token_id = getattr(target.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        return set(eos_token_id.flatten().tolist())
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _warpers(do_sample: bool, temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """transformers' own sampling warpers, in `generate`'s order; none when greedy (argmax is unchanged)."""
    warpers = LogitsProcessorList()
    if not do_sample:
        return warpers
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def _warp(warpers: LogitsProcessorList, logits: torch.Tensor) -> torch.Tensor:
    """Apply the warpers to (..., V) float logits. They ignore the token context, so rows and slots are flattened."""
    if len(warpers) == 0:
        return logits
    flat = logits.reshape(-1, logits.shape[-1])
    return warpers(flat.new_zeros(flat.shape[0], 0, dtype=torch.long), flat).reshape(logits.shape)


# ------------------------------------------------------------------------------------------------------------------
# State of the running requests
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class _Rows:
    """Everything indexed by active row; `select` keeps a subset of rows in every tensor and cache."""

    request: torch.LongTensor  # (R,) index of the request each row serves
    anchor: torch.LongTensor  # (R,) newest emitted token: not yet in the target cache
    emitted: torch.LongTensor  # (R,) new tokens emitted so far
    target_cache: DynamicCache
    target_valid: torch.BoolTensor  # (R, W) real entries of the target cache
    target_length: torch.LongTensor  # (R,) valid entries = position of the anchor
    draft_cache: DraftContextCache
    draft_valid: torch.BoolTensor  # (R, C) real rows of the drafter's context cache
    pending: torch.Tensor  # (R, M, F) target features not yet given to the drafter
    pending_valid: torch.BoolTensor  # (R, M)
    pending_positions: torch.LongTensor  # (R, M)

    def select(self, keep: torch.LongTensor) -> None:
        for name in ("request", "anchor", "emitted", "target_valid", "target_length", "draft_valid", "pending",
                     "pending_valid", "pending_positions"):
            setattr(self, name, getattr(self, name).index_select(0, keep))
        self.target_cache.batch_select_indices(keep)
        cache = self.draft_cache
        cache.keys = [None if k is None else k.index_select(0, keep) for k in cache.keys]
        cache.values = [None if v is None else v.index_select(0, keep) for v in cache.values]

    def stage_context(self, features: torch.Tensor, valid: torch.BoolTensor, positions: torch.LongTensor) -> None:
        """Queue the target features of the entries that just became valid for the next backbone pass. Columns that
        no row uses are dropped from the end; the others are zeroed where invalid, so no stray value at a padded
        position (masked, but multiplied by a zero attention weight) can turn into NaN inside attention."""
        used = valid.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        valid = valid[:, :width]
        self.pending = torch.where(valid[..., None], features[:, :width], 0.0)
        self.pending_valid = valid
        self.pending_positions = positions[:, :width]


# ------------------------------------------------------------------------------------------------------------------
# Target and drafter passes
# ------------------------------------------------------------------------------------------------------------------


def _target_forward(target, rows: _Rows, tokens, new_valid, positions, layer_indices, keep: int):
    """Append `tokens` (R, N) to the shared cache; returns (float logits of the last `keep` entries, features)."""
    mask = torch.cat([rows.target_valid, new_valid], dim=1)
    kwargs = {"logits_to_keep": keep} if target._supports_logits_to_keep() else {}
    out = target(input_ids=tokens, attention_mask=mask.long(), position_ids=positions, cache=rows.target_cache,
                 use_cache=True, output_hidden_states=layer_indices, **kwargs)
    features = torch.cat([out.hidden_states[i] for i in layer_indices], dim=-1)
    return out.logits[:, -keep:].float(), features


@dataclass
class _Drafts:
    tokens: torch.LongTensor  # (R, G) drafted tokens, 0 past a row's length
    probs: torch.Tensor | None  # (R, G, V) processed draft distributions (sampling only), 0 past a row's length
    lengths: torch.LongTensor  # (R,) slots to verify
    confidences: torch.Tensor  # (R, G) conditional confidences c_j (0 where not computed)


def _draft(drafter: DSparkDraftModel, rows: _Rows, budget: torch.LongTensor, policy: str, policy_arg,
           warpers: LogitsProcessorList, do_sample: bool, generator: torch.Generator | None) -> _Drafts:
    """One backbone pass for all rows (consuming the queued context), then the sequential head slot by slot.

    Per row this is `DSparkCandidateGenerator._draft`: the same head step, confidence, temperature scaling and token
    choice. A row stops drafting at its budget, or (threshold policy) at the first slot whose cumulative confidence
    falls below the threshold, decided from c_1..c_j before x_j is drawn.
    """
    config = drafter.config
    num_rows, gamma = rows.anchor.shape[0], config.block_size
    device = rows.anchor.device
    block = torch.cat([rows.anchor[:, None], rows.anchor.new_full((num_rows, gamma - 1), config.mask_token_id)], 1)
    context_valid = torch.cat([rows.draft_valid, rows.pending_valid], dim=1)
    mask = torch.cat([context_valid[:, None, :].expand(-1, gamma, -1),
                      context_valid.new_ones(num_rows, gamma, gamma)], dim=-1)[:, None]
    out = drafter(input_ids=block, target_hidden_states=rows.pending,
                  position_ids=rows.target_length[:, None] + torch.arange(gamma, device=device),
                  context_position_ids=rows.pending_positions, attention_mask=mask, cache=rows.draft_cache)
    rows.draft_valid = context_valid  # the queued context is in the cache now; verification queues the next

    slots = int(budget.max()) if num_rows else 0
    tokens = rows.anchor.new_zeros(num_rows, slots)
    confidences = torch.zeros(num_rows, slots, device=device)
    probs = torch.zeros(num_rows, slots, config.vocab_size, device=device) if do_sample else None
    lengths = torch.zeros_like(budget)
    hidden, base_logits = out.last_hidden_state, out.base_logits
    head = drafter.sequential_head
    has_confidence = drafter.confidence_proj is not None
    temperatures = config.confidence_temperatures
    state = head.initial_state(num_rows, hidden) if head is not None else None
    drafting = budget > 0
    survival = torch.ones(num_rows, device=device)
    previous = rows.anchor
    for slot in range(slots):
        logits = base_logits[:, slot]
        previous_embedding = None
        if head is not None:
            mixed, previous_embedding, state = head.step(hidden[:, slot], drafter.head_rows(previous), state)
            logits = logits + head.output(mixed).to(logits.dtype)
        if has_confidence:
            logit = drafter.confidence_logit(hidden[:, slot], previous_embedding)
            if temperatures is not None:
                logit = logit / temperatures[slot]
            confidences[:, slot] = torch.sigmoid(logit.float())
            survival = survival * confidences[:, slot]
            if policy == "threshold":
                drafting = drafting & (survival >= policy_arg)
        drafting = drafting & (slot < budget)
        if not bool(drafting.any()):
            break
        processed = _warp(warpers, drafter.to_target_vocab(logits.float()))
        if do_sample:
            distribution = processed.softmax(dim=-1)
            token = torch.multinomial(distribution, 1, generator=generator).squeeze(1)
            probs[:, slot] = distribution * drafting[:, None]
        else:
            token = processed.argmax(dim=-1)
        tokens[:, slot] = torch.where(drafting, token, 0)
        lengths += drafting.long()
        previous = token

    if policy == "scheduler" and slots > 0:
        # Confidences past a row's budget were computed but are never candidates: max_lengths masks them.
        lengths = policy_arg.select_lengths(confidences[:, : int(lengths.max())], max_lengths=lengths).to(device)
    return _Drafts(tokens, probs, lengths, confidences)


def _verify(target_logits, drafts: _Drafts, warpers, do_sample, generator):
    """Apply the warpers to the target's logits (exactly once) and run the shared acceptance rule."""
    processed = _warp(warpers, target_logits)
    slots = processed.shape[1] - 1
    draft_tokens = drafts.tokens[:, :slots]
    if do_sample:
        draft_probs = drafts.probs[:, :slots] if drafts.probs is not None else processed[:, :0].softmax(-1)
        return rejection_sample(draft_tokens, draft_probs, processed.softmax(dim=-1), drafts.lengths, generator)
    return greedy_verify(draft_tokens, processed, drafts.lengths)


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def batched_speculative_generate(
    target,
    drafter: DSparkDraftModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | list[int] | None = None,
    policy: str = "all",
    policy_arg=None,
    generator: torch.Generator | None = None,
) -> BatchedOutput:
    """Lossless speculative decoding of a left-padded batch of prompts with a DSpark or DFlash drafter.

    Each request's output is distributed exactly as the target's own decoding of that prompt alone (greedy: the
    same tokens) with the given temperature / top-k / top-p, stopping at `eos_token_id` (default: the target's
    generation config) or after `max_new_tokens` new tokens.

    Args:
        target: a decoder-only causal LM with full attention on every layer (sdpa or eager).
        drafter: a `DSparkDraftModel` trained for `target` (attached here).
        input_ids, attention_mask: (R, P) left-padded prompts and their mask.
        policy: how many drafted slots each row verifies per round:
            ``"all"``: every slot the budget allows (up to the drafter's `draft_length()`);
            ``"fixed"``: `policy_arg` slots;
            ``"threshold"``: up to the first slot whose cumulative confidence c_1...c_j is below `policy_arg`;
            ``"scheduler"``: `policy_arg.select_lengths(confidences, max_lengths)` of a `DSparkScheduler`, over all
            rows together. The last two need a confidence head (DSpark, not DFlash). The drafter's own
            `confidence_threshold` / `verification_costs` attributes are not used here.
        generator: random source for drafting and acceptance (sampling only).
    """
    _check_inputs(target, drafter, input_ids, attention_mask, policy, policy_arg, max_new_tokens)
    drafter.attach_target(target)
    device = input_ids.device
    num_requests = input_ids.shape[0]
    prompt_mask = attention_mask.to(device).bool()
    sequences = [input_ids[r, prompt_mask[r]].tolist() for r in range(num_requests)]
    stats = [SpeculativeStats() for _ in range(num_requests)]
    result = BatchedOutput([], stats, [])
    if max_new_tokens == 0:
        result.sequences = [torch.tensor(s, dtype=torch.long, device=device) for s in sequences]
        return result

    eos = _eos_ids(target, eos_token_id)
    warpers = _warpers(do_sample, temperature, top_k, top_p)
    layer_indices = drafter.target_hidden_state_indices
    gamma = min(drafter.draft_length(), drafter.config.block_size)
    if policy == "fixed":
        gamma = min(gamma, policy_arg)

    rows, first_token = _prefill(target, input_ids, prompt_mask, layer_indices, warpers, do_sample, generator)
    finished = _emit(rows, sequences, first_token[:, None], torch.ones_like(first_token), eos, max_new_tokens)
    while not bool(finished.all()):
        if bool(finished.any()):
            rows.select((~finished).nonzero().squeeze(1))
        # Every round emits at least one token, so a row drafts at most (tokens left - 1).
        budget = (max_new_tokens - rows.emitted - 1).clamp(min=0, max=gamma)
        drafts = _draft(drafter, rows, budget, policy, policy_arg, warpers, do_sample, generator)
        new_tokens, num_accepted = _verify_round(target, rows, drafts, layer_indices, warpers, do_sample, generator)

        result.verified_tokens_per_round.append(int((drafts.lengths + 1).sum()))
        for row, request in enumerate(rows.request.tolist()):
            length = int(drafts.lengths[row])
            confidences = drafts.confidences[row, :length].tolist() if drafter.confidence_proj is not None else None
            stats[request].record(length, int(num_accepted[row]), confidences)
        finished = _emit(rows, sequences, new_tokens, num_accepted + 1, eos, max_new_tokens)

    result.sequences = [torch.tensor(s, dtype=torch.long, device=device) for s in sequences]
    return result


def _prefill(
    target, input_ids, prompt_mask, layer_indices, warpers, do_sample, generator
) -> tuple[_Rows, torch.LongTensor]:
    """Run the prompts through the target; return the rows' state and each request's first new token.

    Positions count real tokens only, as `generate` does for left-padded prompts. Left padding becomes the first
    holes of both caches.
    """
    num_requests, device = input_ids.shape[0], input_ids.device
    positions = (prompt_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    empty = prompt_mask[:, :0]
    rows = _Rows(
        request=torch.arange(num_requests, device=device),
        anchor=input_ids[:, -1],
        emitted=input_ids.new_zeros(num_requests),
        target_cache=_new_target_cache(target),
        target_valid=empty,
        target_length=input_ids.new_zeros(num_requests),
        draft_cache=DraftContextCache(),
        draft_valid=empty,
        pending=torch.zeros(num_requests, 0, 0, device=device),
        pending_valid=empty,
        pending_positions=positions[:, :0],
    )
    target_logits, features = _target_forward(target, rows, input_ids, prompt_mask, positions, layer_indices, keep=1)
    no_drafts = _Drafts(input_ids.new_zeros(num_requests, 0), None, input_ids.new_zeros(num_requests),
                        torch.zeros(num_requests, 0, device=device))
    _, first_token = _verify(target_logits, no_drafts, warpers, do_sample, generator)
    rows.target_valid, rows.target_length = prompt_mask, prompt_mask.long().sum(dim=1)
    rows.stage_context(features, prompt_mask, positions)
    return rows, first_token


def _verify_round(target, rows: _Rows, drafts: _Drafts, layer_indices, warpers, do_sample, generator):
    """Verify every row's anchor and drafts in one target forward, padded to the longest row; update both caches'
    bookkeeping. Returns (candidate tokens (R, N): accepted drafts then the target's token, number accepted (R,))."""
    width = int(drafts.lengths.max()) + 1
    offsets = torch.arange(width, device=rows.anchor.device)
    tokens = torch.cat([rows.anchor[:, None], drafts.tokens[:, : width - 1]], dim=1)
    new_valid = offsets[None, :] < drafts.lengths[:, None] + 1
    positions = rows.target_length[:, None] + offsets  # padded entries get the same arithmetic; they are masked
    target_logits, features = _target_forward(target, rows, tokens, new_valid, positions, layer_indices, keep=width)
    num_accepted, next_token = _verify(target_logits, drafts, warpers, do_sample, generator)

    # The newest token and the accepted drafts become valid; rejected drafts and padding stay as holes.
    kept = offsets[None, :] < num_accepted[:, None] + 1
    rows.target_valid = torch.cat([rows.target_valid, kept], dim=1)
    rows.target_length = rows.target_length + num_accepted + 1
    rows.stage_context(features, kept, positions)

    new_tokens = torch.cat([drafts.tokens[:, : width - 1], tokens.new_zeros(tokens.shape[0], 1)], dim=1)
    new_tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return new_tokens, num_accepted


def _emit(rows: _Rows, sequences: list[list[int]], new_tokens: torch.LongTensor, counts: torch.LongTensor,
          eos: set[int], max_new_tokens: int) -> torch.BoolTensor:
    """Append each row's first `counts[r]` tokens one at a time, stopping after an EOS or at `max_new_tokens`
    exactly as plain decoding would; update the anchors; return which rows finished."""
    finished = []
    anchors = []
    for row, request in enumerate(rows.request.tolist()):
        done = False
        for token in new_tokens[row, : int(counts[row])].tolist():
            sequences[request].append(token)
            rows.emitted[row] += 1
            if token in eos or int(rows.emitted[row]) >= max_new_tokens:
                done = True
                break
        finished.append(done)
        anchors.append(sequences[request][-1])
    rows.anchor = torch.tensor(anchors, dtype=torch.long, device=rows.anchor.device)
    return torch.tensor(finished, dtype=torch.bool, device=rows.anchor.device)
