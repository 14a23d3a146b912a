"""What hf_dspark's two `generate()` routes need from the installed transformers and from a call, checked before
any token: the name the KV cache travels under (`loop_support_problems`; the private methods' parameters are checked
by `transformers_internals.generate_hooks.signature_drift`), and the options a speculative loop cannot follow
(`refuse_other_decoding_methods`).
A release that changes what the routes rely on fails loudly here, naming the version, what changed and the fix."""

from __future__ import annotations

import inspect

import transformers

from ..._version import __version__
from ...models.drafter_base import DraftPreTrainedModel
from ...models.errors import UserInputError
from ...models.formats import layout_name
from ...models.identity import drafting_core
from ...transformers_internals.accessors import config_name_or_path

# The transformers releases the tests have passed on: the oldest and the newest are the ends of the range below,
# which pyproject.toml declares (tests/coexistence/test_dependency_range.py keeps the three in step). A newer release joins only
# once `scripts/test_transformers_range.sh` has run the tests on it; CI runs them on the oldest, the README's test
# command on whatever setup installed.
TESTED_TRANSFORMERS = ("5.24.0", "5.25.0")
SUPPORTED_TRANSFORMERS = "transformers>=5.24.0,<=5.25.0"
_CUSTOM_GENERATE_FIX = (
    "or pass the drafter through transformers' public custom_generate hook, which needs none of the private methods: "
    "target.generate(input_ids, custom_generate=hf_dspark.custom_generate_for(drafter), max_new_tokens=...)"
)


class TransformersCompatibilityError(UserInputError):
    """The installed `transformers` changed a private method or convention hf_dspark's generate() routes rely on."""


def as_drafter(assistant) -> DraftPreTrainedModel | None:
    """Our drafter behind `assistant` (itself, or the base model of a PEFT/LoRA wrapper), else None."""
    if drafting_core(assistant) is not None:  # also our classes loaded as remote code
        return assistant
    base = assistant.get_base_model() if hasattr(assistant, "get_base_model") else None
    return base if drafting_core(base) is not None else None


# ------------------------------------------------------------------------------------------------------------------
# Checks: what the loop relies on, read from the installed transformers
# ------------------------------------------------------------------------------------------------------------------


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
    parameters = _cache_parameters(model_class)
    if "cache" in parameters:
        return []
    legacy = " (it takes `past_key_values`, the older name)" if "past_key_values" in parameters else ""
    return [
        f"{model_class.__name__}.prepare_inputs_for_generation takes no `cache` parameter{legacy}: generate() hands "
        "the KV cache to decoding methods under another name than `cache`, which hf_dspark's loop reads and passes "
        "to the target's forward."
    ]


def _cache_parameters(model_class: type):
    """The parameters of `model_class.prepare_inputs_for_generation` that name the cache: an override that takes only
    `**kwargs` and hands them on (Nemotron-H's) is read through to the first class up the MRO that names them."""
    found = {}
    for owner in model_class.__mro__:
        method = vars(owner).get("prepare_inputs_for_generation")
        if method is None:
            continue
        found = inspect.signature(method).parameters
        if "cache" in found or "past_key_values" in found:
            return found
    return found


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


def untested_release_message(version: str | None = None) -> str | None:
    """None when `version` (default: the installed transformers) is a release the tests passed on, else why not."""
    version = (version or transformers.__version__).split("+")[0]
    if version in TESTED_TRANSFORMERS:
        return None
    return (
        f"transformers {version} is not a release hf_dspark {__version__} was tested on "
        f"({', '.join(TESTED_TRANSFORMERS)}): its generate() routes fit it, but nothing has shown that its outputs "
        f'stay lossless. Install a tested one (pip install "{SUPPORTED_TRANSFORMERS}"), or test this one with '
        f"`bash scripts/test_transformers_range.sh {version}`."
    )


def raise_if_loop_unsupported(model) -> None:
    problems = loop_support_problems(type(model))
    if problems:
        raise TransformersCompatibilityError(incompatibility_message(problems, custom_generate_works=False))


def refuse_a_drafter_loaded_without_its_heads(assistant) -> None:
    """An assistant whose config names a drafter layout (DeepSpec's `Qwen3DSparkModel`, z-lab's `DFlashDraftModel`,
    a speculators drafter, ...) but that is not a drafter: a stock class (`AutoModel` maps DeepSpec's
    `model_type: qwen3` to `Qwen3Model`) loaded it and dropped the drafter's own weights, so stock assisted decoding
    would run it as a plain language model. Refused before any token, naming the loader that works."""
    config = getattr(assistant, "config", None)
    layout = layout_name(config) if config is not None else None
    if layout is None:
        return
    path = getattr(assistant, "name_or_path", None) or config_name_or_path(config) or "path"
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
    # transformers' own block drafter (DFlashTokenCandidateGenerator): it would run the hf_dspark drafter as a stock
    # DFlash assistant, or hf_dspark would drop the switch; neither is what the call asked for.
    found += [f"speculation_type={config.speculation_type!r}"] if getattr(config, "speculation_type", None) else []
    return found


def refuse_other_decoding_methods(generation_config) -> None:
    """Refuse, before any token, what stock generate() would otherwise settle with a warning only: with beams or
    contrastive search it drops the drafter, with DoLa / prompt lookup / early exit beside an assistant it drops the
    option, and its own candidate generators (`use_mtp`, `speculation_type`) would take the drafter for one of theirs.
    Either way the output would not be what the call asked for."""
    found = _other_decoding_options(generation_config)
    if found:
        raise UserInputError(
            f"{', '.join(found)} cannot be combined with an hf_dspark drafter: hf_dspark decodes greedily or by "
            "sampling with its own drafts, and stock generate() would silently drop either the drafter or these "
            "options. Unset them, or call generate() without assistant_model / custom_generate to use them."
        )
