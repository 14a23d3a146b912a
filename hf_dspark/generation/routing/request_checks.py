"""What a `generate()` call must satisfy before its first token, at every batch size (`check_request`)."""

from __future__ import annotations

from transformers import GenerationConfig

from ...models.errors import UserInputError
from ...transformers_internals.accessors import pad_token_tensor

_PASSED_BY_GENERATE = {"cache", "attention_mask", "position_ids", "logits_to_keep", "use_cache"}
BATCH_FIX = "or call generate() one prompt at a time (batch size 1 supports it)."


def check_request(target, drafter, input_ids, generation_config: GenerationConfig, model_kwargs: dict,
                  streamer=None) -> None:
    """Refuse what the loop (one prompt) or the engine (several) cannot follow, naming the option and the fix."""
    if target.config.is_encoder_decoder:
        raise ValueError("hf_dspark drafters serve decoder-only targets; this target is encoder-decoder.")
    batched = input_ids.shape[0] > 1
    if generation_config.return_dict_in_generate:
        if generation_config.output_attentions or generation_config.output_hidden_states:
            raise ValueError(
                "output_attentions / output_hidden_states are not returned by hf_dspark speculative decoding; "
                "drop them (sequences, speculative_stats and, for one prompt, scores, logits and the cache are "
                "returned)."
            )
        wanted = [name for name in ("output_scores", "output_logits") if getattr(generation_config, name)]
        if batched and wanted:
            raise ValueError(
                f"{' and '.join(wanted)} are not returned by batched speculative decoding (only sequences and "
                f"speculative_stats are); drop them, {BATCH_FIX}"
            )
    if batched:
        if streamer is not None:
            raise ValueError("streamer is not supported for a batch of prompts; stream one prompt at a time.")
    else:
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool((mask == 1).all()):
            raise UserInputError(_masked_prompt_message(input_ids, mask, generation_config))
    _check_cache_and_inputs(model_kwargs)


def _check_cache_and_inputs(model_kwargs: dict) -> None:
    """A fresh cache from generate(), and no model inputs the loop would not forward."""
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("speculative decoding needs a cache; do not pass use_cache=False.")
    if cache.get_seq_length() > 0:
        raise ValueError("continuing from a pre-filled cache is not supported with hf_dspark drafters.")
    unexpected = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _PASSED_BY_GENERATE)
    if unexpected:
        raise ValueError(f"hf_dspark speculative decoding does not forward these model inputs: {unexpected}")


def _masked_prompt_message(input_ids, mask, generation_config: GenerationConfig) -> str:
    """Why a single prompt arrived with masked positions, and the fix. When no attention_mask is passed, stock
    generate() infers one that masks every position holding the pad token id, so a pad id inside the text (a
    tokenizer whose pad is a real token, or ids built by hand) ends up here although the user passed no mask."""
    masked = (mask[0] == 0).nonzero().flatten().tolist()
    shown = ", ".join(map(str, masked[:8])) + (", ..." if len(masked) > 8 else "")
    where = f"position{'s' if len(masked) > 1 else ''} {shown}"
    pad = pad_token_tensor(generation_config)
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
