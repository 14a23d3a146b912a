"""`generate()` with a batch of prompts: the call translated for the batched engine, its output laid out as stock
`generate` lays out a batch.

The engine applies temperature, top-k and top-p on every row and slot at once and stops at EOS and the length limit;
`generate`'s processors and criteria are read into those per-request settings, and anything else is refused before
any token, naming the option.
"""

from __future__ import annotations

import functools

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ...models.drafter_base import DraftPreTrainedModel
from ...transformers_internals.accessors import pad_token_tensor
from ..engine.speculative_engine import SpeculativeEngine, check_left_padded
from ..engine.requests import BatchedOutput, eos_ids
from ..call.outputs import SpeculativeDecoderOnlyOutput
from ..call.plan import DraftingPlan
from .request_checks import BATCH_FIX
from ..round.stats import SpeculativeStats
from ..round.stopping import StopLimits

# generate() options whose processors need each row's full context, drafts included; the batched engine applies
# only temperature, top-k and top-p (context-free warpers that it runs on every row and slot at once).
_PROCESSOR_OPTIONS = {
    "RepetitionPenaltyLogitsProcessor": "`repetition_penalty`",
    "EncoderRepetitionPenaltyLogitsProcessor": "`encoder_repetition_penalty`",
    "NoRepeatNGramLogitsProcessor": "`no_repeat_ngram_size`",
    "EncoderNoRepeatNGramLogitsProcessor": "`encoder_no_repeat_ngram_size`",
    "NoBadWordsLogitsProcessor": "`bad_words_ids`",
    "SequenceBiasLogitsProcessor": "`sequence_bias`",
    "MinLengthLogitsProcessor": "`min_new_tokens` / `min_length`",
    "MinNewTokensLengthLogitsProcessor": "`min_new_tokens`",
    "PrefixConstrainedLogitsProcessor": "`prefix_allowed_tokens_fn`",
    "ForcedBOSTokenLogitsProcessor": "`forced_bos_token_id`",
    "ForcedEOSTokenLogitsProcessor": "`forced_eos_token_id`",
    "InfNanRemoveLogitsProcessor": "`remove_invalid_values`",
    "ExponentialDecayLengthPenalty": "`exponential_decay_length_penalty`",
    "SuppressTokensLogitsProcessor": "`suppress_tokens`",
    "SuppressTokensAtBeginLogitsProcessor": "`begin_suppress_tokens`",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "`guidance_scale`",
    "TopHLogitsWarper": "`top_h`",
    "MinPLogitsWarper": "`min_p`",
    "TypicalLogitsWarper": "`typical_p`",
    "EpsilonLogitsWarper": "`epsilon_cutoff`",
    "EtaLogitsWarper": "`eta_cutoff`",
    "LogitNormalization": "`renormalize_logits`",
}
_CRITERIA_OPTIONS = {
    "MaxTimeCriteria": "`max_time`",
    "StopStringCriteria": "`stop_strings`",
    "ConfidenceCriteria": "`assistant_confidence_threshold`",
}
_WARPER_ORDER = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


def _unsupported(kind: str, obj, options: dict[str, str]) -> ValueError:
    name = type(obj).__name__
    option = options.get(name)
    what = f"{name} (from generate's {option})" if option else f"the custom {kind} {name}"
    fix = f"Unset {option}, " if option else "Drop it, "
    return ValueError(
        f"{what} is not supported by batched speculative decoding with hf_dspark drafters, which applies only "
        f"temperature, top_k and top_p and stops only at EOS and max_length/max_new_tokens. {fix}{BATCH_FIX}"
    )


def _batch_sampling(logits_processor: LogitsProcessorList, generation_config: GenerationConfig) -> dict:
    """The engine's sampling settings, read from the processors `generate` built (the very ones the batch-1 path
    applies, user-given warpers included). Anything but a plain temperature / top-k / top-p warper is refused."""
    options = {"do_sample": bool(generation_config.do_sample), "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    last = -1
    for processor in logits_processor:
        kind = type(processor)
        if kind not in _WARPER_ORDER:
            raise _unsupported("logits processor", processor, _PROCESSOR_OPTIONS)
        if kind is not TemperatureLogitsWarper and (
            processor.min_tokens_to_keep != 1 or processor.filter_value != float("-inf")
        ):
            raise ValueError(
                f"{kind.__name__} with min_tokens_to_keep={processor.min_tokens_to_keep} or a custom filter_value "
                f"is not supported by batched speculative decoding; use generate's own top_k / top_p, {BATCH_FIX}"
            )
        if _WARPER_ORDER.index(kind) <= last:
            raise ValueError(
                "batched speculative decoding applies temperature, then top_k, then top_p, once each (generate's "
                f"order); these logits processors are in another order. Pass them in that order, {BATCH_FIX}"
            )
        last = _WARPER_ORDER.index(kind)
        if kind is TemperatureLogitsWarper:
            options["temperature"] = float(processor.temperature)
        elif kind is TopKLogitsWarper:
            options["top_k"] = int(processor.top_k)
        else:
            options["top_p"] = float(processor.top_p)
    return options


@torch.no_grad()
def batched_speculative_decoding(target, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                                 generation_config: GenerationConfig, drafter: DraftPreTrainedModel,
                                 plan: DraftingPlan, attention_mask: torch.Tensor | None = None):
    """`generate()` for R left-padded prompts: every row decoded by the batched engine with the plan's verification
    policy, returned as stock `generate` returns a batch: (R, P + longest output) with the prompts as given (left
    padding kept) and rows that stopped early padded on the right with `pad_token_id` (EOS when there is none).
    With `return_dict_in_generate=True` the output also holds every request's statistics (`request_stats`) and
    their merge (`speculative_stats`, also kept as `drafter.last_generation_stats`). The position ids `generate`
    prepared are not used: the engine derives the same ones (real tokens counted from 0) from the attention mask.
    The request was checked (`check_request`) and its stopping criteria read into `plan.stop_limits` already."""
    sampling = _batch_sampling(logits_processor, generation_config)
    max_new_tokens, eos = _batch_limits(plan.stop_limits, input_ids.shape[1])
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    check_left_padded(input_ids, mask)

    # `drafter` is this call's own (`for_target`), already beside the target in its dtype: the engine's
    # attach_target(follow=True) finds nothing to move or cast, so the caller's drafter is never changed.
    engine = SpeculativeEngine(target, drafter, plan=plan)
    request_ids = [engine.submit(input_ids[row, mask[row]], max_new_tokens, eos_token_id=eos, **sampling)
                   for row in range(input_ids.shape[0])]
    outputs = engine.run_until_done()
    sequences = [outputs[r].to(input_ids.device) for r in request_ids]
    stats = [engine.returned_stats[r] for r in request_ids]
    merged = functools.reduce(SpeculativeStats.merge, stats, SpeculativeStats())
    drafter.last_generation_stats = merged

    pad = pad_token_tensor(generation_config)
    pad = int(pad.flatten()[0]) if pad is not None else (eos[0] if eos else 0)  # without EOS no row ends early
    result = _as_generate_batch(input_ids, mask, sequences, pad)
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(sequences=result, speculative_stats=merged, request_stats=stats,
                                            verified_tokens_per_round=list(engine.verified_tokens_per_round))
    return result


def _batch_limits(limits: StopLimits, prompt_width: int) -> tuple[int, list[int]]:
    """(max_new_tokens, EOS ids) from `generate`'s stopping criteria; any other criterion is refused. As in stock
    `generate`, max_length counts the padded prompt width, so every row may add the same number of tokens."""
    if limits.others:
        raise _unsupported("stopping criterion", limits.others[0], _CRITERIA_OPTIONS)
    if limits.max_length is None:
        raise ValueError("batched speculative decoding needs a length limit: pass max_new_tokens or max_length.")
    return max(limits.max_length - prompt_width, 0), limits.eos


def _as_generate_batch(input_ids, mask, sequences: list[torch.LongTensor], pad: int) -> torch.LongTensor:
    """Stock `generate`'s layout of a batch: the prompts as given (left padding kept), each followed by its new
    tokens, rows that stopped early filled with `pad` up to the longest."""
    prompt_width = input_ids.shape[1]
    new_tokens = [sequence[int(prompt.sum()) :] for sequence, prompt in zip(sequences, mask)]
    width = prompt_width + max((tokens.shape[0] for tokens in new_tokens), default=0)
    result = input_ids.new_full((input_ids.shape[0], width), pad)
    result[:, :prompt_width] = input_ids
    for row, tokens in enumerate(new_tokens):
        result[row, prompt_width : prompt_width + tokens.shape[0]] = tokens
    return result


@torch.no_grad()
def batched_speculative_generate(
    target,
    drafter,
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
    threshold_rule: str = "cumulative",
    draft_length: int | None = None,
    generator: torch.Generator | None = None,
) -> BatchedOutput:
    """Lossless speculative decoding of a left-padded batch of prompts with a DSpark, DFlash or Eagle3 drafter.

    Each request's output is distributed exactly as the target's own decoding of that prompt alone (greedy: the
    same tokens) with the given temperature / top-k / top-p, stopping at `eos_token_id` (default: the target's
    generation config) or after `max_new_tokens` new tokens. All prompts start together; `SpeculativeEngine` runs
    the same rounds for requests that arrive over time.

    Args:
        target: a decoder-only causal LM (see `SpeculativeEngine`: every family and attention it runs).
        drafter: a `DSparkDraftModel` or `Eagle3DraftModel` trained for `target` (attached here).
        input_ids, attention_mask: (R, P) left-padded prompts and their mask.
        policy: how many drafted slots each row verifies per round:
            ``"all"``: every slot the budget allows (up to `draft_length`);
            ``"fixed"``: `policy_arg` slots;
            ``"threshold"``: up to the first slot whose cumulative confidence c_1...c_j is below `policy_arg` (its
            own c_j with `threshold_rule="per_slot"`, DeepSpec's meaning);
            ``"scheduler"``: `policy_arg.select_lengths(confidences, max_lengths)` of a `DSparkScheduler`, over all
            rows together. The last two need a confidence head (DSpark, not
            DFlash). `policy` and `threshold_rule` are taken as given here, not from the drafter.
        draft_length: slots drafted per round; None: the drafter's `num_assistant_tokens` (every slot unless set).
        generator: random source for drafting and acceptance (sampling only).
    """
    engine = SpeculativeEngine(target, drafter, policy, policy_arg, threshold_rule=threshold_rule,
                               draft_length=draft_length, generator=generator)
    check_left_padded(input_ids, attention_mask)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be non-negative, got {max_new_tokens}.")
    prompt_mask = attention_mask.bool()
    sampling = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k)
    eos = sorted(eos_ids(target, eos_token_id))
    request_ids = [engine.submit(input_ids[r, prompt_mask[r]], max_new_tokens, eos_token_id=eos, **sampling)
                   for r in range(input_ids.shape[0])]
    outputs = engine.run_until_done()
    return BatchedOutput(
        sequences=[outputs[r].to(input_ids.device) for r in request_ids],
        stats=[engine.returned_stats[r] for r in request_ids],
        verified_tokens_per_round=engine.verified_tokens_per_round,
    )
