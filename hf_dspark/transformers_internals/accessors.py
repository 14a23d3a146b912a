"""One named function per private attribute or method of transformers' models and configs that hf_dspark reads,
with the check that the installed release still has them (`accessor_problems`, pinned by
tests/coexistence/test_transformers_internals.py on both ends of the supported range).

What is relied on (transformers 5.24 and 5.25):

* `generate` writes the pad token id as a tensor into its copy of the generation config, `_pad_token_tensor`
  (`GenerationMixin._prepare_special_tokens`), before the decoding method runs: `pad_token_tensor`;
* a config's attention implementation is the property `_attn_implementation`: `attention_implementation`;
* `GenerationMixin._supports_logits_to_keep()` says whether the forward takes `logits_to_keep`:
  `supports_logits_to_keep`;
* `GenerationMixin._valid_auto_compile_criteria(model_kwargs, generation_config)` is `generate`'s own decision to run
  the compiled forward (it reads `model_kwargs["cache"]`): `generate_would_compile`;
* `GenerationMixin._optimize_model_for_decode()`, the context `generate` runs its decoding steps in (absent: none):
  `decoding_step_context`;
* `_is_stateful`, the class attribute with which releases before 5.25 mark models whose state cannot be rolled back
  (5.25 dropped it: every model reads False): `is_stateful`;
* `PreTrainedConfig._name_or_path`, the folder or Hub id a config was read from: `config_name_or_path`;
* `PreTrainedConfig._getattr_without_heterogeneous_validation(name, default)`, a config's global value of a field
  that a heterogeneous config (Gemma 4's) keeps per layer: `global_config_value`.
"""

from __future__ import annotations

import inspect

import torch


def pad_token_tensor(generation_config) -> torch.Tensor | None:
    """The pad token id(s) `generate` prepared for this call, as a tensor; None outside `generate` (or without
    one)."""
    return getattr(generation_config, "_pad_token_tensor", None)


def attention_implementation(config) -> str | None:
    """The attention implementation `config`'s attention layers look up at every forward ("sdpa", "eager", ...)."""
    return config._attn_implementation


def supports_logits_to_keep(model) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (compute the LM head on the last positions only)."""
    return model._supports_logits_to_keep()


def generate_would_compile(model, cache, generation_config) -> bool:
    """Whether stock `generate` would run `model`'s compiled forward for its decoding steps on `cache` (a GPU, or a
    `compile_config` asking for every device; `disable_compile` turns it off)."""
    return model._valid_auto_compile_criteria({"cache": cache}, generation_config)


def decoding_step_context(model):
    """The context (a callable returning a context manager) stock `generate` runs its decoding steps in; None on a
    release without it."""
    return getattr(model, "_optimize_model_for_decode", None)


def is_stateful(model) -> bool:
    """Whether transformers marks `model` as stateful (a state that cannot be rolled back: releases before 5.25)."""
    return getattr(model, "_is_stateful", False)


def config_name_or_path(config) -> str | None:
    """The folder or Hub id `config` was read from, None when it has none."""
    return getattr(config, "_name_or_path", None)


def global_config_value(config, name: str):
    """`config.<name>`, the global value even where transformers keeps the attribute per layer (Gemma 4's head_dim
    and num_key_value_heads, whose plain attribute reads the sliding layers' values); None when it has none."""
    getter = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return getter(name, None) if getter is not None else getattr(config, name, None)


# ------------------------------------------------------------------------------------------------------------------
# The check
# ------------------------------------------------------------------------------------------------------------------


def accessor_problems(model) -> list[str]:
    """What the installed transformers no longer does of what this module relies on, tried on `model` (a tiny
    causal LM whose forward takes `logits_to_keep`, with a pad token id); empty when all holds."""
    from transformers import DynamicCache, GenerationConfig, PreTrainedConfig

    problems = []
    try:
        if supports_logits_to_keep(model) is not True:
            problems.append("GenerationMixin._supports_logits_to_keep() no longer says True for a forward that "
                            "takes logits_to_keep")
    except AttributeError as error:
        problems.append(f"GenerationMixin._supports_logits_to_keep is gone: {error}")
    config = GenerationConfig(pad_token_id=3, eos_token_id=2)
    try:
        model._prepare_special_tokens(config, True, device="cpu")
        pad = pad_token_tensor(config)
        if not (isinstance(pad, torch.Tensor) and int(pad.flatten()[0]) == 3):
            problems.append(f"generate no longer prepares the pad token as generation_config._pad_token_tensor "
                            f"(found {pad!r})")
    except (AttributeError, TypeError) as error:
        problems.append(f"GenerationMixin._prepare_special_tokens changed: {type(error).__name__}: {error}")
    if not isinstance(attention_implementation(model.config), str):
        problems.append("a config's _attn_implementation no longer names its attention implementation")
    try:
        criteria = generate_would_compile(model, DynamicCache(config=model.config), GenerationConfig())
        if not isinstance(criteria, bool):
            problems.append(f"GenerationMixin._valid_auto_compile_criteria returns {criteria!r}, not a bool")
    except (AttributeError, TypeError) as error:
        problems.append(f"GenerationMixin._valid_auto_compile_criteria changed: {type(error).__name__}: {error}")
    context = decoding_step_context(model)
    if context is None or list(inspect.signature(context).parameters):
        problems.append("GenerationMixin._optimize_model_for_decode() is gone or takes arguments")
    if is_stateful(model) is not False:
        problems.append("a model that is not stateful reads _is_stateful as true")
    if config_name_or_path(PreTrainedConfig(name_or_path="some/folder")) != "some/folder":
        problems.append("a config no longer keeps the folder it was read from as _name_or_path")
    if not callable(getattr(PreTrainedConfig, "_getattr_without_heterogeneous_validation", None)):
        problems.append("PreTrainedConfig._getattr_without_heterogeneous_validation is gone: Gemma 4's per-layer "
                        "fields would be read as the sliding layers' values")
    return problems
