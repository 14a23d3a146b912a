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

Both rest on `transformers` internals: the first on the private methods' parameters, both on the name `generate`
hands the KV cache over under. These are checked where they are installed or used (`hook_signature_problems`,
`loop_support_problems`), so a `transformers` release that changes them fails loudly, naming the version, the
method, what changed and the fix, instead of decoding wrongly.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

from transformers.generation.utils import GenerationMixin

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
    signature_drift,
    untested_release_message,
)
from .settings import PASSED_SETTINGS_KEY, SETTING_NAMES, call_settings

# (class, method name) -> the stock method our wrapper replaced.
_ORIGINALS: dict[tuple[type, str], Callable] = {}
# class -> the problems its installation found: installing is once per class and process, and so is the warning.
_INSTALLED: dict[type, list[str]] = {}


# ------------------------------------------------------------------------------------------------------------------
# Route 1: generate(..., assistant_model=<hf_dspark drafter>)
# ------------------------------------------------------------------------------------------------------------------


def _routing_validate_generation_mode(original: Callable) -> Callable:
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant = generation_mode_kwargs.get("assistant_model")
        drafter = as_drafter(assistant)
        if drafter is None and assistant is not None:
            refuse_a_drafter_loaded_without_its_heads(assistant)
        if drafter is not None:
            refuse_other_decoding_methods(generation_config)
            # Our own message comes first: stock validation would blame the tokenizer for any vocab mismatch.
            drafter.check_compatible(self.config)
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _routing_assisted_decoding(original: Callable) -> Callable:
    # Lists every parameter of the stock method by name (checked at install): `generate` passes `inputs_tensor` only
    # to a decoding method whose signature lists it, and the stock method needs it for encoder-decoder assistants.
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
            raise_if_loop_unsupported(self)
            passed = model_kwargs.pop(PASSED_SETTINGS_KEY, None)
            return speculative_decoding(
                self,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                drafter=drafter,
                streamer=streamer,
                drafting_settings=call_settings(generation_config, passed),
                **model_kwargs,
            )
        return original(
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

    return _assisted_decoding


def _refusing_assisted_decoding(original: Callable, message: str) -> Callable:
    """Stands in for a routing wrapper that no longer fits: our drafters get `message`, everything else the stock
    method. It takes any arguments, and reports the stock signature (`__wrapped__`), so `generate` calls it exactly as
    it would call the stock method."""

    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        # The assistant's parameter name is one of the things that may have changed: look at every argument.
        if any(as_drafter(value) is not None for value in (*args, *kwargs.values())):
            raise TransformersCompatibilityError(message)
        return original(self, *args, **kwargs)

    return _assisted_decoding


def _routing_extract_generation_mode_kwargs(original: Callable) -> Callable:
    def _extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        passed = {}
        if as_drafter(assistant_model) is not None:
            # `dspark_*` names are no generation config fields: taken out before generate validates model inputs.
            passed = {name: kwargs.pop(name) for name in SETTING_NAMES if name.startswith("dspark_") and name in kwargs}
            # transformers' own names stay for its config too; read here, they are known to be the call's own.
            passed.update({name: kwargs[name] for name in SETTING_NAMES if name in kwargs})
        found = original(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        if passed:
            found[PASSED_SETTINGS_KEY] = passed
        return found

    return _extract_generation_mode_kwargs


_ROUTING_WRAPPERS = {
    "_assisted_decoding": _routing_assisted_decoding,
    "_validate_generation_mode": _routing_validate_generation_mode,
    "_extract_generation_mode_kwargs": _routing_extract_generation_mode_kwargs,
}


def _stock_method(mixin: type, name: str) -> Callable | None:
    method = _ORIGINALS.get((mixin, name), getattr(mixin, name, None))
    return getattr(method, "_hf_dspark_stock", method)  # a wrapper left by an earlier copy of this module


def hook_signature_problems(mixin: type = GenerationMixin) -> list[str]:
    """One sentence per private method of `mixin` that the routing wrappers no longer fit (empty: they fit)."""
    problems = []
    for name, make_wrapper in _ROUTING_WRAPPERS.items():
        original = _stock_method(mixin, name)
        if original is None:
            problems.append(f"{mixin.__name__}.{name} no longer exists.")
            continue
        drift = signature_drift(mixin.__name__, name, original, make_wrapper(original))
        if drift is not None:
            problems.append(drift)
    return problems


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
        original = _stock_method(mixin, "_assisted_decoding")
        if original is not None:
            _install(mixin, "_assisted_decoding", original, _refusing_assisted_decoding(original, message))
    else:
        for name, make_wrapper in _ROUTING_WRAPPERS.items():
            original = _stock_method(mixin, name)
            _install(mixin, name, original, make_wrapper(original))
    problems = hook_problems + loop_problems
    if problems:
        warnings.warn(
            incompatibility_message(problems, custom_generate_works=not loop_problems), UserWarning, stacklevel=2
        )
    elif mixin is GenerationMixin and untested_release_message() is not None:
        warnings.warn(untested_release_message(), UserWarning, stacklevel=2)
    _INSTALLED[mixin] = problems
    return problems


def _install(mixin: type, name: str, original: Callable, wrapper: Callable) -> None:
    wrapper._hf_dspark_stock = original
    _ORIGINALS[(mixin, name)] = original
    setattr(mixin, name, wrapper)
