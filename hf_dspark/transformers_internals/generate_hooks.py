"""The private `GenerationMixin` methods that route `target.generate(..., assistant_model=<hf_dspark drafter>)` into
hf_dspark's loop, and what a release must keep of them.

`generate` looks its decoding method up on the target's class, so replacing three private methods of
`GenerationMixin` at class level reaches every causal LM:

* `_validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs)`: the call is checked
  (`routing_validate_generation_mode`) before the stock validation, which would blame the tokenizer for a vocabulary
  mismatch;
* `_extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)`: the call's
  drafting settings are taken out of `kwargs` before `generate` validates them as model inputs
  (`routing_extract_generation_mode_kwargs`);
* `_assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
  streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None, tokenizer=None,
  **model_kwargs)`: the decoding itself (`routing_assisted_decoding`).

Each wrapper here takes exactly the stock parameters (`generate` passes `inputs_tensor` only to a decoding method
whose signature lists it) and hands what hf_dspark decides to a function of the caller's (`hf_dspark.generation.
call.integration`); everything else runs the stock method. `signature_problems` compares each wrapper with the
installed method, so a release that changes one is refused by name instead of decoding wrongly. A wrapper keeps the
method it replaced as `_hf_dspark_stock`, so a second copy of hf_dspark (a reload) wraps the stock method again.
"""

from __future__ import annotations

import inspect
from typing import Callable

ASSISTED_DECODING = "_assisted_decoding"
VALIDATE_GENERATION_MODE = "_validate_generation_mode"
EXTRACT_GENERATION_MODE_KWARGS = "_extract_generation_mode_kwargs"

# What a routing decision returns for a call that is not hf_dspark's: the stock method runs.
NOT_ROUTED = object()

# (class, method name) -> the stock method a wrapper replaced.
_ORIGINALS: dict[tuple[type, str], Callable] = {}


def stock_method(mixin: type, name: str) -> Callable | None:
    """`mixin`'s own method `name`, wrapped by hf_dspark or not (None when the release has none)."""
    method = _ORIGINALS.get((mixin, name), getattr(mixin, name, None))
    return getattr(method, "_hf_dspark_stock", method)  # a wrapper left by an earlier copy of hf_dspark


def install(mixin: type, name: str, original: Callable, wrapper: Callable) -> None:
    """Put `wrapper` in place of `mixin.<name>` (whose stock method is `original`)."""
    wrapper._hf_dspark_stock = original
    _ORIGINALS[(mixin, name)] = original
    setattr(mixin, name, wrapper)


# ------------------------------------------------------------------------------------------------------------------
# The wrappers: the stock parameters, hf_dspark's decisions passed in
# ------------------------------------------------------------------------------------------------------------------


def routing_validate_generation_mode(original: Callable, check: Callable) -> Callable:
    """`check(model, assistant_model, generation_config)` runs before the stock validation (it raises to refuse)."""

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        check(self, generation_mode_kwargs.get("assistant_model"), generation_config)
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def routing_assisted_decoding(original: Callable, decode: Callable) -> Callable:
    """`decode(model, assistant_model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
    model_kwargs)` returns the call's outputs, or `NOT_ROUTED` for the stock method to run."""

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
        routed = decode(self, assistant_model, input_ids, logits_processor, stopping_criteria, generation_config,
                        streamer, model_kwargs)
        if routed is not NOT_ROUTED:
            return routed
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


def routing_extract_generation_mode_kwargs(original: Callable, take: Callable, key: str) -> Callable:
    """`take(assistant_model, kwargs)` returns (and may remove from `kwargs`) what the call hands hf_dspark, before
    the stock method reads `kwargs`; when it is not empty, the method's result carries it under `key`."""

    def _extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        passed = take(assistant_model, kwargs)
        found = original(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        if passed:
            found[key] = passed
        return found

    return _extract_generation_mode_kwargs


# ------------------------------------------------------------------------------------------------------------------
# The check: do the wrappers still take the installed methods' parameters?
# ------------------------------------------------------------------------------------------------------------------


def _parameter_layout(function: Callable) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function, follow_wrapped=False).parameters.values()]


def _parameter_list(function: Callable) -> str:
    """`(self, input_ids, *, x, **model_kwargs)`: names and kinds, without annotations or defaults (short messages)."""
    names, keyword_only_marked = [], False
    for name, kind in _parameter_layout(function):
        if kind is inspect.Parameter.KEYWORD_ONLY and not keyword_only_marked:
            names.append("*")
        keyword_only_marked |= kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_POSITIONAL)
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(kind, "")
        names.append(prefix + name)
    return f"({', '.join(names)})"


def signature_drift(owner: str, method: str, original: Callable, wrapper: Callable) -> str | None:
    """None when `wrapper` takes exactly the parameters of `original` (names and kinds, in order), else what changed.

    Exact equality, not just "the names we read are there": `generate` passes `inputs_tensor` only to a decoding
    method that lists it, and a parameter transformers adds would land in `**model_kwargs`, which the loop refuses.
    """
    found, expected = _parameter_layout(original), _parameter_layout(wrapper)
    if found == expected:
        return None
    found_names, expected_names = [n for n, _ in found], [n for n, _ in expected]
    changes = []
    missing = [n for n in expected_names if n not in found_names]
    added = [n for n in found_names if n not in expected_names]
    if missing:
        changes.append("lost " + ", ".join(f"`{n}`" for n in missing))
    if added:
        changes.append("gained " + ", ".join(f"`{n}`" for n in added))
    if not changes:
        changes.append("reordered its parameters or changed their kinds")
    return (
        f"{owner}.{method} {' and '.join(changes)}: it takes {_parameter_list(original)}, hf_dspark's wrapper "
        f"takes {_parameter_list(wrapper)}."
    )


def signature_problems(mixin: type, wrappers: dict[str, Callable[[Callable], Callable]]) -> list[str]:
    """One sentence per method of `mixin` that its wrapper (`wrappers`: method name -> the function making the
    wrapper of the stock method) no longer fits; empty when they all fit."""
    problems = []
    for name, make_wrapper in wrappers.items():
        original = stock_method(mixin, name)
        if original is None:
            problems.append(f"{mixin.__name__}.{name} no longer exists.")
            continue
        drift = signature_drift(mixin.__name__, name, original, make_wrapper(original))
        if drift is not None:
            problems.append(drift)
    return problems
