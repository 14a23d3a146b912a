"""What the batched engine refuses, before any work: targets and drafters it cannot run, and requests it would not
decode as the target's own decoding of the prompt alone."""

from __future__ import annotations

import numbers

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

from ...models.errors import UserInputError
from ...models.identity import drafting_core
from ...transformers_internals.cache_layers import attention_layer_types, growing_cache
from ...transformers_internals.recurrent_states import unkept_states_message
from .requests import ParkedCache
from .masks import STATE_KINDS, mask_kinds
from ..call.plan import DraftingPlan
from ..call.settings import checked_draft_length
from ..round.sampling import SamplingParams, check_top_p

def check_target(target) -> None:
    """Refuse a target the engine cannot run, before any work. Any attention implementation runs: one that cannot
    take the engine's hole masks (flash attention) runs as sdpa inside its forwards (`mask_taking_attention`)."""
    if target.config.is_encoder_decoder:
        raise ValueError("hf_dspark's engine serves decoder-only targets; this target is encoder-decoder.")
    new_target_cache(target)  # refuses layers without per-token entries, and kinds the engine cannot mask


def new_target_cache(target):
    """A cache whose layers all keep every entry, sliding-window layers included: a window counts cache slots, holes
    included, so the engine applies it in its own masks, by position (`masks`)."""
    mask_kinds(target)  # refuses chunked and other layer kinds by name
    cache = growing_cache(target.config)
    if cache is None:
        raise ValueError(
            "Batched decoding runs targets whose layers keep per-token keys and values (full or sliding-window "
            "attention) or, beside them, recurrent or convolution states of their own; this target has a layer "
            "holding both kinds at once (or a cache layer of another kind), which the engine's holes cannot keep. Decode it "
            "per prompt."
        )
    refusal = unkept_states_message(cache, target)
    if refusal is not None:
        raise UserInputError(refusal)
    return cache


def engine_plan(drafter, policy, policy_arg, threshold_rule, draft_length) -> DraftingPlan:
    """The plan of an engine built directly: its arguments are the settings of one call, checked once by
    `DraftingPlan.for_call` (the unset ones from the drafter's `generation_config`, as `generate()` resolves them)."""
    call = {}
    if policy is not None:
        call["dspark_verification_policy"] = (policy, policy_arg)
    if threshold_rule is not None:
        call["dspark_confidence_threshold_rule"] = threshold_rule
    if draft_length is not None:
        call["num_assistant_tokens"] = checked_draft_length(draft_length, drafter.config.num_draft_slots,
                                                            name="draft_length")
    return DraftingPlan.for_call(drafter, call)


def check_drafter(target, drafter) -> None:
    """Refuse what the engine cannot run, before any work: drafters that are not hf_dspark's, targets it cannot
    batch."""
    if drafting_core(drafter) is None:
        raise ValueError(
            f"Batched speculative decoding runs hf_dspark drafters (DSparkDraftModel, Eagle3DraftModel), got "
            f"{type(drafter).__name__}."
        )
    check_target(target)


def checked_prompt(input_ids, vocab_size: int) -> torch.LongTensor:
    """One non-empty 1D prompt of integer ids inside the vocabulary (a float tensor is refused, not truncated)."""
    try:
        input_ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError):  # None, text, ragged or mixed lists: torch's own words name no fix
        raise ValueError(f"submit takes one prompt of integer token ids, got {repr(input_ids)[:80]}; pass the "
                         "tokenizer's ids (e.g. tokenizer(text, return_tensors='pt').input_ids[0]).") from None
    if input_ids.ndim == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.ndim != 1 or input_ids.numel() == 0:
        raise ValueError(f"submit takes one non-empty prompt of shape (length,), got shape {tuple(input_ids.shape)}.")
    if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        raise ValueError(
            f"submit takes integer token ids, got dtype {input_ids.dtype}; pass the tokenizer's ids as a LongTensor "
            "(e.g. tokenizer(text, return_tensors='pt').input_ids[0])."
        )
    outside = ((input_ids < 0) | (input_ids >= vocab_size)).nonzero()
    if outside.numel():
        position = int(outside[0, 0])
        raise ValueError(
            f"token id {int(input_ids[position])} at position {position} is outside the target's vocabulary "
            f"(ids 0..{vocab_size - 1}); tokenize the prompt with the target's own tokenizer."
        )
    return input_ids


def checked_sampling(do_sample, temperature, top_p, top_k) -> SamplingParams:
    """A request's sampling settings, refused as `generate()` refuses them: a sampled request's temperature and top_k
    go through transformers' own warpers, which `generate()` builds from them (its messages; nothing is rounded or
    parsed, so top_k=2.5 or "5" is refused, not read as 2 or 5), top_p through `check_top_p`; None is the setting
    off. A greedy request ignores them, as `generate()` does."""
    if not do_sample:
        return SamplingParams()
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    top_k = 0 if top_k is None else top_k
    if temperature != 1.0:
        TemperatureLogitsWarper(temperature)
    if isinstance(top_k, bool):  # an int to the warper, whose top-k pass then fails at the first sampled token
        raise ValueError(f"`top_k` has to be a strictly positive integer, but is {top_k}")
    if top_k != 0:
        TopKLogitsWarper(top_k)
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}.")
    check_top_p(top_p)
    return SamplingParams(True, temperature, top_p, top_k)


def check_eos(eos_token_id) -> None:
    """An end-of-sequence setting `generate()` reads: None (the target's own), a token id, a list of them or an
    integer tensor; a bool, a float or a string would stop on another token than meant, or never."""
    if eos_token_id is None:
        return
    if isinstance(eos_token_id, torch.Tensor):
        values = eos_token_id.flatten().tolist()  # floats and bools stay floats and bools, refused below
    else:
        values = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if any(isinstance(value, bool) or not isinstance(value, int) for value in values):
        raise ValueError(f"eos_token_id must be a token id (an int), a list of them or an integer tensor, got "
                         f"{repr(eos_token_id)[:80]}.")


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


def check_parking(target, keep_cache: bool, resume: ParkedCache | None) -> None:
    """Parked caches hold attention entries only: recurrent states and KV-shared layers are not parked."""
    if (keep_cache or resume is not None) and any(kind in STATE_KINDS for kind in attention_layer_types(target.config)):
        raise ValueError(
            "keep_cache= and resume= park and continue a request's attention entries; this target also has "
            "layers without entries of their own (recurrent, convolution or KV-shared layers), which are not "
            "parked. Submit the whole conversation as the prompt instead."
        )


def check_resume(tokens: list[int], resume: ParkedCache | None, plain: bool) -> None:
    """A parked cache continues only the text it covers, and only in plain decoding (drafters keep a context of
    their own that is not parked)."""
    if resume is None:
        return
    if not plain:
        raise ValueError("resume= continues a parked target cache, which only an engine without a drafter "
                         "(drafter=None) runs; with a drafter, submit the whole conversation as the prompt.")
    covered = len(resume.tokens)
    if len(tokens) <= covered or tokens[:covered] != resume.tokens:
        raise ValueError(
            f"resume= covers {covered} tokens that are not a strict prefix of this prompt ({len(tokens)} tokens); "
            "submit the parked request's tokens followed by the new ones (at least one)."
        )


