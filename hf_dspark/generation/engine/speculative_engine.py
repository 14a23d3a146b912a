"""Batched decoding: R requests decoded together, drafted and verified by a DSpark, DFlash or Eagle3 drafter, or,
without a drafter, plain continuous batching (every round verifies no drafts: one target token per row per step).

The rows' state (both caches with holes, explicit positions) is `rows.BatchRows`; the token choice per row
is `sampling.RowSampling`; drafting is the one core of every batch size (`drafting.draft_block`) and the draft
length the one rule (`DraftLengthRule`), as in the batch-1 loop. The passes over the rows are `passes`, the
requests' bookkeeping `requests`, the round's decision `policy.planner`, transformers' cache internals
`transformers_internals`.

* Target: one `DynamicCache` of width W for all rows and a (R, W) validity mask, from which `masks` makes each
  forward's attention mask (for full attention the 2D padding mask: the causal order is the cache order).
* Drafter: one `DraftContextCache` and a (R, C) validity mask over its context rows. Each round appends, per row,
  the target features of the entries that became valid (the context before the next anchor), then runs the backbone
  on `[anchor, MASK x (block_size - 1)]` (valid context and the whole block visible) and the head slot by slot over rows.

A round reads the device twice, whatever R: the verified lengths (and confidences), which fix the verification's
width, and the accepted counts with the emitted tokens (each request's EOS and length limit are found on the host).
Finishing requests add one read (the cache columns still used). A plain round reads once (the tokens), and once
more when requests finish.

A finished request (EOS or its `max_new_tokens`) is removed from every tensor and cache, so rounds only pay for the
requests still running. Holes also make **continuous batching** cheap (`SpeculativeEngine`): a request that
arrives while others run is prefilled apart from them (with the other newcomers, one left-padded forward per group
of similar prompt lengths, so a short prompt does not compute a long one's padding: `passes.prefill_grouped`), its
prompt context projected into its own drafter cache, and its rows are appended to the running batch, each cache
padded with holes to the wider of the two; cache columns that no remaining row uses are dropped then. Every request
has its own sampling settings, EOS and length limit; rows with equal settings share one warper pass. The
verification rule is `greedy_verify` / `rejection_sample`, the same as at batch size 1. In plain decoding a finished
request's cache can be parked and a later request (the conversation's next turn) continued on it, prefilling only
its new tokens.
"""

from __future__ import annotations

import torch

from ...models.modeling_dspark import DSparkDraftModel
from ...policy.length_rule import DraftLengthRule
from .rows import BatchRows
from ..round.drafting import Drafts, draft_block, draft_input_block, drafting_pass, emitted_drafts
from ..round.verification import verify_drafts
from ..round.skeleton import speculative_round
from ..call.plan import DraftingPlan
from ...policy.remembered import hold_remembered_state
from .eagle3 import row_drafter_for
from .checks import (check_drafter, check_eos, check_left_padded, check_parking, check_resume, check_target,
                     checked_prompt, checked_sampling, engine_plan)
from .requests import (BatchedOutput, EngineGate, EngineSnapshot, ParkedCache, Request, emit, eos_ids,
                              park_finished)
from .passes import EngineRows, plain_step, prefill_grouped, prefill_resumed, project_context
from ..round.sampling import RowSampling, SamplingParams
from ..round.stats import SpeculativeStats

__all__ = ["BatchedOutput", "ParkedCache", "SamplingParams", "SpeculativeEngine", "check_left_padded"]


def _draft(drafter: DSparkDraftModel, rows: BatchRows, budget: torch.LongTensor, slots: int, rule: DraftLengthRule,
           sampling: RowSampling, generator: torch.Generator | None) -> Drafts:
    """One backbone pass for all rows (consuming the queued context), then the drafting core over `slots` slots
    (`draft_block`, as at batch 1) and the draft-length rule on the device: each row verifies at most its
    `budget`, and under a threshold or the scheduler fewer, decided from its confidences c_1..c_k alone."""
    config = drafter.config
    num_rows, width = rows.anchor.shape[0], config.block_size
    device = rows.anchor.device
    block = draft_input_block(rows.anchor, config)
    context_valid = torch.cat([rows.draft_valid, rows.pending_valid], dim=1)
    mask = torch.cat([context_valid[:, None, :].expand(-1, width, -1),
                      context_valid.new_ones(num_rows, width, width)], dim=-1)[:, None]
    # Positions count real tokens, so a cached column's is the number of real columns before it (block-causal and
    # sliding-window drafter layers compare positions; holes are masked anyway).
    out = drafter(input_ids=block, target_hidden_states=rows.pending,
                  position_ids=rows.target_length[:, None] + torch.arange(width, device=device),
                  context_position_ids=rows.pending_positions, attention_mask=mask, cache=rows.draft_cache,
                  cached_position_ids=rows.draft_valid.long().cumsum(dim=1) - 1, logits_mask=drafting_pass(device))
    rows.draft_valid = context_valid  # the queued context is in the cache now; verification queues the next
    rows.take_context()
    tokens, probs, confidences = draft_block(drafter, out, rows.anchor, slots, sampling, generator)
    return Drafts(tokens, probs, rule.lengths(confidences, budget), confidences)


class SpeculativeEngine:
    """Continuous batching: requests join and leave a running batch between rounds.

    ```python
    engine = SpeculativeEngine(target, drafter)
    first = engine.submit(prompt_ids, max_new_tokens=64)
    engine.step()                                   # one round for every running request
    second = engine.submit(other_ids, max_new_tokens=32, do_sample=True, temperature=0.7)
    outputs = engine.run_until_done()               # {request_id: prompt + new tokens}
    ```

    A submitted request waits until the next `step()`, which first prefills every waiting prompt (one left-padded
    target forward per group of similar lengths) and appends their rows to the running batch, then runs one round
    for all rows.
    Each request's output is distributed exactly as the target's own decoding of its prompt alone with its own
    settings (greedy: the same tokens), whatever else shares the batch and whenever it joined.

    Each round is planned from earlier rounds (`policy/planner.py`; the drafter's
    `generation_config.dspark_round_planning`): per request the drafter's block, a suffix match of its own text or a
    plain step, with the verification width that pays best at the costs this engine measured; a round in which no
    row drafts does not run the drafter.

    Threads: one thread may step the engine while others `submit()` (never waiting for a step: the request joins
    at the next step to start) and `cancel()` (waiting for the running step, then taking effect before any later
    one, returning the tokens that step left). The engine casts its drafter in place (`attach_target(follow=True)`):
    do not generate() with that drafter for a target of another dtype or device while the engine runs.

    Args:
        target: a decoder-only causal LM with full or sliding-window attention layers, or a hybrid one with
            recurrent or convolution layers beside full attention (Qwen3.5, Qwen3-Next, LFM2, Nemotron-H); any
            attention implementation (flash attention runs as sdpa here: the holes need a 4D mask).
        drafter: a `DSparkDraftModel` or `Eagle3DraftModel` trained for `target` (attached here), or None for plain
            continuous batching (each round emits one target token per row; `policy` must stay "all").
        policy, policy_arg: how many drafted slots each row verifies per round, as in
            `batched_speculative_generate`.
        threshold_rule: what policy "threshold" compares: ``"cumulative"`` (c_1...c_j) or ``"per_slot"`` (c_j).
        draft_length: slots drafted per round, 1..`drafter.config.num_draft_slots`. Unset, these three come from
            the drafter's `generation_config`, resolved as `generate()` resolves them (`DraftingPlan.for_call`).
        plan: a `DraftingPlan` instead of the three above (what `generate()` passes down: every setting of the call).
            Without one, the engine learns into its drafter's own `DraftingState` for this target while it lives
            (what `generate()` calls and earlier engines measured: this machine's round costs, how often suffix
            proposals and the drafter's slots are accepted), as a call does; another engine or call running at the
            same time learns into a fresh one.
        generator: random source for drafting and acceptance (sampled requests without a generator of their own).
        keep_stats: keep every request's statistics in `stats` after its output is returned (a long-running
            server would grow without bound; by default they leave with the output, see `returned_stats`).

    Attributes:
        stats: per request id, its `SpeculativeStats` (one entry per round it took part in), for the requests still
            waiting or running (and, with `keep_stats`, every request since the engine started).
        returned_stats: the `SpeculativeStats` of the requests whose outputs the latest `step()`, `cancel()` or
            `run_until_done()` returned (replaced by the next such call).
        verified_tokens_per_round: per round, sum over running requests of k_r + 1 (the verification batch B).
    """

    def __init__(self, target, drafter: DSparkDraftModel | None = None, policy: str | None = None, policy_arg=None, *,
                 threshold_rule: str | None = None, draft_length: int | None = None,
                 generator: torch.Generator | None = None, keep_stats: bool = False, plan: DraftingPlan | None = None):
        self.plain = drafter is None
        if self.plain:
            if policy not in (None, "all") or draft_length is not None or plan is not None:
                raise ValueError("an engine without a drafter verifies no drafts: leave policy, draft_length and "
                                 "plan unset, or pass the drafter.")
            check_target(target)
            self.rule, self.draft_length, self.layer_indices, self.feature_device = None, 0, (), None
        else:
            check_drafter(target, drafter)
            # generate()'s call passes its plan down unchanged (with the call's state); an engine built directly makes
            # one of its arguments and learns into its drafter's own state for this target while it lives.
            if plan is None:
                plan = hold_remembered_state(self, drafter, target, engine_plan(drafter, policy, policy_arg,
                                                                                 threshold_rule, draft_length))
            costs = plan.cost_model()
            self.rule = plan.length_rule(costs)
            self.draft_length = self.rule.max_draft_length(plan.draft_length)
            drafter.attach_target(target, follow=True)  # beside the target's LM head, in its dtype
            self.layer_indices, self.feature_device = drafter.target_hidden_state_indices, drafter.device
        self.target, self.drafter, self.plan = target, drafter, plan
        self._draft_rows = row_drafter_for(drafter) or _draft  # this drafter kind's pass, for all rows at once
        self.round_policy = plan.round_policy(self.draft_length, costs, self.rule) if drafter is not None else None
        self.policy, self.policy_arg = (plan.policy, plan.policy_arg) if plan is not None else ("all", None)
        self.generator = generator
        self.device = target.device
        self._vocab_size = target.get_input_embeddings().weight.shape[0]
        self._sampling: tuple[list[int], RowSampling] | None = None  # the current rows' settings, built once
        self.stats: dict[int, SpeculativeStats] = {}
        self.keep_stats = keep_stats
        self.returned_stats: dict[int, SpeculativeStats] = {}
        self.verified_tokens_per_round: list[int] = []
        self._requests: dict[int, Request] = {}
        self._parked: dict[int, ParkedCache] = {}
        self._waiting: list[int] = []
        self._rows: BatchRows | None = None
        self._gate = EngineGate()  # other threads' submissions and cancellations

    # -- public ---------------------------------------------------------------------------------------------------

    def submit(self, input_ids: torch.LongTensor, max_new_tokens: int, *, do_sample: bool = False,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None,
               resume: ParkedCache | None = None, keep_cache: bool = False) -> int:
        """Queue one prompt (1D token ids, no padding) and return its request id. It joins at the next `step()`.
        `eos_token_id` None falls back to the target's generation config, like `generate`.

        Plain decoding (no drafter) also takes: `generator`, this request's own random source (its samples then do
        not depend on what shares its rounds); `keep_cache`, park its cache when it finishes (`take_parked`);
        `resume`, a parked cache this prompt continues (its tokens must start the prompt): only the rest is
        prefilled.

        Everything is checked here, before the request can share a round with others: integer token ids (a
        float tensor is refused, not truncated), one non-empty 1D prompt, every id inside the target's vocabulary,
        and the sampling settings. A refused request leaves the engine unchanged."""
        tokens = checked_prompt(input_ids, self._vocab_size).tolist()
        if isinstance(max_new_tokens, bool) or not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}.")
        sampling = checked_sampling(do_sample, temperature, top_p, top_k)
        check_eos(eos_token_id)
        if (generator is not None or keep_cache) and not self.plain:
            raise ValueError("generator= and keep_cache= are options of plain decoding (drafter=None); with a "
                             "drafter, sampled requests draw from the engine's generator.")
        if keep_cache and max_new_tokens == 0:
            raise ValueError("keep_cache=True needs max_new_tokens >= 1: a request that decodes nothing computes "
                             "no cache to park.")
        check_resume(tokens, resume, self.plain)
        check_parking(self.target, keep_cache, resume)
        request = Request(tokens, max_new_tokens, sampling, eos_ids(self.target, eos_token_id), generator, resume,
                          keep_cache)
        return self._gate.post(request, self._requests, self.stats)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._gate)

    @property
    def num_running(self) -> int:
        return 0 if self._rows is None else len(self._rows)

    def step(self) -> dict[int, torch.LongTensor]:
        """Admit the waiting requests, then run one round for every running request. Returns the requests that
        finished during this step (id -> prompt followed by its new tokens); each output is returned once.

        A step that raises (out of memory, an interrupt, a request that breaks the model) leaves the engine as it
        was before the step: waiting requests still wait, running ones keep their caches and tokens. Fix the
        cause, or `cancel()` the offending request, and step again; every other request's output is unchanged.
        (A stateful scheduler may have seen the failed round's confidences: that changes draft lengths only.)"""
        with self._gate.exclusive():
            return self._step()

    def cancel(self, request_id: int) -> torch.LongTensor:
        """Drop a waiting or running request; returns its tokens so far (prompt followed by any new tokens).
        The other requests are unaffected. Called during a step (from another thread), it waits for that step."""
        with self._gate.exclusive():
            return self._cancel(request_id)

    def run_until_done(self) -> dict[int, torch.LongTensor]:
        """Step until no request is waiting or running; returns the outputs of the requests that finished during
        this call (those returned by earlier `step()` calls are not repeated)."""
        outputs: dict[int, torch.LongTensor] = {}
        returned: dict[int, SpeculativeStats] = {}
        while True:
            with self._gate.exclusive():  # step by step: other threads' cancellations go in between
                if not (self.num_waiting or self.num_running):
                    self.returned_stats = returned
                    return outputs
                outputs.update(self._step())
                returned.update(self.returned_stats)

    def tokens_so_far(self, request_id: int) -> list[int]:
        """A waiting or running request's prompt followed by the tokens it has emitted so far, as host ints (what a
        stream sends after each `step()`). Its output is still returned once, when it finishes or is cancelled."""
        with self._gate.exclusive():
            self._gate.admit(self._waiting)
            if request_id not in self._requests:
                raise KeyError(f"no request {request_id} is waiting or running (finished ones were already returned "
                               "by step(), cancel() or run_until_done()).")
            return list(self._requests[request_id].tokens)

    def take_parked(self, request_id: int) -> ParkedCache:
        """The parked cache of a finished `keep_cache=True` request, leaving the engine (pass it to `submit(...,
        resume=)` for the conversation's next turn, or drop it)."""
        with self._gate.exclusive():
            if request_id not in self._parked:
                raise KeyError(f"no parked cache for request {request_id}: submit it with keep_cache=True (plain "
                               "decoding) and take its cache once, after its output was returned.")
            return self._parked.pop(request_id)

    # -- internals ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _step(self) -> dict[int, torch.LongTensor]:
        """`step()`, with the engine held."""
        self._gate.admit(self._waiting)
        snapshot = EngineSnapshot.take(self._waiting, self._rows, self._requests, self._parked,
                                       len(self.verified_tokens_per_round))
        try:
            if self._waiting and self.round_policy is not None:
                self.round_policy.interrupt()  # a prefill comes before the next round: not the loop's per-round work
            finished = self._admit_waiting()
            if self.num_running:
                finished += self._plain_round() if self.plain else self._round()
        except BaseException as error:
            snapshot.undo(self, error)
            raise
        self.returned_stats = {}
        return {request_id: self._pop_output(request_id) for request_id in finished}

    def _cancel(self, request_id: int) -> torch.LongTensor:
        self._gate.admit(self._waiting)
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
        return self._pop_output(request_id)

    def _row_sampling(self, request_ids: list[int]) -> RowSampling:
        if self._sampling is None or self._sampling[0] != request_ids:
            requests = [self._requests[r] for r in request_ids]
            self._sampling = (list(request_ids), RowSampling([q.sampling for q in requests], self.device,
                                                             [q.generator for q in requests]))
        return self._sampling[1]

    def _pop_output(self, request_id: int) -> torch.LongTensor:
        """The request's tokens, leaving the engine; its statistics go with them (`returned_stats`)."""
        request = self._requests.pop(request_id)
        if self.round_policy is not None:
            self.round_policy.forget(request_id, request.emitted, request.emitted < request.max_new_tokens)
        self.returned_stats[request_id] = self.stats[request_id] if self.keep_stats else self.stats.pop(request_id)
        return torch.tensor(request.tokens, dtype=torch.long, device=self.device)

    def _admit_waiting(self) -> list[int]:
        """Prefill the waiting prompts (those continuing a parked cache apart, on it) and append their rows to the
        batch; returns those already done (no new tokens asked, or the first token ends them)."""
        waiting, self._waiting = self._waiting, []
        finished = [r for r in waiting if self._requests[r].max_new_tokens == 0]
        starting = [r for r in waiting if self._requests[r].max_new_tokens > 0]
        resumed = [r for r in starting if self._requests[r].resume is not None]
        if resumed:
            parked = [self._requests[r].resume for r in resumed]
            new_tokens = [self._requests[r].tokens[len(p.tokens):] for r, p in zip(resumed, parked)]
            for request_id in resumed:
                self._requests[request_id].resume = None  # its entries are in the rows now
            finished += self._join(resumed, *prefill_resumed(self.target, parked, new_tokens, resumed, self.device))
        fresh = [r for r in starting if r not in resumed]
        if fresh:
            rows, logits = prefill_grouped(self.target, [self._requests[r].tokens for r in fresh], fresh,
                                           self.layer_indices, self.feature_device, self.device)
            finished += self._join(rows.request_ids, rows, logits)
        return finished

    def _join(self, request_ids: list[int], rows: BatchRows, logits: torch.Tensor) -> list[int]:
        """Pick the prefilled rows' first tokens and append the rows that go on to the batch; returns those done."""
        if self.plain:
            first_token = self._choose(request_ids, logits[:, -1])
        else:
            empty = Drafts.empty(len(request_ids), logits.device)
            first_token = verify_drafts(self._row_sampling(request_ids), logits, empty, self.generator)[1]
        done = emit([self._requests[r] for r in request_ids], [[t] for t in first_token.tolist()],
                    [1] * len(request_ids))
        rows.anchor = first_token
        park_finished(rows, done, self._requests, self._parked)
        if all(done):
            return request_ids
        if any(done):
            rows.select([row for row, d in enumerate(done) if not d])
        if self.num_running:
            if not self.plain:
                # Both blocks' queued context into their drafter caches first, so the newcomers' prompt columns
                # line up with the running rows' instead of widening the cache after them.
                project_context(self.drafter, rows)
                project_context(self.drafter, self._rows)
            self._rows.merge(rows)
            self._rows.drop_unused_columns()  # columns of the newcomers' left padding
        else:
            self._rows = rows
        return [r for r, d in zip(request_ids, done) if d]

    def _choose(self, request_ids: list[int], logits: torch.Tensor) -> torch.LongTensor:
        """Plain decoding's tokens for these rows (the choice is built once per set of rows)."""
        return self._row_sampling(request_ids).plain_tokens(logits, self.generator)

    def _round(self) -> list[int]:
        """One round for every running row (`round.skeleton.speculative_round`): some rows verify the drafter's block,
        some a suffix match of their own text, the others only their anchor; a round without drafter rows does not
        run the drafter. Retires and returns the requests it finished."""
        rows, request_ids = self._rows, self._rows.request_ids
        requests = [self._requests[r] for r in request_ids]
        # Every round emits at least one token, so a row drafts at most (tokens left - 1).
        budgets = [max(0, min(self.draft_length, q.max_new_tokens - q.emitted - 1)) for q in requests]
        round_rows = EngineRows(self.target, self.drafter, rows, self._draft_rows, self.layer_indices,
                                self.feature_device)
        outcome = speculative_round(round_rows, self.round_policy, request_ids, requests, budgets,
                                    self._row_sampling(request_ids), self.generator, self.drafter.config.vocab_size,
                                    [q.max_new_tokens - q.emitted for q in requests])
        round_rows.commit(outcome.num_accepted, outcome.accepted, outcome.width, outcome.new_tokens)
        self.verified_tokens_per_round.append(sum(outcome.lengths) + len(rows))
        before = [request.emitted for request in requests]
        done = emit(requests, outcome.tokens, [count + 1 for count in outcome.accepted])
        for request, source, length, count, start, slot_confidences in zip(
                requests, outcome.plan.sources, outcome.lengths, outcome.accepted, before, outcome.confidences):
            request.stats.record(length, emitted_drafts(count, request.emitted - start), slot_confidences, source)
        # A row that goes on emitted all its tokens, the last being the target's: the next anchor.
        new_tokens, num_accepted = outcome.new_tokens, outcome.num_accepted
        return self._retire(done, lambda: new_tokens.gather(1, num_accepted[:, None]).squeeze(1))

    def _plain_round(self) -> list[int]:
        """Plain decoding: one target token per row, read once."""
        rows = self._rows
        request_ids = rows.request_ids
        requests = [self._requests[r] for r in request_ids]
        tokens = self._choose(request_ids, plain_step(self.target, rows))
        self.verified_tokens_per_round.append(len(rows))
        done = emit(requests, [[token] for token in tokens.tolist()], [1] * len(rows))
        for request in requests:
            request.stats.record(0, 0)
        return self._retire(done, lambda: tokens)

    def _retire(self, done: list[bool], next_anchor) -> list[int]:
        """Park and remove the rows that finished (one more read, in the rounds where requests leave); the others
        take `next_anchor()`. Returns the finished requests."""
        rows = self._rows
        finished = [r for r, d in zip(rows.request_ids, done) if d]
        park_finished(rows, done, self._requests, self._parked)
        if all(done):
            self._rows = None
            return finished
        rows.anchor = next_anchor()
        if finished:
            rows.select([row for row, d in enumerate(done) if not d])
        return finished
