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

A finished request (EOS or its `max_new_tokens`) is removed from every tensor and cache, so rounds only pay for the
requests still running, and cache columns that no remaining row uses are dropped. Holes also make **continuous
batching** cheap (`SpeculativeEngine`): a request that arrives while others run is prefilled alone (with the
other newcomers), its prompt context projected into its own drafter cache, and its rows are appended to the
running batch, each cache padded with holes to the wider of the two. Every request has its own sampling settings, EOS and length limit; rows with equal settings share one warper
pass. The verification rule is `greedy_verify` / `rejection_sample`, the same as at batch size 1.
"""

from __future__ import annotations

import itertools
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

from ..models.common import BLOCK_DRAFTER_TYPE, DraftContextCache, drafter_type
from ..models.modeling_dspark import DSparkDraftModel
from ..scheduling.scheduler import DSparkScheduler
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


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens: greedy, or sampling through transformers' own warpers in `generate`'s
    order (temperature, top-k, top-p). Hashable, so rows with equal settings are warped together."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be positive when sampling, got {self.temperature}.")
        check_top_p(self.top_p)
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be a non-negative int (0 disables it), got {self.top_k!r}.")

    def warpers(self) -> LogitsProcessorList:
        """Empty when greedy: argmax is unchanged by them."""
        warpers = LogitsProcessorList()
        if not self.do_sample:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


# ------------------------------------------------------------------------------------------------------------------
# Checks and settings
# ------------------------------------------------------------------------------------------------------------------


def check_top_p(top_p: float) -> None:
    """One rule for top_p at every batch size (stock `generate` reads top_p=0 as top-1 at batch 1 only)."""
    if not 0 < top_p <= 1:
        raise ValueError(
            f"top_p must be in (0, 1] (1 = off), got {top_p}; for the single most likely token use greedy "
            "decoding (do_sample=False) or top_k=1."
        )


def check_sampling_processors(logits_processor) -> None:
    """What `generate` built from its options, held to the rules the batched engine applies (`check_top_p`), so
    one prompt and a batch accept and refuse the same settings."""
    for processor in logits_processor or ():
        if isinstance(processor, TopPLogitsWarper):
            check_top_p(float(processor.top_p))


def _check_engine(target, drafter, policy, policy_arg) -> None:
    if drafter_type(drafter) != BLOCK_DRAFTER_TYPE:
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
    _new_target_cache(target)  # refuses sliding-window targets before any work
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    if policy == "fixed" and not (isinstance(policy_arg, int) and policy_arg >= 0):
        raise ValueError(f"policy 'fixed' takes the number of slots to verify (an int >= 0), got {policy_arg!r}.")
    if policy == "threshold" and not (isinstance(policy_arg, (int, float)) and policy_arg >= 0):
        raise ValueError(
            f"policy 'threshold' takes a survival threshold >= 0 (above 1 verifies no drafts), got {policy_arg!r}."
        )
    if policy == "scheduler" and not hasattr(policy_arg, "select_lengths"):
        raise ValueError("policy 'scheduler' takes a hf_dspark.scheduling.DSparkScheduler as policy_arg.")
    if policy in ("threshold", "scheduler") and drafter.confidence_proj is None:
        raise ValueError(
            f"policy {policy!r} needs the drafter's confidence head; this drafter has none (DFlash). "
            "Use policy 'all' or 'fixed'."
        )


def check_left_padded(input_ids, attention_mask) -> None:
    """Holes replace padding only at the front of a row: a pad after a real token would be read as context."""
    if input_ids.ndim != 2 or attention_mask is None or attention_mask.shape != input_ids.shape:
        raise ValueError("input_ids and attention_mask must both have shape (batch, prompt_length).")
    mask = attention_mask.bool()
    if not bool(mask[:, -1].all()) or bool((mask[:, 1:].long() < mask[:, :-1].long()).any()):
        raise ValueError(
            "Prompts must be left-padded (attention_mask 0s then 1s, ending in a real token); tokenize with "
            "padding_side='left'."
        )


def resolve_verification_policy(drafter) -> tuple[str, object]:
    """The batched engine's `(policy, policy_arg)` for `drafter`, read from `drafter.verification_policy`.

    `None` (the default) derives it from the attributes the batch-1 path uses, so one drafter behaves alike at
    every batch size: a `DSparkScheduler(drafter.verification_costs)` when a cost table is set and the drafter has
    a confidence head, else `("threshold", drafter.confidence_threshold)` when a threshold is set (confidence head
    again), else `"all"`. Otherwise it may be a policy name (`"all"`), a `(policy, policy_arg)` pair such as
    `("fixed", 2)` or `("threshold", 0.4)`, or a scheduler object (anything with `select_lengths`).
    """
    policy = getattr(drafter, "verification_policy", None)
    if policy is None:
        has_confidence = getattr(drafter, "confidence_proj", None) is not None
        if has_confidence and getattr(drafter, "verification_costs", None) is not None:
            return "scheduler", DSparkScheduler(drafter.verification_costs)
        if has_confidence and getattr(drafter, "confidence_threshold", None) is not None:
            return "threshold", drafter.confidence_threshold
        return "all", None
    if isinstance(policy, str):
        return policy, None
    if hasattr(policy, "select_lengths"):
        return "scheduler", policy
    if isinstance(policy, (tuple, list)) and len(policy) == 2:
        return policy[0], policy[1]
    raise ValueError(
        f"drafter.verification_policy must be None, a policy name, a (policy, policy_arg) pair or a scheduler; "
        f"got {policy!r}."
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


def _warp(warpers: LogitsProcessorList, logits: torch.Tensor) -> torch.Tensor:
    """Apply the warpers to (..., V) float logits. They ignore the token context, so rows and slots are flattened."""
    if len(warpers) == 0:
        return logits
    flat = logits.reshape(-1, logits.shape[-1])
    return warpers(flat.new_zeros(flat.shape[0], 0, dtype=torch.long), flat).reshape(logits.shape)


class _RowSampling:
    """The sampling settings of the current rows, grouped so that rows with equal settings share one warper pass.
    Greedy rows take the argmax and `greedy_verify`; sampled rows draw and go through `rejection_sample`."""

    def __init__(self, settings: list[SamplingParams], device: torch.device):
        by_setting: dict[SamplingParams, list[int]] = {}
        for row, setting in enumerate(settings):
            by_setting.setdefault(setting, []).append(row)
        whole = len(by_setting) == 1
        self.groups = [(setting.warpers(), None if whole else torch.tensor(rows, device=device))
                       for setting, rows in by_setting.items()]
        self.sampled = torch.tensor([s.do_sample for s in settings], dtype=torch.bool, device=device)
        self.all_sampled = bool(self.sampled.all())
        self.any_sampled = bool(self.sampled.any())
        self._sampled_rows = self.sampled.nonzero().squeeze(1)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """(R, ..., V) logits, each row through its own warpers (applied exactly once)."""
        if len(self.groups) == 1:
            return _warp(self.groups[0][0], logits)
        out = logits.clone()
        for warpers, rows in self.groups:
            out[rows] = _warp(warpers, logits[rows])
        return out

    def choose(self, processed: torch.Tensor, generator) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """(R, V) processed logits -> (token per row, the distribution sampled rows drew from (0 for greedy rows),
        or None when no row samples)."""
        if self.all_sampled:
            distribution = processed.softmax(dim=-1)
            return torch.multinomial(distribution, 1, generator=generator).squeeze(1), distribution
        token = processed.argmax(dim=-1)
        if not self.any_sampled:
            return token, None
        rows = self._sampled_rows
        sampled = processed[rows].softmax(dim=-1)
        token[rows] = torch.multinomial(sampled, 1, generator=generator).squeeze(1)
        distribution = torch.zeros_like(processed)
        distribution[rows] = sampled
        return token, distribution

    def verify(self, target_logits: torch.Tensor, drafts: "_Drafts", generator):
        """Warp the target's logits and run the shared acceptance rule -> (number accepted (R,), next token (R,))."""
        processed = self.warp(target_logits)
        slots = processed.shape[1] - 1
        draft_tokens = drafts.tokens[:, :slots]
        if not self.any_sampled:
            return greedy_verify(draft_tokens, processed, drafts.lengths)
        draft_probs = drafts.probs[:, :slots] if drafts.probs is not None else processed[:, :0].softmax(-1)
        if self.all_sampled:
            return rejection_sample(draft_tokens, draft_probs, processed.softmax(dim=-1), drafts.lengths, generator)
        num_accepted, next_token = greedy_verify(draft_tokens, processed, drafts.lengths)
        rows = self._sampled_rows
        accepted, token = rejection_sample(draft_tokens[rows], draft_probs[rows], processed[rows].softmax(dim=-1),
                                           drafts.lengths[rows], generator)
        num_accepted[rows], next_token[rows] = accepted, token
        return num_accepted, next_token


@dataclass
class _EngineSnapshot:
    """`SpeculativeEngine` state before a step (see `SpeculativeEngine._snapshot`)."""

    waiting: list[int]
    rows: "_Rows | None"
    row_fields: dict
    target_layers: list[dict]
    draft_layers: tuple[list, list]
    requests: dict[int, tuple[int, int, int]]  # request id -> (tokens, emitted, rounds recorded)
    rounds: int


@dataclass
class _Request:
    """One request's settings and output so far."""

    tokens: list[int]  # prompt, then the new tokens
    max_new_tokens: int
    sampling: SamplingParams
    eos: set[int]
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    emitted: int = 0


# ------------------------------------------------------------------------------------------------------------------
# State of the running requests
# ------------------------------------------------------------------------------------------------------------------


def _pad_to(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Pad `tensor` with zeros (False) at the end of `dim` up to `width` entries: holes."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def _cat_rows(first: torch.Tensor, second: torch.Tensor, dim: int) -> torch.Tensor:
    """Stack two row blocks along dim 0, padding the narrower one with holes along `dim`."""
    width = max(first.shape[dim], second.shape[dim])
    return torch.cat([_pad_to(first, width, dim), _pad_to(second, width, dim)], dim=0)


def _used_columns(valid: torch.BoolTensor) -> torch.LongTensor | None:
    """Indices of the columns some row uses, or None when every column is used."""
    used = valid.any(dim=0)
    return None if bool(used.all()) else used.nonzero().squeeze(1)


def _layer(tensors: list, index: int):
    return tensors[index] if index < len(tensors) else None


def _merge_draft_layer(blocks: list, counts: tuple[int, int]) -> torch.Tensor | None:
    """One drafter-cache layer of two row blocks. A block that has not drafted yet (just prefilled) has no context
    rows there: it joins with zero columns, so every column is a hole for it."""
    reference = next((b for b in blocks if b is not None), None)
    if reference is None:
        return None
    empty = [reference.new_zeros(count, reference.shape[1], 0, reference.shape[3]) for count in counts]
    first, second = (b if b is not None else e for b, e in zip(blocks, empty))
    return _cat_rows(first, second, dim=2)


@dataclass
class _Rows:
    """Everything indexed by active row; `select` keeps a subset of rows, `merge` appends another block of rows."""

    request: torch.LongTensor  # (R,) id of the request each row serves
    anchor: torch.LongTensor  # (R,) newest emitted token: not yet in the target cache
    emitted: torch.LongTensor  # (R,) new tokens emitted so far
    limit: torch.LongTensor  # (R,) the request's max_new_tokens
    target_cache: DynamicCache
    target_valid: torch.BoolTensor  # (R, W) real entries of the target cache
    target_length: torch.LongTensor  # (R,) valid entries = position of the anchor
    draft_cache: DraftContextCache
    draft_valid: torch.BoolTensor  # (R, C) real rows of the drafter's context cache
    pending: torch.Tensor  # (R, M, F) target features not yet given to the drafter
    pending_valid: torch.BoolTensor  # (R, M)
    pending_positions: torch.LongTensor  # (R, M)

    _PER_ROW = ("request", "anchor", "emitted", "limit", "target_valid", "target_length", "draft_valid", "pending",
                "pending_valid", "pending_positions")

    def __len__(self) -> int:
        return self.request.shape[0]

    def select(self, keep: torch.LongTensor) -> None:
        for name in self._PER_ROW:
            setattr(self, name, getattr(self, name).index_select(0, keep))
        self.target_cache.batch_select_indices(keep)
        cache = self.draft_cache
        cache.keys = [None if k is None else k.index_select(0, keep) for k in cache.keys]
        cache.values = [None if v is None else v.index_select(0, keep) for v in cache.values]
        self._drop_unused_columns()

    def _drop_unused_columns(self) -> None:
        """Remove cache and queued-context columns that are holes in every remaining row (e.g. a retired long
        prompt), so a continuously fed batch does not keep the widths of requests long gone."""
        columns = _used_columns(self.target_valid)
        if columns is not None:
            self.target_valid = self.target_valid[:, columns]
            for layer in self.target_cache.layers:
                layer.keys, layer.values = layer.keys[:, :, columns], layer.values[:, :, columns]
        columns = _used_columns(self.draft_valid)
        if columns is not None:
            self.draft_valid = self.draft_valid[:, columns]
            cache = self.draft_cache
            cache.keys = [None if k is None else k[:, :, columns] for k in cache.keys]
            cache.values = [None if v is None else v[:, :, columns] for v in cache.values]
        columns = _used_columns(self.pending_valid)
        if columns is not None:
            self.pending, self.pending_valid = self.pending[:, columns], self.pending_valid[:, columns]
            self.pending_positions = self.pending_positions[:, columns]

    def merge(self, other: "_Rows") -> None:
        """Append `other`'s rows. Each column family (target cache, drafter cache, queued context) is padded with
        holes at the end to the wider of the two blocks; a row's entries keep their order, which is all the causal
        masks and the explicit positions need."""
        counts = (len(self), len(other))
        for name in ("request", "anchor", "emitted", "limit", "target_length"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        for name in ("target_valid", "draft_valid", "pending_valid", "pending_positions", "pending"):
            setattr(self, name, _cat_rows(getattr(self, name), getattr(other, name), dim=1))
        for mine, theirs in zip(self.target_cache.layers, other.target_cache.layers):
            mine.keys = _cat_rows(mine.keys, theirs.keys, dim=2)
            mine.values = _cat_rows(mine.values, theirs.values, dim=2)
        caches = (self.draft_cache, other.draft_cache)
        layers = max(len(cache.keys) for cache in caches)
        self.draft_cache.keys = [_merge_draft_layer([_layer(c.keys, i) for c in caches], counts) for i in range(layers)]
        self.draft_cache.values = [_merge_draft_layer([_layer(c.values, i) for c in caches], counts)
                                   for i in range(layers)]

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
    probs: torch.Tensor | None  # (R, G, V) processed draft distributions of sampled rows, 0 past a row's length
    lengths: torch.LongTensor  # (R,) slots to verify
    confidences: torch.Tensor  # (R, G) conditional confidences c_j (0 where not computed)


def _draft(drafter: DSparkDraftModel, rows: _Rows, budget: torch.LongTensor, policy: str, policy_arg,
           sampling: _RowSampling, generator: torch.Generator | None) -> _Drafts:
    """One backbone pass for all rows (consuming the queued context), then the sequential head slot by slot.

    Per row this is `DSparkCandidateGenerator._draft` (both call `DSparkDraftModel.draft_slot`) with the same token
    choice. A row stops drafting at its budget, or (threshold policy) at the first slot whose cumulative confidence
    (or, under the drafter's `"per_slot"` rule, its own confidence) falls below the threshold, decided from c_1..c_j
    before x_j is drawn.
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
    probs = torch.zeros(num_rows, slots, config.vocab_size, device=device) if sampling.any_sampled else None
    lengths = torch.zeros_like(budget)
    hidden, base_logits = out.last_hidden_state, out.base_logits
    head = drafter.sequential_head
    state = head.initial_state(num_rows, hidden) if head is not None else None
    drafting = budget > 0
    survival = torch.ones(num_rows, device=device)
    previous = rows.anchor
    for slot in range(slots):
        logits, confidence, state = drafter.draft_slot(hidden[:, slot], base_logits[:, slot], previous, state, slot)
        if confidence is not None:
            confidences[:, slot] = confidence
            survival = survival * confidence
            if policy == "threshold":  # the drafter's rule: survival c_1...c_j, or c_j alone ("per_slot")
                compared = confidence if drafter.confidence_threshold_rule == "per_slot" else survival
                drafting = drafting & (compared >= policy_arg)
        drafting = drafting & (slot < budget)
        if not bool(drafting.any()):
            break
        processed = sampling.warp(drafter.to_target_vocab(logits.float()))
        token, distribution = sampling.choose(processed, generator)
        if distribution is not None:
            probs[:, slot] = distribution * drafting[:, None]
        tokens[:, slot] = torch.where(drafting, token, 0)
        lengths += drafting.long()
        previous = token

    if policy == "scheduler" and slots > 0:
        # Confidences past a row's budget were computed but are never candidates: max_lengths masks them.
        lengths = policy_arg.select_lengths(confidences[:, : int(lengths.max())], max_lengths=lengths).to(device)
    return _Drafts(tokens, probs, lengths, confidences)


def _no_drafts(num_rows: int, device) -> _Drafts:
    return _Drafts(torch.zeros(num_rows, 0, dtype=torch.long, device=device), None,
                   torch.zeros(num_rows, dtype=torch.long, device=device), torch.zeros(num_rows, 0, device=device))


def _project_context(drafter: DSparkDraftModel, rows: _Rows) -> None:
    """Move the queued context into the drafter's cache now, with a one-slot pass whose output is discarded.

    A context row's keys and values depend only on its target features and position, not on the block, so this
    is what the next round would compute. Newcomers do it before joining: their prompt context then shares the
    running rows' cache columns (the merged width is the larger of the two) instead of being appended after them.
    """
    if rows.pending.shape[1] == 0:
        return
    block = rows.anchor.new_full((len(rows), 1), drafter.config.mask_token_id)
    drafter(input_ids=block, target_hidden_states=rows.pending, position_ids=rows.target_length[:, None],
            context_position_ids=rows.pending_positions, cache=rows.draft_cache)
    rows.draft_valid = torch.cat([rows.draft_valid, rows.pending_valid], dim=1)
    rows.pending, rows.pending_valid = rows.pending[:, :0], rows.pending_valid[:, :0]
    rows.pending_positions = rows.pending_positions[:, :0]


def _prefill(target, input_ids, prompt_mask, request_ids, limits, layer_indices, sampling: _RowSampling,
             generator) -> tuple[_Rows, torch.LongTensor]:
    """Run left-padded prompts through the target; return their rows' state and each request's first new token.

    Positions count real tokens only, as `generate` does for left-padded prompts. Left padding becomes the first
    holes of both caches.
    """
    num_requests, device = input_ids.shape[0], input_ids.device
    positions = (prompt_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    empty = prompt_mask[:, :0]
    rows = _Rows(
        request=torch.tensor(request_ids, dtype=torch.long, device=device),
        anchor=input_ids[:, -1],
        emitted=input_ids.new_zeros(num_requests),
        limit=torch.tensor(limits, dtype=torch.long, device=device),
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
    _, first_token = sampling.verify(target_logits, _no_drafts(num_requests, device), generator)
    rows.target_valid, rows.target_length = prompt_mask, prompt_mask.long().sum(dim=1)
    rows.stage_context(features, prompt_mask, positions)
    return rows, first_token


def _verify_round(target, rows: _Rows, drafts: _Drafts, layer_indices, sampling: _RowSampling, generator):
    """Verify every row's anchor and drafts in one target forward, padded to the longest row; update both caches'
    bookkeeping. Returns (candidate tokens (R, N): accepted drafts then the target's token, number accepted (R,))."""
    width = int(drafts.lengths.max()) + 1
    offsets = torch.arange(width, device=rows.anchor.device)
    tokens = torch.cat([rows.anchor[:, None], drafts.tokens[:, : width - 1]], dim=1)
    new_valid = offsets[None, :] < drafts.lengths[:, None] + 1
    positions = rows.target_length[:, None] + offsets  # padded entries get the same arithmetic; they are masked
    target_logits, features = _target_forward(target, rows, tokens, new_valid, positions, layer_indices, keep=width)
    num_accepted, next_token = sampling.verify(target_logits, drafts, generator)

    # The newest token and the accepted drafts become valid; rejected drafts and padding stay as holes, except
    # the trailing columns that no row kept: cropping those is a free slice and bounds the cache's growth.
    used = int(num_accepted.max()) + 1
    if used < width:
        rows.target_cache.crop(-(width - used))
    kept = offsets[None, :used] < num_accepted[:, None] + 1
    rows.target_valid = torch.cat([rows.target_valid, kept], dim=1)
    rows.target_length = rows.target_length + num_accepted + 1
    rows.stage_context(features, kept, positions)

    new_tokens = torch.cat([drafts.tokens[:, : width - 1], tokens.new_zeros(tokens.shape[0], 1)], dim=1)
    new_tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return new_tokens, num_accepted


def _emit(rows: _Rows, requests: dict[int, _Request], new_tokens: torch.LongTensor,
          counts: torch.LongTensor) -> torch.BoolTensor:
    """Append each row's first `counts[r]` tokens one at a time, stopping after an EOS or at `max_new_tokens`
    exactly as plain decoding would; update the anchors; return which rows finished."""
    finished, anchors, emitted = [], [], []
    for row, request_id in enumerate(rows.request.tolist()):
        request = requests[request_id]
        done = False
        for token in new_tokens[row, : int(counts[row])].tolist():
            request.tokens.append(token)
            request.emitted += 1
            if token in request.eos or request.emitted >= request.max_new_tokens:
                done = True
                break
        finished.append(done)
        anchors.append(request.tokens[-1])
        emitted.append(request.emitted)
    device = rows.anchor.device
    rows.anchor = torch.tensor(anchors, dtype=torch.long, device=device)
    rows.emitted = torch.tensor(emitted, dtype=torch.long, device=device)
    return torch.tensor(finished, dtype=torch.bool, device=device)


# ------------------------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------------------------


class SpeculativeEngine:
    """Continuous batching: requests join and leave a running batch between verification rounds.

    ```python
    engine = SpeculativeEngine(target, drafter)
    first = engine.submit(prompt_ids, max_new_tokens=64)
    engine.step()                                   # one round for every running request
    second = engine.submit(other_ids, max_new_tokens=32, do_sample=True, temperature=0.7)
    outputs = engine.run_until_done()               # {request_id: prompt + new tokens}
    ```

    A submitted request waits until the next `step()`, which first prefills every waiting prompt together (one
    left-padded target forward) and appends their rows to the running batch, then runs one draft-verify round for
    all rows. Each request's output is distributed exactly as the target's own decoding of its prompt alone with
    its own settings (greedy: the same tokens), whatever else shares the batch and whenever it joined.

    Args:
        target: a decoder-only causal LM with full attention on every layer (sdpa or eager).
        drafter: a `DSparkDraftModel` trained for `target` (attached here).
        policy, policy_arg: how many drafted slots each row verifies per round, as in
            `batched_speculative_generate`. `None` takes the drafter's own `verification_policy`
            (`resolve_verification_policy`). A stateful scheduler is `reset()` whenever the batch starts empty.
        generator: random source for drafting and acceptance (sampled requests only).

    Attributes:
        stats: per request id, its `SpeculativeStats` (one entry per round it took part in).
        verified_tokens_per_round: per round, sum over running requests of k_r + 1 (the verification batch B).
    """

    def __init__(self, target, drafter: DSparkDraftModel, policy: str | None = None, policy_arg=None, *,
                 generator: torch.Generator | None = None):
        if policy is None and drafter_type(drafter) == BLOCK_DRAFTER_TYPE:
            policy, policy_arg = resolve_verification_policy(drafter)
        _check_engine(target, drafter, policy, policy_arg)
        drafter.attach_target(target)
        self.target, self.drafter = target, drafter
        self.policy, self.policy_arg = policy, policy_arg
        self.generator = generator
        self.device = target.device
        self.gamma = min(drafter.draft_length(), drafter.config.block_size)
        if policy == "fixed":
            self.gamma = min(self.gamma, policy_arg)
        self.stats: dict[int, SpeculativeStats] = {}
        self.verified_tokens_per_round: list[int] = []
        self._requests: dict[int, _Request] = {}
        self._waiting: list[int] = []
        self._rows: _Rows | None = None
        self._ids = itertools.count()
        self._reset_policy()

    # -- public ---------------------------------------------------------------------------------------------------

    def submit(self, input_ids: torch.LongTensor, max_new_tokens: int, *, do_sample: bool = False,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               eos_token_id: int | list[int] | None = None) -> int:
        """Queue one prompt (1D token ids, no padding) and return its request id. It joins at the next `step()`.
        `eos_token_id` None falls back to the target's generation config, like `generate`.

        Everything is checked here, before the request can share a round with others: integer token ids (a
        float tensor is refused, not truncated), one non-empty 1D prompt, every id inside the target's vocabulary,
        and the sampling settings. A refused request leaves the engine unchanged."""
        input_ids = torch.as_tensor(input_ids)
        if input_ids.ndim == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.ndim != 1 or input_ids.numel() == 0:
            raise ValueError(
                f"submit takes one non-empty prompt of shape (length,), got shape {tuple(input_ids.shape)}."
            )
        if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
            raise ValueError(
                f"submit takes integer token ids, got dtype {input_ids.dtype}; pass the tokenizer's ids as a "
                "LongTensor (e.g. tokenizer(text, return_tensors='pt').input_ids[0])."
            )
        vocab_size = self.target.get_input_embeddings().weight.shape[0]
        outside = ((input_ids < 0) | (input_ids >= vocab_size)).nonzero()
        if outside.numel():
            position = int(outside[0, 0])
            raise ValueError(
                f"token id {int(input_ids[position])} at position {position} is outside the target's vocabulary "
                f"(ids 0..{vocab_size - 1}); tokenize the prompt with the target's own tokenizer."
            )
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}.")
        sampling = SamplingParams(bool(do_sample), float(temperature), float(top_p), int(top_k or 0))
        request_id = next(self._ids)
        self._requests[request_id] = _Request(input_ids.tolist(), max_new_tokens, sampling,
                                              _eos_ids(self.target, eos_token_id))
        self.stats[request_id] = self._requests[request_id].stats
        self._waiting.append(request_id)
        return request_id

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return 0 if self._rows is None else len(self._rows)

    @torch.no_grad()
    def step(self) -> dict[int, torch.LongTensor]:
        """Admit the waiting requests, then run one round for every running request. Returns the requests that
        finished during this step (id -> prompt followed by its new tokens); each output is returned once.

        A step that raises (out of memory, an interrupt, a request that breaks the model) leaves the engine as it
        was before the step: waiting requests still wait, running ones keep their caches and tokens. Fix the
        cause, or `cancel()` the offending request, and step again; every other request's output is unchanged.
        (A stateful scheduler may have seen the failed round's confidences: that changes draft lengths only.)"""
        snapshot = self._snapshot()
        try:
            finished = self._admit_waiting()
            if self.num_running:
                finished += self._round()
        except BaseException as error:
            self._restore(snapshot)
            if hasattr(error, "add_note"):
                error.add_note(
                    f"SpeculativeEngine: the step that raised this ({len(snapshot.waiting)} waiting requests "
                    f"{snapshot.waiting[:8]}, {self.num_running} running) was undone; the engine is as before it. "
                    "Fix the cause or cancel(request_id) the offending request, then step again."
                )
            raise
        return {request_id: self._pop_output(request_id) for request_id in finished}

    def cancel(self, request_id: int) -> torch.LongTensor:
        """Drop a waiting or running request; returns its tokens so far (prompt followed by any new tokens).
        The other requests are unaffected."""
        if request_id not in self._requests:
            raise KeyError(f"no request {request_id} is waiting or running (finished ones were already returned).")
        if request_id in self._waiting:
            self._waiting.remove(request_id)
        elif self._rows is not None:
            keep = (self._rows.request != request_id).nonzero().squeeze(1)
            if keep.numel() == 0:
                self._rows = None
            elif keep.numel() < len(self._rows):
                self._rows.select(keep)
        return self._pop_output(request_id)

    def run_until_done(self) -> dict[int, torch.LongTensor]:
        """Step until no request is waiting or running; returns the outputs of the requests that finished during
        this call (those returned by earlier `step()` calls are not repeated)."""
        outputs: dict[int, torch.LongTensor] = {}
        while self._waiting or self.num_running:
            outputs.update(self.step())
        return outputs

    # -- internals ------------------------------------------------------------------------------------------------

    def _snapshot(self) -> "_EngineSnapshot":
        """What a step may change, by reference: every cache update and row edit replaces tensors (none is written
        in place), so keeping the old references is enough to undo a step."""
        rows = self._rows
        requests = {r: (len(q.tokens), q.emitted, q.stats.num_rounds) for r, q in self._requests.items()}
        if rows is None:
            return _EngineSnapshot(list(self._waiting), None, {}, [], ([], []), requests,
                                   len(self.verified_tokens_per_round))
        return _EngineSnapshot(
            list(self._waiting), rows, dict(vars(rows)), [dict(vars(layer)) for layer in rows.target_cache.layers],
            (list(rows.draft_cache.keys), list(rows.draft_cache.values)), requests,
            len(self.verified_tokens_per_round))

    def _restore(self, snapshot: "_EngineSnapshot") -> None:
        self._waiting = snapshot.waiting
        self._rows = rows = snapshot.rows
        if rows is not None:
            vars(rows).clear()
            vars(rows).update(snapshot.row_fields)
            for layer, fields in zip(rows.target_cache.layers, snapshot.target_layers):
                vars(layer).clear()
                vars(layer).update(fields)
            rows.draft_cache.keys, rows.draft_cache.values = (list(k) for k in snapshot.draft_layers)
        for request_id, (length, emitted, rounds) in snapshot.requests.items():
            request = self._requests[request_id]
            del request.tokens[length:]
            request.emitted = emitted
            for per_round in vars(request.stats).values():  # draft_lengths, accepted, confidences, ...
                if isinstance(per_round, list):
                    del per_round[rounds:]
        del self.verified_tokens_per_round[snapshot.rounds:]

    def _reset_policy(self) -> None:
        if hasattr(self.policy_arg, "reset"):
            self.policy_arg.reset()

    def _row_sampling(self, request_ids: list[int]) -> _RowSampling:
        return _RowSampling([self._requests[r].sampling for r in request_ids], self.device)

    def _pop_output(self, request_id: int) -> torch.LongTensor:
        request = self._requests.pop(request_id)
        return torch.tensor(request.tokens, dtype=torch.long, device=self.device)

    def _admit_waiting(self) -> list[int]:
        """Prefill the waiting prompts together and append their rows to the batch; returns those already done
        (no new tokens asked, or the first token ends them)."""
        waiting, self._waiting = self._waiting, []
        finished = [r for r in waiting if self._requests[r].max_new_tokens == 0]
        starting = [r for r in waiting if self._requests[r].max_new_tokens > 0]
        if not starting:
            return finished
        prompts = [self._requests[r].tokens for r in starting]
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = True
        rows, first_token = _prefill(
            self.target, input_ids, mask, starting, [self._requests[r].max_new_tokens for r in starting],
            self.drafter.target_hidden_state_indices, self._row_sampling(starting), self.generator,
        )
        done = _emit(rows, self._requests, first_token[:, None], torch.ones_like(first_token))
        finished += [r for r, d in zip(starting, done.tolist()) if d]
        if bool(done.all()):
            return finished
        if bool(done.any()):
            rows.select((~done).nonzero().squeeze(1))
        if self.num_running:
            _project_context(self.drafter, rows)
            self._rows.merge(rows)
        else:
            self._rows = rows
            self._reset_policy()  # a new batch: a stateful scheduler starts from its fallback
        return finished

    def _round(self) -> list[int]:
        """One draft-verify round for every running row; retires and returns the requests it finished."""
        rows = self._rows
        request_ids = rows.request.tolist()
        sampling = self._row_sampling(request_ids)
        # Every round emits at least one token, so a row drafts at most (tokens left - 1).
        budget = (rows.limit - rows.emitted - 1).clamp(min=0, max=self.gamma)
        if self.policy == "scheduler" and not self.policy_arg.needs_drafts():
            _project_context(self.drafter, rows)  # keep the drafter's context current; nothing is drafted
            drafts = _no_drafts(len(rows), rows.anchor.device)
        else:
            drafts = _draft(self.drafter, rows, budget, self.policy, self.policy_arg, sampling, self.generator)
        new_tokens, num_accepted = _verify_round(self.target, rows, drafts, self.drafter.target_hidden_state_indices,
                                                 sampling, self.generator)

        self.verified_tokens_per_round.append(int((drafts.lengths + 1).sum()))
        has_confidence = self.drafter.confidence_proj is not None
        for row, request_id in enumerate(request_ids):
            length = int(drafts.lengths[row])
            confidences = drafts.confidences[row, :length].tolist() if has_confidence else None
            self._requests[request_id].stats.record(length, int(num_accepted[row]), confidences)
        done = _emit(rows, self._requests, new_tokens, num_accepted + 1)
        finished = [r for r, d in zip(request_ids, done.tolist()) if d]
        if bool(done.all()):
            self._rows = None
        elif finished:
            rows.select((~done).nonzero().squeeze(1))
        return finished


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
    generation config) or after `max_new_tokens` new tokens. All prompts start together; `SpeculativeEngine` runs
    the same rounds for requests that arrive over time.

    Args:
        target: a decoder-only causal LM with full attention on every layer (sdpa or eager).
        drafter: a `DSparkDraftModel` trained for `target` (attached here).
        input_ids, attention_mask: (R, P) left-padded prompts and their mask.
        policy: how many drafted slots each row verifies per round:
            ``"all"``: every slot the budget allows (up to the drafter's `draft_length()`);
            ``"fixed"``: `policy_arg` slots;
            ``"threshold"``: up to the first slot whose cumulative confidence c_1...c_j is below `policy_arg` (its
            own c_j with `drafter.confidence_threshold_rule = "per_slot"`, DeepSpec's meaning);
            ``"scheduler"``: `policy_arg.select_lengths(confidences, max_lengths)` of a `DSparkScheduler`, over all
            rows together (its `reset()` is called first). The last two need a confidence head (DSpark, not
            DFlash). The drafter's own `verification_policy` is not used here (`generate` uses it).
        generator: random source for drafting and acceptance (sampling only).
    """
    engine = SpeculativeEngine(target, drafter, policy, policy_arg, generator=generator)
    check_left_padded(input_ids, attention_mask)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be non-negative, got {max_new_tokens}.")
    prompt_mask = attention_mask.bool()
    sampling = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k)
    eos = sorted(_eos_ids(target, eos_token_id))
    request_ids = [engine.submit(input_ids[r, prompt_mask[r]], max_new_tokens, eos_token_id=eos, **sampling)
                   for r in range(input_ids.shape[0])]
    outputs = engine.run_until_done()
    return BatchedOutput(
        sequences=[outputs[r].to(input_ids.device) for r in request_ids],
        stats=[engine.stats[r] for r in request_ids],
        verified_tokens_per_round=engine.verified_tokens_per_round,
    )
