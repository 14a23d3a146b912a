"""The two ways `target.generate()` reaches hf_dspark's decoding loop.

* `target.generate(ids, assistant_model=<hf_dspark drafter>)`, the main API: `import hf_dspark` wraps
  `GenerationMixin._assisted_decoding` and `_validate_generation_mode` at class level (`generate` looks the decoding
  method up on the target's class, so this reaches every causal LM). The wrappers only act when the assistant is one
  of our drafters; any other call runs stock `transformers` code unchanged.
* `target.generate(ids, custom_generate=custom_generate_for(drafter))`, transformers' documented hook for a decoding
  method of one's own. It needs no private method, so it is also the way out when the class-level wrappers cannot be
  installed. `generate` drops `assistant_model=` (and the streamer) for a callable `custom_generate`, so the drafter
  travels bound to the callable.

Both refuse, before any token, the options a speculative loop cannot follow (`_refuse_other_decoding_methods` here,
`STATEFUL_PROCESSORS` in `sampling.py`); every other processor runs once per scored position, draft and
verification slots alike, including positions later rejected: a user's processor must keep no state across calls.

Both rest on `transformers` internals: the first on the private methods' parameters, both on the name `generate`
hands the KV cache over under. These are checked where they are installed or used (`hook_signature_problems`,
`loop_support_problems`), so a `transformers` release that changes them fails loudly, naming the version, the
method, what changed and the fix, instead of decoding wrongly.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable

import transformers
from transformers.generation.utils import GenerationMixin

from .._version import __version__
from ..models.common import DraftPreTrainedModel, UserInputError, drafter_type
from ..models.formats import layout_name
from .decoding import speculative_decoding

# The range pyproject.toml declares (tests/test_integration.py keeps the two in step); named by the fix in messages.
SUPPORTED_TRANSFORMERS = "transformers>=5.24,<6"
_CUSTOM_GENERATE_FIX = (
    "or pass the drafter through transformers' public custom_generate hook, which needs none of the private methods: "
    "target.generate(input_ids, custom_generate=hf_dspark.custom_generate_for(drafter), max_new_tokens=...)"
)

# (class, method name) -> the stock method our wrapper replaced.
_ORIGINALS: dict[tuple[type, str], Callable] = {}
# class -> the problems its installation found: installing is once per class and process, and so is the warning.
_INSTALLED: dict[type, list[str]] = {}


class TransformersCompatibilityError(UserInputError):
    """The installed `transformers` changed a private method or convention hf_dspark's generate() routes rely on."""


def as_drafter(assistant) -> DraftPreTrainedModel | None:
    """Our drafter behind `assistant` (itself, or the base model of a PEFT/LoRA wrapper), else None."""
    if drafter_type(assistant) is not None:  # also our classes loaded as remote code
        return assistant
    base = assistant.get_base_model() if hasattr(assistant, "get_base_model") else None
    return base if drafter_type(base) is not None else None


# ------------------------------------------------------------------------------------------------------------------
# Checks: what the wrappers and the loop rely on, read from the installed transformers
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


def _signature_drift(owner: str, method: str, original: Callable, wrapper: Callable) -> str | None:
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


def loop_support_problems(model_class: type) -> list[str]:
    """What keeps hf_dspark's decoding loop (either route) from running under `model_class`'s generate().

    The loop reads the KV cache `generate` prepared from `model_kwargs["cache"]` and passes it to the target's forward
    as `cache=`: transformers 5.24's name, which `prepare_inputs_for_generation` takes. Older releases (5.17 and
    before) call it `past_key_values`, and their forwards silently ignore `cache=` (each forward would see only the
    new tokens), so such a release must be refused, not run.
    """
    prepare = getattr(model_class, "prepare_inputs_for_generation", None)
    if prepare is None:
        return [f"{model_class.__name__} has no prepare_inputs_for_generation, so it is not a generate()-capable model."]
    parameters = inspect.signature(prepare).parameters
    if "cache" in parameters:
        return []
    legacy = " (it takes `past_key_values`, the older name)" if "past_key_values" in parameters else ""
    return [
        f"{model_class.__name__}.prepare_inputs_for_generation takes no `cache` parameter{legacy}: generate() hands "
        "the KV cache to decoding methods under another name than `cache`, which hf_dspark's loop reads and passes "
        "to the target's forward."
    ]


def incompatibility_message(problems: list[str], custom_generate_works: bool) -> str:
    fix = f'install a supported transformers (pip install "{SUPPORTED_TRANSFORMERS}")'
    if custom_generate_works:
        fix += ", " + _CUSTOM_GENERATE_FIX
    return (
        f"hf_dspark {__version__} cannot route generate() of transformers {transformers.__version__}: "
        + " ".join(problems)
        + " generate() with an hf_dspark drafter is refused; other generate() calls run stock transformers code. "
        + f"Fix: {fix}."
    )


def _raise_if_loop_unsupported(model) -> None:
    problems = loop_support_problems(type(model))
    if problems:
        raise TransformersCompatibilityError(incompatibility_message(problems, custom_generate_works=False))


def _refuse_a_drafter_loaded_without_its_heads(assistant) -> None:
    """An assistant whose config names a drafter layout (DeepSpec's `Qwen3DSparkModel`, z-lab's `DFlashDraftModel`,
    a speculators drafter, ...) but that is not a drafter: a stock class (`AutoModel` maps DeepSpec's
    `model_type: qwen3` to `Qwen3Model`) loaded it and dropped the drafter's own weights, so stock assisted decoding
    would run it as a plain language model. Refused before any token, naming the loader that works."""
    config = getattr(assistant, "config", None)
    layout = layout_name(config) if config is not None else None
    if layout is None:
        return
    path = getattr(assistant, "name_or_path", None) or getattr(config, "_name_or_path", None) or "path"
    raise UserInputError(
        f"assistant_model is a {type(assistant).__name__}, but its config describes a {layout} drafter: a stock "
        "class loaded the folder and dropped the drafter's own weights (fusion, heads), so it cannot draft. Load it "
        f"with hf_dspark.AutoDrafter.from_pretrained({str(path)!r}) and pass that as assistant_model."
    )


def _other_decoding_options(config) -> list[str]:
    """The options of `config` that ask stock generate() for another decoding method than greedy search or sampling
    (beams, contrastive search, DoLa, constraints), or for another candidate source than the assistant."""
    found = [f"num_beams={config.num_beams}"] if (config.num_beams or 1) > 1 else []
    found += [f"num_beam_groups={config.num_beam_groups}"] if (config.num_beam_groups or 1) > 1 else []
    found += [f"{name}={getattr(config, name)!r}" for name in ("constraints", "force_words_ids", "dola_layers",
                                                               "prompt_lookup_num_tokens", "assistant_early_exit")
              if getattr(config, name, None) is not None]
    found += [f"penalty_alpha={config.penalty_alpha}"] if (config.penalty_alpha or 0) > 0 else []
    found += ["use_mtp=True"] if getattr(config, "use_mtp", False) else []
    return found


def _refuse_other_decoding_methods(generation_config) -> None:
    """Refuse, before any token, what stock generate() would otherwise settle with a warning only: with beams or
    contrastive search it drops the drafter, with DoLa / prompt lookup / early exit beside an assistant it drops the
    option. Either way the output would not be what the call asked for."""
    found = _other_decoding_options(generation_config)
    if found:
        raise UserInputError(
            f"{', '.join(found)} cannot be combined with an hf_dspark drafter: hf_dspark decodes greedily or by "
            "sampling with its own drafts, and stock generate() would silently drop either the drafter or these "
            "options. Unset them, or call generate() without assistant_model / custom_generate to use them."
        )


# ------------------------------------------------------------------------------------------------------------------
# Route 1: generate(..., assistant_model=<hf_dspark drafter>)
# ------------------------------------------------------------------------------------------------------------------


def _routing_validate_generation_mode(original: Callable) -> Callable:
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant = generation_mode_kwargs.get("assistant_model")
        drafter = as_drafter(assistant)
        if drafter is None and assistant is not None:
            _refuse_a_drafter_loaded_without_its_heads(assistant)
        if drafter is not None:
            _refuse_other_decoding_methods(generation_config)
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
            _raise_if_loop_unsupported(self)
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


_ROUTING_WRAPPERS = {
    "_assisted_decoding": _routing_assisted_decoding,
    "_validate_generation_mode": _routing_validate_generation_mode,
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
        drift = _signature_drift(mixin.__name__, name, original, make_wrapper(original))
        if drift is not None:
            problems.append(drift)
    return problems


def install_generate_hooks(mixin: type = GenerationMixin) -> list[str]:
    """Wrap `mixin`'s `_assisted_decoding` and `_validate_generation_mode` once per process; returns the problems
    found (empty when the routing wrappers are installed and the loop can run).

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
    _INSTALLED[mixin] = problems
    return problems


def _install(mixin: type, name: str, original: Callable, wrapper: Callable) -> None:
    wrapper._hf_dspark_stock = original
    _ORIGINALS[(mixin, name)] = original
    setattr(mixin, name, wrapper)


# ------------------------------------------------------------------------------------------------------------------
# Route 2: generate(..., custom_generate=custom_generate_for(drafter))
# ------------------------------------------------------------------------------------------------------------------


def _check_custom_generate_request(model, drafter: DraftPreTrainedModel, generation_config) -> None:
    """What stock generate() checks before assisted decoding, which it skips for a callable custom_generate (it then
    validates greedy or sampling, not assisted generation): the same refusals, so both routes accept the same calls."""
    _refuse_other_decoding_methods(generation_config)
    if generation_config.num_return_sequences > 1:
        raise UserInputError(
            f"custom_generate_for(drafter) returns one sequence per prompt, but num_return_sequences="
            f"{generation_config.num_return_sequences}. Drop it and call generate() again for more samples (or "
            "repeat the prompt in a batch)."
        )
    if getattr(model, "_is_stateful", False):
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
    `attention_mask`, `stopping_criteria`, ...). transformers hands a callable `custom_generate` no streamer: to
    stream, use `assistant_model=`.

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
        _refuse_a_drafter_loaded_without_its_heads(drafter)
        raise UserInputError(
            f"custom_generate_for expects an hf_dspark drafter (DSparkDraftModel or Eagle3DraftModel, or a PEFT "
            f"wrapper of one), got {type(drafter).__name__}. For another assistant model call "
            "target.generate(input_ids, assistant_model=assistant) without custom_generate."
        )

    # `generate` calls this as it calls its own decoding methods (the same parameters as `_sample`, so it hands this
    # nothing of its own beyond what they get); `model` is the target.
    def speculative_generate(
        model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, streamer=None,
        **model_kwargs,
    ):
        _raise_if_loop_unsupported(model)
        _check_custom_generate_request(model, resolved, generation_config)
        return speculative_decoding(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            drafter=resolved,
            streamer=streamer,
            **model_kwargs,
        )

    speculative_generate.__doc__ = f"hf_dspark speculative decoding with a {type(resolved).__name__} (custom_generate)."
    return speculative_generate
