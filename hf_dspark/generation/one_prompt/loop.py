"""The batch-1 loop: one prompt behind `target.generate(..., assistant_model=<hf_dspark drafter>)`.

Prefill the target, then repeat: draft, verify all drafts in one target forward, keep the accepted prefix plus
one target token, crop the target cache. Tokens are appended one at a time through the stopping criteria, so
EOS, `max_new_tokens` and custom criteria stop exactly where plain decoding would.

Every setting comes from the call's `DraftingPlan` (`call/plan.py`), resolved once before any token. A batch of
several left-padded prompts goes to the batched engine instead (`call/dispatch.py` routes the call).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .proposers import candidate_generator_for
from ..round.drafting import Drafts, emitted_drafts, round_tokens
from ..round.verification import verify_drafts
from ..call.outputs import SpeculativeDecoderOnlyOutput
from ..call.plan import DraftingPlan
from ..round.stopping import append_until_stop


@torch.no_grad()
def decode_one_prompt(target, input_ids, logits_processor, stopping_criteria, generation_config, drafter,
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
    generator.extend_text(sequence[0].tolist(), prompt=True)
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
            generator.record_round(accepted, drafted, emitted_drafts(accepted, count))
        is_prefill = False
        if streamer is not None:
            streamer.put(new_tokens[:, :count].cpu())
        # The cache holds every position but the newest token, as after plain decoding.
        runner.crop(sequence.shape[1] - 1)
        generator.extend_text(emitted[:count])
        if finished:
            break
        drafts = generator.propose(sequence, outputs)
        outputs, target_logits = _verify_forward(generator, runner, plan, sequence, drafts)

    runner.finish()
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
    clock.lap(generator.stats, "verification", started)
    return outputs, target_logits[:, :real]
