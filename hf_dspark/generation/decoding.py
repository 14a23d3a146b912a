"""The speculative decoding loop behind `target.generate(..., assistant_model=<hf_dspark drafter>)`.

Prefill the target, then repeat: draft, verify all drafts in one target forward, keep the accepted prefix plus
one target token, crop the target cache. Tokens are appended one at a time through the stopping criteria, so
EOS, `max_new_tokens` and custom criteria stop exactly where plain decoding would.

Every setting comes from the call's `DraftingPlan` (`plan.py`), resolved once before any token. A batch of several
left-padded prompts goes to the batched engine instead (`generate_batch.py`).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..models.drafter_base import DraftPreTrainedModel
from .candidates import candidate_generator_for
from .drafting import Drafts, emitted_drafts, round_tokens, verify_drafts
from .generate_batch import batched_speculative_decoding
from .outputs import SpeculativeDecoderOnlyOutput
from .plan import DraftingPlan
from .request_checks import check_request
from .sampling import check_sampling_processors
from .stopping import append_until_stop


@torch.no_grad()
def speculative_decoding(
    target,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: DraftPreTrainedModel,
    streamer=None,
    drafting_settings: dict | None = None,
    **model_kwargs,
):
    """What both generate() routes run: one prompt through the batch-1 loop, several through the batched engine.
    `drafting_settings` are the settings the call passed (`hf_dspark.generation.settings`), resolved with the
    drafter's `generation_config` into one `DraftingPlan` before any token. The call runs `drafter.for_target(target)`:
    the drafter beside the target's LM head, in its dtype, as a view of its own (over a cached cast copy when the
    drafter's weights have another dtype or device), so the drafter's weights never change and calls from several
    threads may share one drafter, with targets of different dtypes too.

    `generate`'s logits processors are called once per scored position: every draft slot and every verification
    slot, with that slot's context (prompt, text so far, the drafts before it), including positions that are later
    rejected. Processors that read only their arguments (all of `generate`'s own but those in
    `STATEFUL_PROCESSORS`, which are refused) give plain `generate`'s output; a user processor must do the same,
    keeping no state across calls."""
    check_sampling_processors(logits_processor)  # the batched engine's rules, so both paths refuse alike
    check_request(target, drafter, input_ids, generation_config, model_kwargs, streamer)
    plan = DraftingPlan.for_call(drafter, drafting_settings, stopping_criteria)
    bound = drafter.for_target(target)  # this call's own drafter: beside the target's LM head, in its dtype
    if input_ids.shape[0] > 1:
        result = batched_speculative_decoding(target, input_ids, logits_processor, generation_config, bound, plan,
                                              model_kwargs.get("attention_mask"))
    else:
        result = _decode_one_prompt(target, input_ids, logits_processor, stopping_criteria, generation_config, bound,
                                    plan, streamer, **model_kwargs)
    drafter.last_generation_stats = bound.last_generation_stats
    return result


def _decode_one_prompt(target, input_ids, logits_processor, stopping_criteria, generation_config, drafter,
                       plan: DraftingPlan, streamer=None, **model_kwargs):
    """The batch-1 loop, with `drafter` bound to `target` for this call (`for_target`)."""
    generator = candidate_generator_for(drafter, logits_processor, generation_config, plan)
    sampling = generator.sampling
    cache = model_kwargs["cache"]
    runner = plan.target_runner(target, cache, generation_config, drafter.target_hidden_state_indices)
    stop_rule = plan.stop_rule()
    want = generation_config.return_dict_in_generate
    scores = () if want and generation_config.output_scores else None
    raw_logits = () if want and generation_config.output_logits else None

    sequence = input_ids
    generator.extend_text(sequence[0].tolist())
    outputs, target_logits = runner.forward(sequence, keep=1)
    drafts = Drafts.empty(1, sequence.device)
    is_prefill = True
    while True:
        sampling.sequence = sequence
        num_accepted, next_token, processed = verify_drafts(sampling, target_logits, drafts)
        drafted = drafts.length
        new_tokens = round_tokens(drafts.tokens[:, :drafted], num_accepted, next_token)
        # The round's one read of the device in this loop: the accepted count and the tokens it emits.
        values = torch.cat([num_accepted, new_tokens[0]]).tolist()
        accepted, emitted = values[0], values[1 : 2 + values[0]]
        sequence, count, finished, scores, raw_logits = append_until_stop(
            sequence, new_tokens, emitted, stop_rule, stopping_criteria, processed, target_logits, scores, raw_logits)
        if not is_prefill:
            generator.record_round(emitted_drafts(accepted, count), drafted)
        is_prefill = False
        if streamer is not None:
            streamer.put(new_tokens[:, :count].cpu())
        # The cache holds every position but the newest token, as after plain decoding.
        runner.crop(sequence.shape[1] - 1)
        generator.extend_text(emitted[:count])  # also scores the last proposals for later calls
        if finished:
            break
        drafts = generator.propose(sequence, outputs)
        outputs, target_logits = _verify_forward(generator, runner, plan, sequence, drafts)

    if streamer is not None:
        streamer.end()
    drafter.last_generation_stats = generator.stats
    if want:
        return SpeculativeDecoderOnlyOutput(
            sequences=sequence, scores=scores, logits=raw_logits, cache=cache, speculative_stats=generator.stats
        )
    return sequence


def _verify_forward(generator, runner, plan: DraftingPlan, sequence, drafts: Drafts):
    """The target forward over the anchor and the round's drafts; returns (outputs, logits of the real tokens)."""
    clock = generator.clock
    started = clock.now()
    tokens = torch.cat([sequence[:, -1:], drafts.tokens[:, : drafts.length].to(sequence.device)], dim=-1)
    real = tokens.shape[1]
    costs = plan.settings.cost_table
    if costs is not None and not runner.pads_to_buckets:
        # Pad to the cheapest forward size: later dummy tokens cannot change earlier logits (causal), their
        # features are never read and their cache entries are cropped with the rejected drafts.
        padded = costs.padded_tokens(real)
        tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - real)], dim=-1)
    outputs, target_logits = runner.forward(tokens, keep=tokens.shape[1])
    finished_at = clock.lap(generator.stats, "verification", started)
    if clock.enabled:  # the planner prices later rounds with what forwards of this size cost here and now
        generator.planner.record_forward(tokens.shape[1], finished_at - started)
    return outputs, target_logits[:, :real]
