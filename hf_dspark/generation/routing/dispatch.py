"""Where a `generate()` call with an hf_dspark drafter goes: its checks and its one `DraftingPlan` first, then one
prompt to the batch-1 loop (`one_prompt/loop.py`), several left-padded prompts to the batched engine
(`routing/batch.py`, `engine/`)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ...models.drafter_base import DraftPreTrainedModel
from ..one_prompt.loop import decode_one_prompt
from ..round.sampling import check_sampling_processors
from .batch import batched_speculative_decoding
from ..call.plan import DraftingPlan
from ...policy.remembered import remembered_state
from .request_checks import check_request


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
    `drafting_settings` are the settings the call passed (`hf_dspark.generation.call.settings`), resolved with the
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
    with remembered_state(drafter, target, plan) as plan:  # what earlier calls measured, unless the call gave a state
        if input_ids.shape[0] > 1:
            result = batched_speculative_decoding(target, input_ids, logits_processor, generation_config, bound, plan,
                                                  model_kwargs.get("attention_mask"))
        else:
            result = decode_one_prompt(target, input_ids, logits_processor, stopping_criteria, generation_config,
                                        bound, plan, streamer, **model_kwargs)
    drafter.last_generation_stats = bound.last_generation_stats
    return result
