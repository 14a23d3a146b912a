"""Route 2: `target.generate(ids, custom_generate=custom_generate_for(drafter))`, transformers' public hook for a
decoding method of one's own, running the same loop as `assistant_model=` (see `integration.py`)."""

from __future__ import annotations

import inspect
from typing import Callable

from ...models.drafter_base import DraftPreTrainedModel
from ...models.errors import UserInputError
from ...transformers_internals.accessors import is_stateful
from .dispatch import speculative_decoding
from .route_checks import (
    as_drafter,
    raise_if_loop_unsupported,
    refuse_a_drafter_loaded_without_its_heads,
    refuse_other_decoding_methods,
)
from ..call.settings import PASSED_SETTINGS_KEY, SETTING_NAMES, call_settings


def _check_custom_generate_request(model, drafter: DraftPreTrainedModel, generation_config) -> None:
    """What stock generate() checks before assisted decoding, which it skips for a callable custom_generate (it then
    validates greedy or sampling, not assisted generation): the same refusals, so both routes accept the same calls."""
    refuse_other_decoding_methods(generation_config)
    if generation_config.num_return_sequences > 1:
        raise UserInputError(
            f"custom_generate_for(drafter) returns one sequence per prompt, but num_return_sequences="
            f"{generation_config.num_return_sequences}. Drop it and call generate() again for more samples (or "
            "repeat the prompt in a batch)."
        )
    if is_stateful(model):
        raise UserInputError(
            f"{type(model).__name__} is a stateful model: its state cannot be rolled back past rejected drafts, so "
            "speculative decoding cannot serve it. Call generate() without custom_generate."
        )
    drafter.check_compatible(model.config)


def custom_generate_for(drafter) -> Callable:
    """A decoding method for `target.generate(input_ids, custom_generate=..., ...)` that runs hf_dspark's speculative
    decoding loop with `drafter`, exactly as `target.generate(input_ids, assistant_model=drafter, ...)` does: the
    same tokens (greedy output equals plain greedy decoding), batches of left-padded prompts, the same
    `return_dict_in_generate` output and `drafter.last_generation_stats`.

    It uses only transformers' public `custom_generate` hook, so it keeps working where the `assistant_model=` route
    cannot be installed. Everything else goes to `generate` as usual (`max_new_tokens`, `do_sample`, `temperature`,
    `attention_mask`, `stopping_criteria`, ...), and so do the drafting settings (`num_assistant_tokens`,
    `dspark_suffix_drafting`, ...: `hf_dspark.generation.call.settings`). transformers hands a callable `custom_generate`
    no streamer: to stream, use `assistant_model=`.

    Args:
        drafter ([`DraftPreTrainedModel`]):
            A DSpark / DFlash / Eagle3 drafter (or a PEFT wrapper of one) built for the target.

    Example:

    ```python
    >>> decode = hf_dspark.custom_generate_for(drafter)
    >>> out = target.generate(input_ids, custom_generate=decode, max_new_tokens=64, do_sample=False)
    ```
    """
    resolved = as_drafter(drafter)
    if resolved is None:
        refuse_a_drafter_loaded_without_its_heads(drafter)
        raise UserInputError(
            f"custom_generate_for expects an hf_dspark drafter (DSparkDraftModel or Eagle3DraftModel, or a PEFT "
            f"wrapper of one), got {type(drafter).__name__}. For another assistant model call "
            "target.generate(input_ids, assistant_model=assistant) without custom_generate."
        )

    # `generate` calls this as it calls its own decoding methods (the same parameters as `_sample`, so it hands this
    # nothing of its own beyond what they get, and the drafting settings its signature lists); `model` is the target.
    def speculative_generate(
        model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, streamer=None,
        **model_kwargs,
    ):
        # With assistant_model= given too, the assistant route's wrapper has taken the settings out already.
        passed = model_kwargs.pop(PASSED_SETTINGS_KEY, None) or {}
        passed.update({name: model_kwargs.pop(name) for name in SETTING_NAMES if name in model_kwargs})
        raise_if_loop_unsupported(model)
        _check_custom_generate_request(model, resolved, generation_config)
        return speculative_decoding(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            drafter=resolved,
            streamer=streamer,
            drafting_settings=call_settings(generation_config, passed),
            **model_kwargs,
        )

    signature = inspect.signature(speculative_generate)
    *named, rest = signature.parameters.values()
    settings = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in SETTING_NAMES]
    speculative_generate.__signature__ = signature.replace(parameters=[*named, *settings, rest])
    speculative_generate.__doc__ = f"hf_dspark speculative decoding with a {type(resolved).__name__} (custom_generate)."
    return speculative_generate
