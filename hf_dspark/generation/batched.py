"""Batched speculative decoding: R requests drafted and verified together by a DSpark or DFlash drafter.

The rows' state (both caches with holes, explicit positions) is `batch_state.BatchRows`; the token choice per row
is `sampling.RowSampling`; drafting is the one core of every batch size (`drafting.draft_block`) and the draft
length the one rule (`DraftLengthRule`), as in the batch-1 loop.

* Target: one `DynamicCache` of width W for all rows and a (R, W) validity mask, passed as the 2D attention mask
  (transformers builds the causal 4D mask from it; the causal order is the cache order, which is each row's order).
* Drafter: one `DraftContextCache` and a (R, C) validity mask over its context rows. Each round appends, per row,
  the target features of the entries that became valid (the context strictly before the next anchor), then runs
  the backbone on `[anchor, MASK x (gamma-1)]` with a boolean mask allowing valid context and the whole block, and
  the sequential head slot by slot, vectorised over rows.

A round reads the device twice, whatever R: the verified lengths (with their confidences, for the statistics),
which fix the verification forward's width, and the accepted counts with the emitted tokens, from which each
request's EOS and length limit are found on the host (every row at once) and its output is extended. A round in
which requests finish reads once more (which cache columns are still used), and a `DSparkScheduler` in
`"two_steps_ago"` mode once more to decide whether the round drafts at all: four at most.

A finished request (EOS or its `max_new_tokens`) is removed from every tensor and cache, so rounds only pay for the
requests still running. Holes also make **continuous batching** cheap (`SpeculativeEngine`): a request that
arrives while others run is prefilled alone (with the other newcomers), its prompt context projected into its own
drafter cache, and its rows are appended to the running batch, each cache padded with holes to the wider of the
two; cache columns that no remaining row uses are dropped then. Every request has its own sampling settings, EOS
and length limit; rows with equal settings share one warper pass. The verification rule is `greedy_verify` /
`rejection_sample`, the same as at batch size 1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..models.common import BLOCK_DRAFTER_TYPE, DraftContextCache, drafter_type
from ..models.modeling_dspark import DSparkDraftModel
from ..scheduling.draft_length import DraftLengthRule, resolve_verification_policy
from .batch_state import BatchRows, to_device
from .drafting import Drafts, draft_block, verify_drafts
from .sampling import RowSampling, SamplingParams
from .stats import SpeculativeStats

# Re-exported: the batch-1 loop and users import them from here.
__all__ = ["BatchedOutput", "SamplingParams", "SpeculativeEngine", "batched_speculative_generate",
           "check_left_padded", "resolve_verification_policy"]
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
# Checks and settings
# ------------------------------------------------------------------------------------------------------------------


def _check_engine(target, drafter, policy, policy_arg) -> DraftLengthRule:
    """Refuse what the engine cannot run, before any work; returns the draft-length rule of the policy."""
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
    rule = DraftLengthRule(policy, policy_arg, drafter.confidence_threshold_rule)  # refuses a malformed policy
    if policy in ("threshold", "scheduler") and drafter.confidence_proj is None:
        raise ValueError(
            f"policy {policy!r} needs the drafter's confidence head; this drafter has none (DFlash). "
            "Use policy 'all' or 'fixed'."
        )
    return rule


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


@dataclass
class _EngineSnapshot:
    """`SpeculativeEngine` state before a step (see `SpeculativeEngine._snapshot`)."""

    waiting: list[int]
    rows: "BatchRows | None"
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
# Target and drafter passes
# ------------------------------------------------------------------------------------------------------------------


def _target_forward(target, rows: BatchRows, tokens, new_valid, positions, layer_indices, keep: int,
                    feature_device=None):
    """Append `tokens` (R, N) to the shared cache; returns (float logits of the last `keep` entries, features)."""
    mask = torch.cat([rows.target_valid, new_valid], dim=1)
    kwargs = {"logits_to_keep": keep} if target._supports_logits_to_keep() else {}
    out = target(input_ids=tokens, attention_mask=mask.long(), position_ids=positions, cache=rows.target_cache,
                 use_cache=True, output_hidden_states=layer_indices, **kwargs)
    # With a device_map the layers' states live on their layers' devices; the drafter sits by the LM head.
    features = torch.cat([out.hidden_states[i].to(feature_device) for i in layer_indices], dim=-1)
    return out.logits[:, -keep:].float(), features


def _draft(drafter: DSparkDraftModel, rows: BatchRows, budget: torch.LongTensor, slots: int, rule: DraftLengthRule,
           sampling: RowSampling, generator: torch.Generator | None) -> Drafts:
    """One backbone pass for all rows (consuming the queued context), then the drafting core over `slots` slots
    (`draft_block`, as at batch 1) and the draft-length rule on the device: each row verifies at most its
    `budget`, and under a threshold or the scheduler fewer, decided from its confidences c_1..c_k alone."""
    config = drafter.config
    num_rows, width = rows.anchor.shape[0], config.block_size  # the input block [anchor, MASK, ...]
    device = rows.anchor.device
    block = torch.cat([rows.anchor[:, None], rows.anchor.new_full((num_rows, width - 1), config.mask_token_id)], 1)
    context_valid = torch.cat([rows.draft_valid, rows.pending_valid], dim=1)
    mask = torch.cat([context_valid[:, None, :].expand(-1, width, -1),
                      context_valid.new_ones(num_rows, width, width)], dim=-1)[:, None]
    # Positions count real tokens, so a cached column's is the number of real columns before it (block-causal and
    # sliding-window drafter layers compare positions; holes are masked anyway).
    out = drafter(input_ids=block, target_hidden_states=rows.pending,
                  position_ids=rows.target_length[:, None] + torch.arange(width, device=device),
                  context_position_ids=rows.pending_positions, attention_mask=mask, cache=rows.draft_cache,
                  cached_position_ids=rows.draft_valid.long().cumsum(dim=1) - 1)
    rows.draft_valid = context_valid  # the queued context is in the cache now; verification queues the next
    tokens, probs, confidences = draft_block(drafter, out, rows.anchor, slots, sampling, generator)
    return Drafts(tokens, probs, rule.lengths(confidences, budget), confidences)


def _project_context(drafter: DSparkDraftModel, rows: BatchRows) -> None:
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


def _prefill(target, input_ids, prompt_mask, request_ids, layer_indices, sampling: RowSampling, generator,
             feature_device) -> tuple[BatchRows, torch.LongTensor]:
    """Run left-padded prompts through the target; return their rows' state and each request's first new token.

    Positions count real tokens only, as `generate` does for left-padded prompts. Left padding becomes the first
    holes of both caches.
    """
    num_requests, device = input_ids.shape[0], input_ids.device
    positions = (prompt_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
    empty = prompt_mask[:, :0]
    rows = BatchRows(
        request=to_device(request_ids, device),
        request_ids=list(request_ids),
        anchor=input_ids[:, -1],
        target_cache=_new_target_cache(target),
        target_valid=empty,
        target_length=input_ids.new_zeros(num_requests),
        draft_cache=DraftContextCache(),
        draft_valid=empty,
        pending=torch.zeros(num_requests, 0, 0, device=device),
        pending_valid=empty,
        pending_positions=positions[:, :0],
    )
    target_logits, features = _target_forward(target, rows, input_ids, prompt_mask, positions, layer_indices, keep=1,
                                              feature_device=feature_device)
    _, first_token, _ = verify_drafts(sampling, target_logits, Drafts.empty(num_requests, device), generator)
    rows.target_valid, rows.target_length = prompt_mask, prompt_mask.long().sum(dim=1)
    rows.stage_context(features, prompt_mask, positions, width=prompt_mask.shape[1])
    return rows, first_token


def _verify_round(target, rows: BatchRows, drafts: Drafts, width: int, layer_indices, sampling: RowSampling,
                  generator, feature_device):
    """Verify every row's anchor and drafts in one target forward of `width` entries per row (the longest row's
    drafts + 1, read on the host). Returns (candidate tokens (R, width): accepted drafts then the target's token,
    number accepted (R,), features, positions), all on the device."""
    offsets = torch.arange(width, device=rows.anchor.device)
    tokens = torch.cat([rows.anchor[:, None], drafts.tokens[:, : width - 1]], dim=1)
    new_valid = offsets[None, :] < drafts.lengths[:, None] + 1
    positions = rows.target_length[:, None] + offsets  # padded entries get the same arithmetic; they are masked
    target_logits, features = _target_forward(target, rows, tokens, new_valid, positions, layer_indices, keep=width,
                                              feature_device=feature_device)
    num_accepted, next_token, _ = verify_drafts(sampling, target_logits, drafts, generator)
    new_tokens = torch.cat([drafts.tokens[:, : width - 1], tokens.new_zeros(tokens.shape[0], 1)], dim=1)
    new_tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return new_tokens, num_accepted, features, positions


def _commit_round(rows: BatchRows, num_accepted: torch.LongTensor, accepted: list[int], width: int, features,
                  positions) -> None:
    """The newest token and the accepted drafts become valid; rejected drafts and padding stay as holes, except
    the trailing columns that no row kept: cropping those is a free slice and bounds the cache's growth. `accepted`
    is `num_accepted` as read on the host."""
    used = max(accepted) + 1
    if used < width:
        rows.target_cache.crop(-(width - used))
    kept = torch.arange(used, device=rows.anchor.device)[None, :] < num_accepted[:, None] + 1
    rows.target_valid = torch.cat([rows.target_valid, kept], dim=1)
    rows.target_length = rows.target_length + num_accepted + 1
    rows.stage_context(features, kept, positions, width=used)


def _emit(requests: list["_Request"], new_tokens: list[list[int]], counts: list[int]) -> list[bool]:
    """Append each row's first `counts[r]` tokens (host ints), stopping after an EOS or at `max_new_tokens` exactly
    as plain decoding would (every row's EOS found at once in the values read). Returns which rows finished."""
    finished = []
    for request, tokens, count in zip(requests, new_tokens, counts):
        done = False
        for token in tokens[:count]:
            request.tokens.append(token)
            request.emitted += 1
            if token in request.eos or request.emitted >= request.max_new_tokens:
                done = True
                break
        finished.append(done)
    return finished


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
        keep_stats: keep every request's statistics in `stats` after its output is returned (a long-running
            server would grow without bound; by default they leave with the output, see `returned_stats`).

    Attributes:
        stats: per request id, its `SpeculativeStats` (one entry per round it took part in), for the requests still
            waiting or running (and, with `keep_stats`, every request since the engine started).
        returned_stats: the `SpeculativeStats` of the requests whose outputs the latest `step()`, `cancel()` or
            `run_until_done()` returned (replaced by the next such call).
        verified_tokens_per_round: per round, sum over running requests of k_r + 1 (the verification batch B).
    """

    def __init__(self, target, drafter: DSparkDraftModel, policy: str | None = None, policy_arg=None, *,
                 generator: torch.Generator | None = None, keep_stats: bool = False):
        if policy is None and drafter_type(drafter) == BLOCK_DRAFTER_TYPE:
            policy, policy_arg = resolve_verification_policy(drafter)
        self.rule = _check_engine(target, drafter, policy, policy_arg)
        drafter.attach_target(target, follow=True)  # beside the target's LM head, in its dtype
        self.target, self.drafter = target, drafter
        self.policy, self.policy_arg = policy, policy_arg
        self.generator = generator
        self.device = target.device
        self.gamma = self.rule.max_slots(drafter.draft_length())
        self._sampling: tuple[list[int], RowSampling] | None = None  # the current rows' settings, built once
        self.stats: dict[int, SpeculativeStats] = {}
        self.keep_stats = keep_stats
        self.returned_stats: dict[int, SpeculativeStats] = {}
        self.verified_tokens_per_round: list[int] = []
        self._requests: dict[int, _Request] = {}
        self._waiting: list[int] = []
        self._rows: BatchRows | None = None
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
        self.returned_stats = {}
        return {request_id: self._pop_output(request_id) for request_id in finished}

    def cancel(self, request_id: int) -> torch.LongTensor:
        """Drop a waiting or running request; returns its tokens so far (prompt followed by any new tokens).
        The other requests are unaffected."""
        if request_id not in self._requests:
            raise KeyError(f"no request {request_id} is waiting or running (finished ones were already returned).")
        self.returned_stats = {}
        if request_id in self._waiting:
            self._waiting.remove(request_id)
        elif self._rows is not None:
            keep = [row for row, r in enumerate(self._rows.request_ids) if r != request_id]
            if not keep:
                self._rows = None
            elif len(keep) < len(self._rows):
                self._rows.select(keep)
                self._rows.drop_unused_columns()
        return self._pop_output(request_id)

    def run_until_done(self) -> dict[int, torch.LongTensor]:
        """Step until no request is waiting or running; returns the outputs of the requests that finished during
        this call (those returned by earlier `step()` calls are not repeated)."""
        outputs: dict[int, torch.LongTensor] = {}
        returned: dict[int, SpeculativeStats] = {}
        while self._waiting or self.num_running:
            outputs.update(self.step())
            returned.update(self.returned_stats)
        self.returned_stats = returned
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
        self.rule.reset()

    def _row_sampling(self, request_ids: list[int]) -> RowSampling:
        if self._sampling is None or self._sampling[0] != request_ids:
            self._sampling = (list(request_ids), RowSampling([self._requests[r].sampling for r in request_ids],
                                                             self.device))
        return self._sampling[1]

    def _pop_output(self, request_id: int) -> torch.LongTensor:
        """The request's tokens, leaving the engine; its statistics go with them (`returned_stats`)."""
        request = self._requests.pop(request_id)
        self.returned_stats[request_id] = self.stats[request_id] if self.keep_stats else self.stats.pop(request_id)
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
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = True
        input_ids, mask = input_ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        rows, first_token = _prefill(self.target, input_ids, mask, starting, self.drafter.target_hidden_state_indices,
                                     self._row_sampling(starting), self.generator, self.drafter.device)
        first = [[token] for token in first_token.tolist()]
        done = _emit([self._requests[r] for r in starting], first, [1] * len(starting))
        rows.anchor = first_token
        finished += [r for r, d in zip(starting, done) if d]
        if all(done):
            return finished
        if any(done):
            rows.select([row for row, d in enumerate(done) if not d])
        if self.num_running:
            _project_context(self.drafter, rows)
            self._rows.merge(rows)
            self._rows.drop_unused_columns()  # columns of the newcomers' left padding
        else:
            self._rows = rows
            self._reset_policy()  # a new batch: a stateful scheduler starts from its fallback
        return finished

    def _round(self) -> list[int]:
        """One draft-verify round for every running row; retires and returns the requests it finished.

        The device is read twice: the verified lengths (and confidences), then the accepted counts and tokens."""
        rows = self._rows
        request_ids = rows.request_ids
        requests = [self._requests[r] for r in request_ids]
        sampling = self._row_sampling(request_ids)
        # Every round emits at least one token, so a row drafts at most (tokens left - 1).
        budgets = [max(0, min(self.gamma, q.max_new_tokens - q.emitted - 1)) for q in requests]
        if not self.rule.needs_drafts():
            _project_context(self.drafter, rows)  # keep the drafter's context current; nothing is drafted
            drafts = Drafts.empty(len(rows), rows.anchor.device)
            lengths, confidences = [0] * len(rows), [[] for _ in rows.request_ids]
        else:
            drafts = _draft(self.drafter, rows, to_device(budgets, rows.anchor.device), max(budgets), self.rule,
                            sampling, self.generator)
            lengths, confidences = _read_lengths(drafts)
        width = max(lengths) + 1
        new_tokens, num_accepted, features, positions = _verify_round(
            self.target, rows, drafts, width, self.drafter.target_hidden_state_indices, sampling, self.generator,
            self.drafter.device)
        values = torch.cat([num_accepted[:, None], new_tokens], dim=1).tolist()  # the round's second read
        accepted = [row[0] for row in values]
        _commit_round(rows, num_accepted, accepted, width, features, positions)

        self.verified_tokens_per_round.append(sum(lengths) + len(rows))
        before = [request.emitted for request in requests]
        done = _emit(requests, [row[1:] for row in values], [count + 1 for count in accepted])
        for request, length, count, start, slot_confidences in zip(requests, lengths, accepted, before, confidences):
            # A row that stops inside its drafts (EOS) counts only the drafts it emitted (as batch 1 does).
            count = min(count, request.emitted - start - 1)
            request.stats.record(length, count, slot_confidences if self.drafter.confidence_proj is not None else None)
        finished = [r for r, d in zip(request_ids, done) if d]
        if all(done):
            self._rows = None
        else:
            # A row that goes on emitted all its tokens, the last being the target's: the next anchor.
            rows.anchor = new_tokens.gather(1, num_accepted[:, None]).squeeze(1)
            if finished:  # one more read, in the rounds where requests leave
                rows.select([row for row, d in enumerate(done) if not d])
                rows.drop_unused_columns()
        return finished


def _read_lengths(drafts: Drafts) -> tuple[list[int], list[list[float]]]:
    """The round's first read of the device: each row's verified length, with the confidences of those slots."""
    if drafts.confidences is None:
        return drafts.lengths.tolist(), [[] for _ in range(drafts.lengths.shape[0])]
    values = torch.cat([drafts.lengths[:, None].to(drafts.confidences.dtype), drafts.confidences], dim=1).tolist()
    lengths = [int(row[0]) for row in values]
    return lengths, [row[1 : 1 + length] for row, length in zip(values, lengths)]


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
        stats=[engine.returned_stats[r] for r in request_ids],
        verified_tokens_per_round=engine.verified_tokens_per_round,
    )
