"""Route `generate(..., assistant_model=<hf_dspark drafter>)` to hf_dspark's decoding loop.

`generate` looks `_assisted_decoding` up on the target's class, so a class-level wrapper on `GenerationMixin`
reaches every causal LM. The wrappers only act when the assistant is one of our drafters; any other call runs
stock `transformers` code unchanged.
"""

from __future__ import annotations

from transformers.generation.utils import GenerationMixin

from ..models.common import DraftPreTrainedModel, drafter_type
from .decoding import speculative_decoding

_ORIGINALS: dict[str, object] = {}


def as_drafter(assistant) -> DraftPreTrainedModel | None:
    """Our drafter behind `assistant` (itself, or the base model of a PEFT/LoRA wrapper), else None."""
    if drafter_type(assistant) is not None:  # also our classes loaded as remote code
        return assistant
    base = assistant.get_base_model() if hasattr(assistant, "get_base_model") else None
    return base if drafter_type(base) is not None else None


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    drafter = as_drafter(generation_mode_kwargs.get("assistant_model"))
    if drafter is not None:
        # Our own message comes first: stock validation would blame the tokenizer for any vocab mismatch.
        drafter.check_compatible(self.config)
    return _ORIGINALS["_validate_generation_mode"](self, generation_mode, generation_config, generation_mode_kwargs)


def _assisted_decoding(
    self,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    drafter = as_drafter(assistant_model)
    if drafter is not None:
        return speculative_decoding(
            self,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            drafter=drafter,
            streamer=streamer,
            **model_kwargs,
        )
    return _ORIGINALS["_assisted_decoding"](
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=synced_gpus,
        streamer=streamer,
        inputs_tensor=inputs_tensor,
        assistant_model=assistant_model,
        assistant_tokenizer=assistant_tokenizer,
        tokenizer=tokenizer,
        **model_kwargs,
    )


def install_generate_hooks() -> None:
    """Idempotent: wrap the two `GenerationMixin` methods once per process."""
    for name, wrapper in (("_assisted_decoding", _assisted_decoding), ("_validate_generation_mode", _validate_generation_mode)):
        if name not in _ORIGINALS:
            _ORIGINALS[name] = getattr(GenerationMixin, name)
            setattr(GenerationMixin, name, wrapper)
