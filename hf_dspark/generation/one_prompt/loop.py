"""The batch-1 loop: one prompt behind `target.generate(..., assistant_model=<hf_dspark drafter>)`.

Prefill the target and choose its first token, then repeat the round every batch size runs
(`round.skeleton.speculative_round`: plan, propose, verify in one target forward) on this prompt's rows
(`rows.OnePromptRows`) and append its tokens one at a time through the stopping criteria, so EOS, `max_new_tokens`
and custom criteria stop exactly where plain decoding would.

Every setting comes from the call's `DraftingPlan` (`call/plan.py`), resolved once before any token. A batch of
several left-padded prompts goes to the batched engine instead (`routing/dispatch.py` routes the call).
"""

from __future__ import annotations

import torch

from ..call.outputs import SpeculativeDecoderOnlyOutput
from ..call.plan import DraftingPlan
from ..round.drafting import Drafts, emitted_drafts
from ..round.sampling import ProcessorSampling
from ..round.skeleton import speculative_round
from ..round.stats import PhaseClock, SpeculativeStats
from ..round.stopping import append_until_stop
from ..round.verification import verify_drafts
from .prompt_rows import OnePromptRows, OnePromptText
from .target_runners import target_runner_for


@torch.no_grad()
def decode_one_prompt(target, input_ids, logits_processor, stopping_criteria, generation_config, drafter,
                      plan: DraftingPlan, streamer=None, **model_kwargs):
    """The batch-1 loop, with `drafter` bound to `target` for this call (`for_target`)."""
    sampling = ProcessorSampling(logits_processor, bool(generation_config.do_sample))
    stats, clock = SpeculativeStats(), PhaseClock(drafter.device, plan.settings.time_phases)
    costs = plan.cost_model(timed=clock.enabled)
    rule = plan.length_rule(costs)
    draft_length = rule.max_draft_length(plan.draft_length)
    policy = plan.round_policy(draft_length, costs, rule)
    cache = model_kwargs["cache"]
    runner = target_runner_for(target, cache, generation_config, drafter.target_hidden_state_indices,
                               plan.num_draft_slots, plan.settings.cost_table)
    rows = OnePromptRows(drafter, runner, input_ids, plan.settings.cost_table, clock, stats)
    text = OnePromptText(input_ids[0].tolist(), generation_config.max_length)
    stop_rule = plan.stop_rule()
    want = generation_config.return_dict_in_generate
    scores = () if want and generation_config.output_scores else None
    raw_logits = () if want and generation_config.output_logits else None

    # The prompt's forward gives the first token: a round with no drafts.
    sampling.sequence = sequence = input_ids
    logits = rows.prefill()
    num_accepted, next_token, processed = verify_drafts(sampling, logits, Drafts.empty(1, sequence.device))
    new_tokens, emitted = next_token[:, None], next_token.tolist()
    outcome = None  # the round whose tokens are appended next (None: the prompt's first token)
    while True:
        sequence, count, finished, scores, raw_logits = append_until_stop(
            sequence, new_tokens, emitted, stop_rule, stopping_criteria, processed, logits, scores, raw_logits)
        if outcome is not None:  # its statistics count what it emitted before a stop
            stats.record(outcome.lengths[0], emitted_drafts(outcome.accepted[0], count), outcome.confidences[0],
                         outcome.plan.sources[0])
        if streamer is not None:
            streamer.put(new_tokens[:, :count].cpu())
        rows.commit(sequence)
        text.tokens.extend(emitted[:count])
        if finished:
            break
        sampling.sequence = sequence
        budget = max(0, min(draft_length, generation_config.max_length - sequence.shape[1] - 1))
        outcome = speculative_round(rows, policy, [0], [text], [budget], sampling, None,
                                    drafter.config.vocab_size)
        new_tokens, emitted = outcome.new_tokens, outcome.tokens[0][: outcome.accepted[0] + 1]
        logits, processed = outcome.logits, outcome.processed

    runner.finish()
    if streamer is not None:
        streamer.end()
    drafter.last_generation_stats = stats
    if want:
        return SpeculativeDecoderOnlyOutput(
            sequences=sequence, scores=scores, logits=raw_logits, cache=cache, speculative_stats=stats
        )
    return sequence
