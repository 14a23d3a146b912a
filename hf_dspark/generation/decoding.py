"""The speculative decoding loop behind `target.generate(..., assistant_model=<hf_dspark drafter>)`.

Prefill the target, then repeat: draft, verify all drafts in one target forward, keep the accepted prefix plus
one target token, crop the target cache. Tokens are appended one at a time through the stopping criteria, so
EOS, `max_new_tokens` and custom criteria stop exactly where plain decoding would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models.common import DraftPreTrainedModel
from .candidates import candidate_generator_for
from .stats import SpeculativeStats
from .verification import greedy_verify, rejection_sample

_PASSED_BY_GENERATE = {"cache", "attention_mask", "position_ids", "logits_to_keep", "use_cache"}


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    r"""
    speculative_stats ([`SpeculativeStats`]):
        Draft length and accepted count of every verification round (tau, per-slot acceptance).
    """

    speculative_stats: SpeculativeStats | None = None


def _check_request(target, input_ids, generation_config: GenerationConfig, model_kwargs: dict) -> None:
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"hf_dspark speculative decoding through generate() takes one sequence at a time, got a batch of "
            f"{input_ids.shape[0]}. Call generate() per prompt until the batched engine is available."
        )
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
        raise ValueError(
            "The prompt's attention_mask contains padding. A single prompt needs no padding: tokenize it "
            "without padding (or strip the padded positions) before calling generate()."
        )
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("speculative decoding needs a cache; do not pass use_cache=False.")
    if cache.get_seq_length() > 0:
        raise ValueError("continuing from a pre-filled cache is not supported with hf_dspark drafters.")
    unexpected = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _PASSED_BY_GENERATE)
    if unexpected:
        raise ValueError(f"hf_dspark speculative decoding does not forward these model inputs: {unexpected}")


def _target_forward(target, tokens, cache, layer_indices, keep: int):
    kwargs = {"logits_to_keep": keep} if target._supports_logits_to_keep() else {}
    out = target(input_ids=tokens, cache=cache, use_cache=True, output_hidden_states=layer_indices, **kwargs)
    return out, out.logits[:, -keep:].float()


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
    _check_request(target, input_ids, generation_config, model_kwargs)
    drafter.attach_target(target)
    generator = candidate_generator_for(drafter, logits_processor, generation_config)
    layer_indices = generator.model_kwargs_overrides["output_hidden_states"]
    cache = model_kwargs["cache"]
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # sliding-window layers keep what a crop may need

    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores = () if want_scores else None
    raw_logits = () if want_logits else None

    sequence = input_ids
    outputs, target_logits = _target_forward(target, sequence, cache, layer_indices, keep=1)
    draft_tokens = sequence.new_zeros(1, 0)
    draft_logits = None
    is_prefill = True
    while True:
        num_drafts = draft_tokens.shape[1]
        processed = target_logits.clone()
        for i in range(num_drafts + 1):
            context = torch.cat([sequence, draft_tokens[:, :i]], dim=-1)
            processed[:, i] = logits_processor(context, processed[:, i])

        if generation_config.do_sample:
            draft_probs = draft_logits.softmax(-1) if draft_logits is not None else processed[:, :0]
            num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, processed.softmax(-1))
        else:
            num_accepted, next_token = greedy_verify(draft_tokens, processed)
        num_accepted = int(num_accepted[0])
        new_tokens = torch.cat([draft_tokens[:, :num_accepted], next_token[:, None]], dim=-1)
        if not is_prefill:
            generator.update_candidate_strategy(sequence, processed, num_accepted)
        is_prefill = False

        finished = False
        for j in range(new_tokens.shape[1]):
            sequence = torch.cat([sequence, new_tokens[:, j : j + 1]], dim=-1)
            if want_scores:
                scores += (processed[:, j],)
            if want_logits:
                raw_logits += (target_logits[:, j],)
            if bool(stopping_criteria(sequence, scores).all()):
                finished = True
                break
        if streamer is not None:
            streamer.put(sequence[:, sequence.shape[1] - j - 1 :].cpu())
        # The cache holds every position but the newest token, as after plain decoding.
        cache.crop(-(cache.get_seq_length() - (sequence.shape[1] - 1)))
        if finished:
            break

        candidates, draft_logits = generator.get_candidates(sequence, model_outputs=outputs, n_last_matches=num_accepted)
        draft_tokens = candidates[:, sequence.shape[1] :]
        started = time.perf_counter()
        outputs, target_logits = _target_forward(
            target, candidates[:, sequence.shape[1] - 1 :], cache, layer_indices, keep=draft_tokens.shape[1] + 1
        )
        generator.stats.add_seconds("verification", time.perf_counter() - started)

    if streamer is not None:
        streamer.end()
    drafter.last_generation_stats = generator.stats
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(
            sequences=sequence, scores=scores, logits=raw_logits, cache=cache, speculative_stats=generator.stats
        )
    return sequence
