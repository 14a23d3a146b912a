"""The two ways `target.generate()` reaches hf_dspark's decoding loop.

* `target.generate(ids, assistant_model=<hf_dspark drafter>)`, the main API: `import hf_dspark` wraps
  `GenerationMixin._assisted_decoding`, `_validate_generation_mode` and `_extract_generation_mode_kwargs` at class
  level (`generate` looks the decoding method up on the target's class, so this reaches every causal LM). The
  wrappers only act when the assistant is one of our drafters; any other call runs stock `transformers` code
  unchanged. The last one takes the call's drafting settings (`dspark_*` keyword arguments, which transformers
  would otherwise refuse as unused model inputs, and the transformers-named `num_assistant_tokens` /
  `assistant_confidence_threshold`) out of the keyword arguments and hands them to the loop.
* `target.generate(ids, custom_generate=custom_generate_for(drafter))` (`custom_generate.py`), transformers'
  documented hook for a decoding method of one's own. It needs no private method, so it is also the way out when the
  class-level wrappers cannot be installed. `generate` drops `assistant_model=` (and the streamer) for a callable
  `custom_generate`, so the drafter travels bound to the callable. The callable declares every drafting setting as a
  parameter, which is how `generate` hands a custom decoding method its own keyword arguments.

Both refuse, before any token, the options a speculative loop cannot follow (`refuse_other_decoding_methods` in
`route_checks.py`, `STATEFUL_PROCESSORS` in `sampling.py`); every other processor runs once per scored position,
draft and verification slots alike, including positions later rejected: a user's processor must keep no state
across calls.

Both rest on `transformers` internals: the first on the private methods' parameters (the wrappers that take them
are `hf_dspark.transformers_internals.generate_hooks`'; this module decides what they hand over), both on the name
`generate` hands the KV cache over under. These are checked where they are installed or used
(`hook_signature_problems`, `loop_support_problems`), so a `transformers` release that changes them fails loudly,
naming the version, the method, what changed and the fix, instead of decoding wrongly.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

from transformers.generation.utils import GenerationMixin

from ...transformers_internals.generate_hooks import (
    ASSISTED_DECODING,
    EXTRACT_GENERATION_MODE_KWARGS,
    NOT_ROUTED,
    VALIDATE_GENERATION_MODE,
    install,
    routing_assisted_decoding,
    routing_extract_generation_mode_kwargs,
    routing_validate_generation_mode,
    signature_problems,
    stock_method,
)
from .dispatch import speculative_decoding
from .route_checks import (  # noqa: F401  (names the routes' users and tests read from here)
    SUPPORTED_TRANSFORMERS,
    TransformersCompatibilityError,
    as_drafter,
    incompatibility_message,
    loop_support_problems,
    raise_if_loop_unsupported,
    refuse_a_drafter_loaded_without_its_heads,
    refuse_other_decoding_methods,
    untested_release_message,
)
from ..call.settings import PASSED_SETTINGS_KEY, SETTING_NAMES, call_settings

# class -> the problems its installation found: installing is once per class and process, and so is the warning.
_INSTALLED: dict[type, list[str]] = {}


# ------------------------------------------------------------------------------------------------------------------
# Route 1: generate(..., assistant_model=<hf_dspark drafter>). The wrappers themselves (the private methods'
# parameters) are `transformers_internals.generate_hooks`'; what they hand over is decided here.
# ------------------------------------------------------------------------------------------------------------------


def _check_call(model, assistant, generation_config) -> None:
    """Before the stock `_validate_generation_mode`: refuse what our drafters cannot serve."""
    drafter = as_drafter(assistant)
    if drafter is None and assistant is not None:
        refuse_a_drafter_loaded_without_its_heads(assistant)
    if drafter is not None:
        refuse_other_decoding_methods(generation_config)
        # Our own message comes first: stock validation would blame the tokenizer for any vocab mismatch.
        drafter.check_compatible(model.config)


def _route(model, assistant_model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
           model_kwargs):
    """In place of the stock `_assisted_decoding`: hf_dspark's loop for our drafters, `NOT_ROUTED` for the rest."""
    drafter = as_drafter(assistant_model)
    if drafter is None:
        return NOT_ROUTED
    raise_if_loop_unsupported(model)
    passed = model_kwargs.pop(PASSED_SETTINGS_KEY, None)
    return speculative_decoding(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        drafter=drafter,
        streamer=streamer,
        drafting_settings=call_settings(generation_config, passed),
        **model_kwargs,
    )


def _take_settings(assistant_model, kwargs: dict) -> dict:
    """Before the stock `_extract_generation_mode_kwargs`: the call's drafting settings, for our drafters."""
    passed = {}
    if as_drafter(assistant_model) is not None:
        # `dspark_*` names are no generation config fields: taken out before generate validates model inputs.
        passed = {name: kwargs.pop(name) for name in SETTING_NAMES if name.startswith("dspark_") and name in kwargs}
        # transformers' own names stay for its config too; read here, they are known to be the call's own.
        passed.update({name: kwargs[name] for name in SETTING_NAMES if name in kwargs})
    return passed


def _refusing_assisted_decoding(original: Callable, message: str) -> Callable:
    """Stands in for a routing wrapper that no longer fits: our drafters get `message`, everything else the stock
    method. It takes any arguments, and reports the stock signature (`__wrapped__`), so `generate` calls it exactly as
    it would call the stock method."""

    @functools.wraps(original)
    def refusing(self, *args, **kwargs):
        # The assistant's parameter name is one of the things that may have changed: look at every argument.
        if any(as_drafter(value) is not None for value in (*args, *kwargs.values())):
            raise TransformersCompatibilityError(message)
        return original(self, *args, **kwargs)

    return refusing


# private method name -> the function making its wrapper from the stock method
_ROUTING_WRAPPERS = {
    ASSISTED_DECODING: lambda original: routing_assisted_decoding(original, _route),
    VALIDATE_GENERATION_MODE: lambda original: routing_validate_generation_mode(original, _check_call),
    EXTRACT_GENERATION_MODE_KWARGS: lambda original: routing_extract_generation_mode_kwargs(
        original, _take_settings, PASSED_SETTINGS_KEY),
}


def hook_signature_problems(mixin: type = GenerationMixin) -> list[str]:
    """One sentence per private method of `mixin` that the routing wrappers no longer fit (empty: they fit)."""
    return signature_problems(mixin, _ROUTING_WRAPPERS)


def install_generate_hooks(mixin: type = GenerationMixin) -> list[str]:
    """Wrap `mixin`'s `_assisted_decoding`, `_validate_generation_mode` and `_extract_generation_mode_kwargs` once per
    process; returns the problems found (empty when the routing wrappers are installed and the loop can run).

    When the installed transformers changed what the wrappers or the loop rely on, this warns once and leaves stock
    behaviour in place, with `generate(..., assistant_model=<hf_dspark drafter>)` refused with the same message.
    It does not raise: `import hf_dspark` must keep working for loading, converting and training drafters, and for
    every program that imports it without using the hook, whose generate() calls are not ours to break.
    """
    if mixin in _INSTALLED:
        return _INSTALLED[mixin]
    hook_problems = hook_signature_problems(mixin)
    loop_problems = loop_support_problems(mixin)
    if hook_problems:
        message = incompatibility_message(hook_problems + loop_problems, custom_generate_works=not loop_problems)
        original = stock_method(mixin, ASSISTED_DECODING)
        if original is not None:
            install(mixin, ASSISTED_DECODING, original, _refusing_assisted_decoding(original, message))
    else:
        for name, make_wrapper in _ROUTING_WRAPPERS.items():
            original = stock_method(mixin, name)
            install(mixin, name, original, make_wrapper(original))
    problems = hook_problems + loop_problems
    if problems:
        warnings.warn(
            incompatibility_message(problems, custom_generate_works=not loop_problems), UserWarning, stacklevel=2
        )
    elif mixin is GenerationMixin and untested_release_message() is not None:
        warnings.warn(untested_release_message(), UserWarning, stacklevel=2)
    _INSTALLED[mixin] = problems
    return problems
