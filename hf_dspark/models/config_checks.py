"""Every config field a drafter loader reads, checked before any module is built: its type, its range and its
consistency with the fields beside it. A bad value is one `DrafterLoadError` naming the file (or the config class),
the field, the value and the fix, instead of an error deep inside torch or transformers (a KeyError for an unknown
activation, a negative-dimension RuntimeError, a ZeroDivisionError, a TypeError in the decoding loop).

One module for every reader: hf_dspark's own configs (`DraftPreTrainedConfig.__post_init__`, so a config built in
Python is refused the same way), the reader of hf_dspark's own folders (`saved_config.check_saved_config`, on the raw
config.json) and every other layout's reader (`formats/`), which name their fields with `aliases`. Whether the
weights fit the config is `weight_files.check_fits_before_building`'s (shapes from the safetensors headers).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping

from .errors import DrafterLoadError

MAX_BLOCK_SIZE = 64
"""The most slots a drafter's block may have (`block_size`; Eagle3's chain length). Published drafters use 7
(DeepSpec) to 16 (z-lab DFlash). Acceptance decays geometrically along a block, so slots past a few dozen are
practically never accepted, while every slot costs drafting and verification work each round: a block of 20,000
made a 200-token generate() run for minutes. The block must also fit within `max_position_embeddings`."""

MAX_DRAFT_LAYERS = 256
MAX_TARGET_LAYERS = 1024
"""The deepest drafter (`num_hidden_layers`; published ones have 1 to 8 layers) and target (`num_target_layers` /
`target_num_hidden_layers`; the deepest published LLMs have under 200) a config may describe: configs derive
per-layer lists from these counts before any weight is read, so an absurd one would exhaust memory first."""

SEQUENTIAL_HEADS = ("markov", "gated", "rnn")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
LAYER_STYLES = ("llama", "gemma4")
"""A drafter layer's norms and attention details (`DraftPreTrainedConfig.layer_style`)."""
CONFIDENCE_THRESHOLD_RULES = ("cumulative", "per_slot")
"""How a static `assistant_confidence_threshold` t stops drafting: `"cumulative"` at the first slot j whose survival
c_1 ... c_j < t (hf_dspark), `"per_slot"` at the first slot whose own c_j < t (DeepSpec's --confidence-threshold)."""

ROPE_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                      "longrope": ("short_factor", "long_factor"),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
"""The keys each rope type needs that transformers does not fill in itself (it adds rope_theta and
original_max_position_embeddings from the config)."""
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "partial_rotary_factor")

Rule = Callable[[Any], "str | None"]
"""A field's rule: the problem with a value (a phrase after "which"; `{field}` names the field), None when fine."""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """A real number (never a bool or a string of digits) that is finite: the one test of every numeric field a
    checkpoint or a saved state may hold (an int too large for a float is not finite)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _kind(value) -> str:
    return "true/false" if isinstance(value, bool) else f"a {type(value).__name__}"


def integer(low: int, high: int | None = None, optional: bool = False) -> Rule:
    """An int (never a bool, a float or a string of digits) from `low` to `high`; None too when `optional`."""
    def rule(value):
        if value is None:
            return None if optional else "is missing: {field} needs a value"
        if not _is_int(value):
            return f"is {_kind(value)}, not an integer"
        if value < low or (high is not None and value > high):
            top = f" and at most {high}" if high is not None else ""
            return f"is out of range: {{field}} must be at least {low}{top}"
        return None
    return rule


def number(low: float | None = None, above: bool = True, optional: bool = False) -> Rule:
    """A finite real number (not a bool or a string), above `low` (or at least it, `above=False`)."""
    def rule(value):
        if value is None:
            return None if optional else "is missing: {field} needs a value"
        if not is_finite_number(value):
            return f"is {_kind(value)}, not a finite number"
        if low is not None and (value <= low if above else value < low):
            return f"is out of range: {{field}} must be {'above' if above else 'at least'} {low}"
        return None
    return rule


def flag(optional: bool = False) -> Rule:
    """true or false (a JSON boolean; not 0/1 or a string)."""
    def rule(value):
        if value is None and optional or isinstance(value, bool):
            return None
        return f"is {_kind(value)}, not a boolean"
    return rule


def choice(options, optional: bool = False) -> Rule:
    """One of the strings `options`; None too when `optional`."""
    def rule(value):
        if value is None and optional or isinstance(value, str) and value in options:
            return None
        return f"is not allowed: {{field}} must be one of {list(options)}{' or null' if optional else ''}"
    return rule


def list_of(item: Rule, what: str, optional: bool = False, nonempty: bool = True) -> Rule:
    """A (non-empty) JSON list whose every entry passes `item` (`what` names the entries in messages)."""
    def rule(value):
        if value is None and optional:
            return None
        if not isinstance(value, (list, tuple)) or (nonempty and not value):
            return f"is not a{' non-empty' if nonempty else ''} list of {what}"
        bad = [entry for entry in value if item(entry) is not None]
        return f"has entries {bad[:4]} that are not {what}" if bad else None
    return rule


def _mapping(optional: bool = True) -> Rule:
    return lambda value: None if (value is None and optional) or isinstance(value, dict) else \
        f"is {_kind(value)}, not a JSON object"


def _text(optional: bool = True) -> Rule:
    return lambda value: None if (value is None and optional) or isinstance(value, str) else \
        f"is {_kind(value)}, not a string"


def _activation(value):
    from transformers.activations import ACT2FN

    if isinstance(value, str) and value in ACT2FN:
        return None
    return f"is not an activation transformers knows ({', '.join(sorted(ACT2FN)[:12])}, ...)"


def _dtype(value):
    import torch

    if value is None or isinstance(value, torch.dtype):
        return None
    found = getattr(torch, value, None) if isinstance(value, str) else None
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return None
    return "is not a torch floating-point dtype (float32, bfloat16, float16)"


def _rope(value, legacy: bool = False):
    """rope_parameters (or the transformers 4 rope_scaling, `legacy`): a known rope type with its numbers; a
    per-layer-type dict (Gemma) is checked entry by entry."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if value is None:
        return None
    if not isinstance(value, dict):
        return f"is {_kind(value)}, not a JSON object of rotary parameters"
    nested = [entry for entry in value.values() if isinstance(entry, dict)]
    if nested and len(nested) == len(value):
        return next((problem for problem in map(_rope, nested) if problem), None)
    rope_type = value.get("rope_type", value.get("type", "default"))
    if not isinstance(rope_type, str):
        return f"names rope_type {rope_type!r}, not a string (one of {['default', *ROPE_INIT_FUNCTIONS]})"
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        return f"names rope_type {rope_type!r}, unknown to transformers (it knows {['default', *ROPE_INIT_FUNCTIONS]})"
    missing = [key for key in ROPE_REQUIRED_KEYS.get(rope_type, ()) if key not in value]
    if missing:
        return f"lacks {missing}, needed by rope_type {rope_type!r}"
    bad = [key for key in _ROPE_NUMBERS if key in value and not (is_finite_number(value[key]) and value[key] >= 0)]
    bad += [key for key in ("rope_theta", "factor", "original_max_position_embeddings")  # divisors
            if key in value and key not in bad and not value[key] > 0]
    bad += [key for key in ("short_factor", "long_factor") if key in value and not (
        isinstance(value[key], list) and all(is_finite_number(entry) for entry in value[key]))]
    return f"has {bad} that {'are' if len(bad) > 1 else 'is'} not a positive number (or list of numbers)" if bad \
        else None


FROM_TARGET = "copy {field} from the config.json of the target model the drafter was trained for"
FROM_WEIGHTS = "write the {field} the drafter was trained and saved with (its weights' shapes tell it)"
BOOLEAN = "write true or false (a JSON boolean)"
BLOCK = (f"write the block size the drafter was trained with (DeepSpec uses 7, z-lab DFlash 16); hf_dspark takes "
         f"1 to {MAX_BLOCK_SIZE} slots, since acceptance decays along a block and every slot costs work each round")

FIELD_RULES: dict[str, tuple[Rule, str]] = {
    "vocab_size": (integer(1), FROM_TARGET), "hidden_size": (integer(1), FROM_TARGET),
    "intermediate_size": (integer(1), FROM_WEIGHTS), "num_hidden_layers": (integer(1, MAX_DRAFT_LAYERS), FROM_WEIGHTS),
    "num_attention_heads": (integer(1), FROM_TARGET), "num_key_value_heads": (integer(1, optional=True), FROM_TARGET),
    "head_dim": (integer(1, optional=True), FROM_TARGET), "hidden_act": (_activation, FROM_TARGET + ' (e.g. "silu")'),
    "rms_norm_eps": (number(0.0), FROM_TARGET), "max_position_embeddings": (integer(1), FROM_TARGET),
    "rope_parameters": (_rope, FROM_TARGET), "rope_scaling": (lambda v: _rope(v, legacy=True), FROM_TARGET),
    "rope_theta": (number(0.0, optional=True), FROM_TARGET), "attention_bias": (flag(), BOOLEAN),
    "qk_norm": (flag(), BOOLEAN), "tie_word_embeddings": (flag(optional=True), BOOLEAN),
    "layer_style": (choice(LAYER_STYLES), "write the layer style the drafter was trained with"),
    "attention_k_eq_v": (flag(), BOOLEAN),
    "sample_from_anchor": (flag(), BOOLEAN), "confidence_head": (flag(), BOOLEAN),
    "suffix_drafting": (flag(), BOOLEAN), "markov_w1_full_vocab": (flag(), BOOLEAN),
    "block_size": (integer(1, MAX_BLOCK_SIZE), BLOCK),
    "target_layer_ids": (list_of(integer(-1), "target layer indices (0, 1, ...; -1 for the embedding output)",
                                  optional=True), "list the target layers the drafter was trained to read"),
    "target_num_hidden_layers": (integer(1, MAX_TARGET_LAYERS, optional=True),
                                 FROM_TARGET.replace("{field}", "num_hidden_layers")),
    "target_model_type": (_text(), FROM_TARGET.replace("{field}", "model_type")),
    "draft_vocab_size": (integer(1, optional=True), "write the draft vocabulary size the weights were saved with "
                                                    "(the length of draft_to_target / d2t), or null for none"),
    "mask_token_id": (integer(0), "write the token id whose embedding filled the block's mask slots in training"),
    "markov_head": (choice(SEQUENTIAL_HEADS, optional=True), "write the sequential head it was trained with"),
    "markov_rank": (integer(0), FROM_WEIGHTS),
    "confidence_temperatures": (list_of(number(0.0), "positive numbers", optional=True),
                                "refit them with hf_dspark.evaluation.calibration.fit_sequential_temperatures, or write null"),
    "confidence_threshold_rule": (choice(CONFIDENCE_THRESHOLD_RULES), "write one of the rules"),
    "final_logit_softcapping": (number(0.0, optional=True), "write a positive cap, or null for none"),
    "input_embedding_scale": (number(optional=True), "write a finite scale, or null for none"),
    "block_causal": (lambda v: None if isinstance(v, bool) else list_of(flag(), "booleans")(v),
                     "write true, false, or one boolean per layer"),
    "layer_types": (list_of(choice(ATTENTION_LAYER_TYPES), f"one of {list(ATTENTION_LAYER_TYPES)}", optional=True),
                    "write one attention type per layer, or null for full attention everywhere"),
    "sliding_window": (integer(1, optional=True), "write the window of the sliding_attention layers, or null"),
    "initializer_range": (number(0.0, above=False), "write a non-negative standard deviation, e.g. 0.02"),
    "dtype": (_dtype, 'write the weights\' dtype (e.g. "bfloat16"), or delete the field'),
    "torch_dtype": (_dtype, 'write the weights\' dtype (e.g. "bfloat16"), or delete the field'),
    "deepspec_fields": (_mapping(), "write a JSON object, or null"),
    # DFlash 2 (z-lab's DFlash2DraftModel and hf_dspark's DFlash2DraftConfig)
    "conv_kernel_size": (integer(1, MAX_BLOCK_SIZE), "write the convolution's taps the drafter was trained with"),
    "conv_group_size": (integer(1), FROM_WEIGHTS),
    "selector_rank": (integer(1), FROM_WEIGHTS),
    "selector_top_k": (integer(1), "write the candidates per slot the drafter was trained with"),
}
"""The rule and the fix of every field a drafter config has, by hf_dspark's name for it."""


def refusal(source: str, field: str, value, problem: str, fix: str) -> DrafterLoadError:
    """The one error for a bad field: `{source} has {field}={value}, which {problem}; {fix}.`"""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return DrafterLoadError(f"{source} has {field}={shown}, which {problem.replace('{field}', field)}; "
                            f"{fix.replace('{field}', field)}.")


def check_config_fields(values: Mapping[str, Any], source: str, *, kind: str | None = None,
                        aliases: Mapping[str, str] | None = None, skip=(), prefix: str = "",
                        rules: Mapping[str, tuple[Rule, str]] | None = None) -> None:
    """Refuse the first field of `values` (a config.json dict, or a config's fields) that breaks its rule
    (`FIELD_RULES`), then any two that contradict each other (`check_consistency`), naming `source`.

    Args:
        kind: "dspark", "dflash2" or "eagle3" adds that family's own consistency rules (hf_dspark's own configs).
        aliases: another layout's name of a field -> hf_dspark's (`{"ttt_length": "block_size"}`); messages use
            the layout's own name.
        skip: fields of `values` this layout reads by its own rules.
        prefix: how the fields are reached in the file, e.g. "transformer_layer_config.".
        rules: a layout's own (rule, fix) of some fields (by hf_dspark's name), over `FIELD_RULES`.
    """
    aliases, rules = aliases or {}, {**FIELD_RULES, **(rules or {})}
    fields = {aliases.get(name, name): (prefix + name, value) for name, value in values.items() if name not in skip}
    for ours, (shown, value) in fields.items():
        if ours in rules:
            rule, fix = rules[ours]
            problem = rule(value)
            if problem:
                raise refusal(source, shown, value, problem, fix)
    check_consistency(fields, source, kind)


def check_consistency(fields: dict[str, tuple[str, Any]], source: str, kind: str | None = None) -> None:
    """Fields that are each valid but contradict each other (`fields`: our name -> (shown name, value))."""
    value = {name: shown_value[1] for name, shown_value in fields.items()}
    for name, problem, fix in _contradictions(value, kind):
        shown, found = fields.get(name, (name, None))  # a field the file lacks contradicts as its null
        raise refusal(source, shown, found, problem, fix)


def _contradictions(value: dict, kind: str | None):
    """(field, problem, fix) for each contradiction among `value` (our names; absent or None fields are skipped)."""
    heads, kv = value.get("num_attention_heads"), value.get("num_key_value_heads")
    if heads and kv and heads % kv:
        yield ("num_key_value_heads", f"does not divide num_attention_heads={heads} (grouped attention shares each "
               "key/value head among a whole number of query heads)", FROM_TARGET)
    block, positions = value.get("block_size"), value.get("max_position_embeddings")
    if block and positions and block >= positions:
        yield ("block_size", f"does not fit max_position_embeddings={positions} (a block's positions follow at least "
               "one context token)", BLOCK)
    layers, types = value.get("num_hidden_layers"), value.get("layer_types")
    if isinstance(types, (list, tuple)) and layers and len(types) != layers:
        yield ("layer_types", f"does not have one entry per layer (num_hidden_layers={layers})",
               FIELD_RULES["layer_types"][1])
    vocab, draft = value.get("vocab_size"), value.get("draft_vocab_size")
    if vocab and draft is not None and draft > vocab:
        yield ("draft_vocab_size", f"is larger than vocab_size={vocab}", FIELD_RULES["draft_vocab_size"][1])
    if kind in ("dspark", "dflash2"):
        yield from _dspark_contradictions(value)
    if kind == "dflash2":
        yield from _dflash2_contradictions(value)


def _dspark_contradictions(value: dict):
    """DSpark / DFlash: the sequential head, the slot convention and the per-layer attention settings."""
    if value.get("markov_head") is not None and not value.get("markov_rank"):
        yield ("markov_rank", f"is too small: markov_head={value['markov_head']!r} needs markov_rank > 0",
               "write the head's rank, or set markov_head to null for a DFlash drafter")
    block, from_anchor = value.get("block_size"), value.get("sample_from_anchor", True)
    if block is not None and block < 2 - from_anchor:
        yield ("block_size", "is out of range: block_size must be at least 2 when sample_from_anchor is false (slot "
               "0 is never used)", BLOCK)
    temperatures = value.get("confidence_temperatures")
    if temperatures is not None and block is not None and len(temperatures) != block - (not from_anchor):
        yield ("confidence_temperatures", f"does not have one per drafted slot ({block - (not from_anchor)})",
               FIELD_RULES["confidence_temperatures"][1])
    layers, causal, types = value.get("num_hidden_layers"), value.get("block_causal"), value.get("layer_types")
    if isinstance(causal, (list, tuple)) and layers and len(causal) != layers:
        yield ("block_causal", f"does not have one entry per layer (num_hidden_layers={layers})",
               FIELD_RULES["block_causal"][1])
    sliding = bool(types) and "sliding_attention" in types
    if sliding != (value.get("sliding_window") is not None):
        yield ("sliding_window", f"must be a positive window exactly when layer_types has sliding_attention layers "
               f"(layer_types={types})", FIELD_RULES["sliding_window"][1])
    heads, hidden = value.get("num_attention_heads"), value.get("hidden_size")
    if heads and hidden and hidden % heads:
        yield ("num_attention_heads", f"does not divide hidden_size={hidden}", FROM_TARGET)


def _dflash2_contradictions(value: dict):
    """DFlash 2: the selector takes the place of DSpark's heads, the layers are Qwen3-style, the convolution's groups
    tile the hidden state and the selector's candidates fit the vocabulary."""
    if value.get("markov_head") is not None or value.get("confidence_head"):
        yield ("markov_head" if value.get("markov_head") is not None else "confidence_head",
               "is set, but a DFlash 2 drafter's candidate selector is its only step after the backbone (it has no "
               "DSpark sequential or confidence head)", "write null / false")
    if value.get("layer_style", "llama") != "llama":
        yield ("layer_style", "is not \"llama\": DFlash 2's convolutions wrap Qwen3-style pre-norm layers",
               'write "llama"')
    hidden, group = value.get("hidden_size"), value.get("conv_group_size")
    if hidden and group and hidden % group:
        yield ("conv_group_size", f"does not divide hidden_size={hidden} (the groups tile the hidden state)",
               FROM_WEIGHTS)
    vocab = value.get("draft_vocab_size") or value.get("vocab_size")
    top_k = value.get("selector_top_k")
    if vocab and top_k and top_k > vocab:
        yield ("selector_top_k", f"is larger than the vocabulary the drafter drafts over ({vocab})",
               "write at most the vocabulary size")


IDENTITY_RULES: dict[str, tuple[Rule, str]] = {
    "model_type": (_text(), 'write the model type the checkpoint was saved with, a string such as "qwen3"'),
    "architectures": (list_of(_text(optional=False), "class names", optional=True, nonempty=False),
                      'write the list of class names it was saved with, e.g. ["Qwen3DSparkModel"]'),
}
"""The fields every reader picks a checkpoint's layout by, before any layout's own rules run."""


def check_identity_fields(config: Mapping[str, Any], source: str) -> None:
    """Refuse a config.json whose `model_type` is not a string or whose `architectures` is not a list of strings,
    naming the field: every reader looks the layout up by them (a list there is no key of any table)."""
    check_config_fields({name: config[name] for name in IDENTITY_RULES if name in config}, source,
                        rules=IDENTITY_RULES)


def built_naming(source: str, make: Callable[[], Any]):
    """`make()` (a config built from a file's fields), a refusal of its checks naming `source` (the file) too."""
    try:
        return make()
    except DrafterLoadError as error:
        if str(source) in str(error):
            raise
        raise DrafterLoadError(f"{source}: {error}") from None


def config_source(kwargs: Mapping[str, Any], fallback: str) -> str:
    """How a config being built names where it came from: the config.json transformers read it from (`name_or_path`
    reaches `__post_init__`), else `fallback` (the class name)."""
    from pathlib import Path

    where = kwargs.get("name_or_path")
    if not where:
        return fallback
    return str(Path(where) / "config.json") if Path(where).is_dir() else f"{fallback} of {str(where)!r}"


__all__ = ["ATTENTION_LAYER_TYPES", "BLOCK", "BOOLEAN", "CONFIDENCE_THRESHOLD_RULES", "FIELD_RULES", "FROM_TARGET",
           "FROM_WEIGHTS", "LAYER_STYLES", "MAX_BLOCK_SIZE", "MAX_DRAFT_LAYERS", "MAX_TARGET_LAYERS",
           "SEQUENTIAL_HEADS",
           "built_naming", "check_config_fields", "check_consistency", "check_identity_fields", "choice",
           "config_source", "flag", "integer",
           "is_finite_number", "list_of", "number", "refusal"]
