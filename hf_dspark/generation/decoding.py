"""The speculative decoding loop behind `target.generate(..., assistant_model=<hf_dspark drafter>)`.

Prefill the target, then repeat: draft, verify all drafts in one target forward, keep the accepted prefix plus
one target token, crop the target cache. Tokens are appended one at a time through the stopping criteria, so
EOS, `max_new_tokens` and custom criteria stop exactly where plain decoding would.

A batch of several left-padded prompts goes to the batched engine instead (`batched.SpeculativeEngine`, DSpark and
DFlash drafters): `generate`'s processors and stopping criteria are translated into its per-request settings, and
its outputs are laid out as stock `generate` lays out a batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models.common import BLOCK_DRAFTER_TYPE, DraftPreTrainedModel, UserInputError, drafter_type
from ..scheduling.draft_length import resolve_verification_policy
from .batched import BatchedOutput, SpeculativeEngine, check_left_padded
from .candidates import candidate_generator_for
from .drafting import Drafts, verify_drafts
from .sampling import check_sampling_processors
from .stats import SpeculativeStats
from .target_forward import target_runner_for

_PASSED_BY_GENERATE = {"cache", "attention_mask", "position_ids", "logits_to_keep", "use_cache"}


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    r"""
    speculative_stats ([`SpeculativeStats`]):
        Draft length and accepted count of every verification round (tau, per-slot acceptance).
    """

    speculative_stats: SpeculativeStats | None = None


def _check_cache_and_inputs(model_kwargs: dict) -> None:
    """What both the batch-1 and the batched paths need from generate()'s model inputs: a fresh cache, no extras."""
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("speculative decoding needs a cache; do not pass use_cache=False.")
    if cache.get_seq_length() > 0:
        raise ValueError("continuing from a pre-filled cache is not supported with hf_dspark drafters.")
    unexpected = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _PASSED_BY_GENERATE)
    if unexpected:
        raise ValueError(f"hf_dspark speculative decoding does not forward these model inputs: {unexpected}")


def _check_request(target, input_ids, generation_config: GenerationConfig, model_kwargs: dict) -> None:
    if target.config.is_encoder_decoder:
        raise ValueError("hf_dspark drafters serve decoder-only targets; this target is encoder-decoder.")
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise ValueError(
            "output_attentions / output_hidden_states are not returned by hf_dspark speculative decoding; "
            "drop them (scores, logits and the cache are returned)."
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise UserInputError(_masked_prompt_message(input_ids, mask, generation_config))
    _check_cache_and_inputs(model_kwargs)


def _masked_prompt_message(input_ids, mask, generation_config: GenerationConfig) -> str:
    """Why a single prompt arrived with masked positions, and the fix. When no attention_mask is passed, stock
    generate() infers one that masks every position holding the pad token id, so a pad id inside the text (a
    tokenizer whose pad is a real token, or ids built by hand) ends up here although the user passed no mask."""
    masked = (mask[0] == 0).nonzero().flatten().tolist()
    shown = ", ".join(map(str, masked[:8])) + (", ..." if len(masked) > 8 else "")
    where = f"position{'s' if len(masked) > 1 else ''} {shown}"
    pad = getattr(generation_config, "_pad_token_tensor", None)
    pad = int(pad.flatten()[0]) if pad is not None else generation_config.pad_token_id
    if pad is not None and bool((input_ids[0, masked] == pad).all()):
        return (
            f"The prompt holds the pad token id {pad} at {where}, and the attention_mask masks exactly those: "
            "without an attention_mask, generate() infers one from the pad id. hf_dspark decodes one prompt without "
            "masked positions. If they are part of the text, pass attention_mask=torch.ones_like(input_ids); if they "
            "are padding, strip them from input_ids before calling generate()."
        )
    return (
        f"The prompt's attention_mask masks {where}. A single prompt needs no padding: tokenize it without padding "
        "(or strip the masked positions) before calling generate(), or pass a batch of left-padded prompts."
    )


class _HostStoppingRule:
    """`generate`'s own criteria (max length, EOS) decided on the host from the tokens a round emits, which the
    loop reads anyway, instead of a device check per token. Other criteria run per token, as in plain decoding."""

    def __init__(self, max_length: int | None, eos: set[int]):
        self.max_length, self.eos = max_length, eos

    @classmethod
    def from_criteria(cls, stopping_criteria: StoppingCriteriaList) -> "_HostStoppingRule | None":
        max_length, eos = None, set()
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                eos.update(criterion.eos_token_id.flatten().tolist())
            else:
                return None
        return cls(max_length, eos)

    def first_stop(self, tokens: list[int], length: int) -> tuple[int, bool]:
        """(how many of `tokens` to append after a sequence of `length`, whether generation ends there)."""
        for j, token in enumerate(tokens):
            if token in self.eos or (self.max_length is not None and length + j + 1 >= self.max_length):
                return j + 1, True
        return len(tokens), False


def _append_until_stop(sequence, new_tokens, emitted: list[int], stop_rule, stopping_criteria, processed,
                       target_logits, scores, raw_logits):
    """Append a round's `emitted` tokens to `sequence` up to where plain decoding would stop, with their processed
    scores and raw logits when those are collected (`scores` / `raw_logits` not None). Returns (sequence, how many
    were appended, whether generation ends there, scores, raw_logits)."""
    if stop_rule is not None:
        count, finished = stop_rule.first_stop(emitted, sequence.shape[1])
        sequence = torch.cat([sequence, new_tokens[:, :count]], dim=-1)
        if scores is not None:
            scores += tuple(processed[:, j] for j in range(count))
        if raw_logits is not None:
            raw_logits += tuple(target_logits[:, j] for j in range(count))
        return sequence, count, finished, scores, raw_logits
    # A criterion of the user's: it sees every token and its score, as in plain decoding.
    for j in range(len(emitted)):
        sequence = torch.cat([sequence, new_tokens[:, j : j + 1]], dim=-1)
        if scores is not None:
            scores += (processed[:, j],)
        if raw_logits is not None:
            raw_logits += (target_logits[:, j],)
        if bool(stopping_criteria(sequence, scores).all()):
            return sequence, j + 1, True, scores, raw_logits
    return sequence, len(emitted), False, scores, raw_logits


@torch.no_grad()
def speculative_decoding(
    target,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: DraftPreTrainedModel,
    streamer=None,
    **model_kwargs,
):
    """What both generate() routes run: one prompt through the batch-1 loop, several through the batched engine.
    The drafter follows its target's device and dtype for the call; its own weights come back when it returns.

    `generate`'s logits processors are called once per scored position: every draft slot and every verification
    slot, with that slot's context (prompt, text so far, the drafts before it), including positions that are later
    rejected. Processors that read only their arguments (all of `generate`'s own but those in
    `STATEFUL_PROCESSORS`, which are refused) give plain `generate`'s output; a user processor must do the same,
    keeping no state across calls."""
    check_sampling_processors(logits_processor)  # the batched engine's rules, so both paths refuse alike
    decode = _decode_one_prompt if input_ids.shape[0] == 1 else batched_speculative_decoding
    try:
        return decode(target, input_ids, logits_processor, stopping_criteria, generation_config, drafter, streamer,
                      **model_kwargs)
    finally:
        drafter.restore_own_precision()


def _decode_one_prompt(target, input_ids, logits_processor, stopping_criteria, generation_config, drafter,
                       streamer=None, **model_kwargs):
    _check_request(target, input_ids, generation_config, model_kwargs)
    drafter.attach_target(target, follow=True)  # beside the target's LM head, in its dtype
    generator = candidate_generator_for(drafter, logits_processor, generation_config)
    sampling, clock, stats = generator.sampling, generator.clock, generator.stats
    layer_indices = generator.model_kwargs_overrides["output_hidden_states"]
    cache = model_kwargs["cache"]
    runner = target_runner_for(target, cache, generation_config, layer_indices, drafter=drafter)
    stop_rule = _HostStoppingRule.from_criteria(stopping_criteria)

    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores = () if want_scores else None
    raw_logits = () if want_logits else None

    sequence = input_ids
    generator.extend_text(sequence[0].tolist())
    outputs, target_logits = runner.forward(sequence, keep=1)
    drafts = Drafts.empty(1, sequence.device)
    is_prefill = True
    while True:
        sampling.sequence = sequence
        num_accepted, next_token, processed = verify_drafts(sampling, target_logits, drafts)
        drafted = drafts.length
        new_tokens = torch.cat([drafts.tokens[:, :drafted], next_token[:, None]], dim=1)
        new_tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
        # The round's one read of the device in this loop: the accepted count and the tokens it emits.
        values = torch.cat([num_accepted, new_tokens[0]]).tolist()
        accepted, emitted = values[0], values[1 : 2 + values[0]]
        sequence, count, finished, scores, raw_logits = _append_until_stop(
            sequence, new_tokens, emitted, stop_rule, stopping_criteria, processed, target_logits, scores, raw_logits)
        if not is_prefill:
            # A round that stops inside its drafts (EOS) emits `count` tokens, the last standing for the target's
            # own: drafts matched past the stop were never emitted and do not count (llama.cpp counts alike).
            generator.record_round(min(accepted, count - 1), drafted)
        is_prefill = False
        if streamer is not None:
            streamer.put(new_tokens[:, :count].cpu())
        # The cache holds every position but the newest token, as after plain decoding.
        runner.crop(sequence.shape[1] - 1)
        generator.extend_text(emitted[:count])  # also scores the last proposals for later calls
        if finished:
            break

        drafts = generator.propose(sequence, outputs)
        started = clock.now()
        tokens = torch.cat([sequence[:, -1:], drafts.tokens[:, : drafts.length].to(sequence.device)], dim=-1)
        real = tokens.shape[1]
        if drafter.verification_costs is not None and not runner.pads_to_buckets:
            # Pad to the cheapest forward size: later dummy tokens cannot change earlier logits (causal), their
            # features are never read and their cache entries are cropped with the rejected drafts.
            padded = drafter.verification_costs.padded_tokens(real)
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - real)], dim=-1)
        outputs, target_logits = runner.forward(tokens, keep=tokens.shape[1])
        target_logits = target_logits[:, :real]
        finished_at = clock.lap(stats, "verification", started)
        if clock.enabled:  # the planner prices later rounds with what forwards of this size cost here and now
            generator.planner.record_forward(tokens.shape[1], finished_at - started)

    if streamer is not None:
        streamer.end()
    drafter.last_generation_stats = generator.stats
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(
            sequences=sequence, scores=scores, logits=raw_logits, cache=cache, speculative_stats=generator.stats
        )
    return sequence


# ------------------------------------------------------------------------------------------------------------------
# Batches: generate() -> the batched engine
# ------------------------------------------------------------------------------------------------------------------

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
_BATCH_FIX = "or call generate() one prompt at a time (batch size 1 supports it)."


def _unsupported(kind: str, obj, options: dict[str, str]) -> ValueError:
    name = type(obj).__name__
    option = options.get(name)
    what = f"{name} (from generate's {option})" if option else f"the custom {kind} {name}"
    fix = f"Unset {option}, " if option else "Drop it, "
    return ValueError(
        f"{what} is not supported by batched speculative decoding with hf_dspark drafters, which applies only "
        f"temperature, top_k and top_p and stops only at EOS and max_length/max_new_tokens. {fix}{_BATCH_FIX}"
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
                f"is not supported by batched speculative decoding; use generate's own top_k / top_p, {_BATCH_FIX}"
            )
        if _WARPER_ORDER.index(kind) <= last:
            raise ValueError(
                "batched speculative decoding applies temperature, then top_k, then top_p, once each (generate's "
                f"order); these logits processors are in another order. Pass them in that order, {_BATCH_FIX}"
            )
        last = _WARPER_ORDER.index(kind)
        if kind is TemperatureLogitsWarper:
            options["temperature"] = float(processor.temperature)
        elif kind is TopKLogitsWarper:
            options["top_k"] = int(processor.top_k)
        else:
            options["top_p"] = float(processor.top_p)
    return options


def _batch_limits(stopping_criteria: StoppingCriteriaList, prompt_width: int) -> tuple[int, list[int]]:
    """(max_new_tokens, EOS ids) from `generate`'s stopping criteria; any other criterion is refused. As in stock
    `generate`, max_length counts the padded prompt width, so every row may add the same number of tokens."""
    max_length, eos = None, []
    for criterion in stopping_criteria:
        if type(criterion) is MaxLengthCriteria:
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos += criterion.eos_token_id.flatten().tolist()
        else:
            raise _unsupported("stopping criterion", criterion, _CRITERIA_OPTIONS)
    if max_length is None:
        raise ValueError("batched speculative decoding needs a length limit: pass max_new_tokens or max_length.")
    return max(max_length - prompt_width, 0), eos


def _check_batch_request(target, drafter, generation_config: GenerationConfig, streamer, model_kwargs: dict) -> None:
    if drafter_type(drafter) != BLOCK_DRAFTER_TYPE:
        raise ValueError(
            f"generate() with a batch of prompts runs the batched engine, which supports DSpark/DFlash drafters; "
            f"{type(drafter).__name__} serves one prompt at a time: call generate() per prompt."
        )
    if streamer is not None:
        raise ValueError("streamer is not supported for a batch of prompts; stream one prompt at a time.")
    if generation_config.return_dict_in_generate:
        if generation_config.output_attentions or generation_config.output_hidden_states:
            raise ValueError(
                "output_attentions / output_hidden_states are not returned by hf_dspark speculative decoding; "
                "drop them."
            )
        wanted = [name for name in ("output_scores", "output_logits") if getattr(generation_config, name)]
        if wanted:
            raise ValueError(
                f"{' and '.join(wanted)} are not returned by batched speculative decoding (only sequences and "
                f"speculative_stats are); drop them, {_BATCH_FIX}"
            )
    _check_cache_and_inputs(model_kwargs)


@torch.no_grad()
def batched_speculative_decoding(
    target,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter: DraftPreTrainedModel,
    streamer=None,
    **model_kwargs,
):
    """`generate()` for R left-padded prompts: every row decoded by the batched engine with the drafter's
    `verification_policy`, returned as stock `generate` returns a batch: (R, P + longest output) with the prompts
    as given (left padding kept) and rows that stopped early padded on the right with `pad_token_id` (EOS when
    there is none). `drafter.last_generation_stats` gets the rounds of all requests merged, and
    `drafter.last_batch_output` the per-request `BatchedOutput`. The position ids `generate` prepared are not used:
    the engine derives the same ones (real tokens counted from 0) from the attention mask."""
    _check_batch_request(target, drafter, generation_config, streamer, model_kwargs)
    sampling = _batch_sampling(logits_processor, generation_config)
    max_new_tokens, eos = _batch_limits(stopping_criteria, input_ids.shape[1])
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    check_left_padded(input_ids, mask)

    policy, policy_arg = resolve_verification_policy(drafter)
    engine = SpeculativeEngine(target, drafter, policy, policy_arg)
    request_ids = [engine.submit(input_ids[row, mask[row]], max_new_tokens, eos_token_id=eos, **sampling)
                   for row in range(input_ids.shape[0])]
    outputs = engine.run_until_done()
    sequences = [outputs[r].to(input_ids.device) for r in request_ids]
    stats = [engine.returned_stats[r] for r in request_ids]
    drafter.last_batch_output = BatchedOutput(sequences, stats, engine.verified_tokens_per_round)
    drafter.last_generation_stats = functools.reduce(SpeculativeStats.merge, stats, SpeculativeStats())

    pad = getattr(generation_config, "_pad_token_tensor", None)
    pad = int(pad.flatten()[0]) if pad is not None else (eos[0] if eos else 0)  # without EOS no row ends early
    result = _as_generate_batch(input_ids, mask, sequences, pad)
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(sequences=result, speculative_stats=drafter.last_generation_stats)
    return result


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
