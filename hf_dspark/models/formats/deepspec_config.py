"""What a DeepSpec drafter's config.json says, read into hf_dspark's configs (`dspark_config`, `eagle3_config`):
every field is used, checked, or known not to change the drafter's outputs, and every value is checked
(`config_checks`) before anything is built. The weights are `deepspec.py`'s."""

from __future__ import annotations

from transformers import AutoConfig

from ..config_checks import (BOOLEAN, FROM_TARGET, FROM_WEIGHTS, built_naming, check_config_fields, flag, integer,
                             list_of)
from ..configuration_dspark import DSparkDraftConfig
from ..configuration_eagle3 import Eagle3DraftConfig
from ..errors import DrafterLoadError
from .deepspec_gemma4 import (GEMMA4_TEXT_FIELDS, INFORMATIONAL_FIELDS, check as check_gemma4,
                              normalized as gemma4_normalized, target_fields as gemma4_target_fields)

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
EAGLE3_ARCHITECTURE = "Qwen3Eagle3Model"
GEMMA4_DSPARK_ARCHITECTURE, GEMMA4_EAGLE3_ARCHITECTURE = "Gemma4DSparkModel", "Gemma4Eagle3Model"
GEMMA4_ARCHITECTURES = (GEMMA4_DSPARK_ARCHITECTURE, GEMMA4_EAGLE3_ARCHITECTURE)
"""DeepSpec's drafters for Gemma 4 targets: Gemma 4 layers (`layer_style="gemma4"`; `deepspec_gemma4`)."""
EAGLE3_ARCHITECTURES = (EAGLE3_ARCHITECTURE, GEMMA4_EAGLE3_ARCHITECTURE)
ARCHITECTURES = (DSPARK_ARCHITECTURE, EAGLE3_ARCHITECTURE, *GEMMA4_ARCHITECTURES)
MARKOV_TYPES = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}  # DeepSpec markov_head_type -> our markov_head

# --- config.json fields: each one is used, checked, or known not to change the drafter's outputs ---------------
ALIASES = {"ttt_length": "block_size", "num_target_layers": "target_num_hidden_layers"}
"""DeepSpec's names of hf_dspark fields, whose values `config_checks` checks by hf_dspark's rules."""
LENIENT_FLAGS = ("sample_from_anchor", "dspark_bonus_anchor", "enable_confidence_head", "confidence_head_with_markov")
"""Booleans read by `_flag`, which also takes the 0/1 and "true"/"false" other tools write."""
DEEPSPEC_RULES = {
    "markov_rank": (integer(0, optional=True), FROM_WEIGHTS),  # absent or 0: DFlash
    "draft_vocab_size": (integer(0, optional=True), "write the draft vocabulary size the weights were saved with "
                         "(d2t's length), or 0 for none"),  # 0, or the whole vocabulary: none
    "draft_num_hidden_layers": (integer(1), FROM_WEIGHTS),
    "eagle_aux_hidden_state_layer_ids": (list_of(integer(0), "hidden_states indices", optional=True),
                                         "write target_layer_ids + 1, or delete the field"),
    "use_sliding_window": (flag(optional=True), BOOLEAN),
    # a copy of the target's config always has both (hf_dspark's own configs may leave them to defaults)
    "head_dim": (integer(1), FROM_TARGET),
    "target_layer_ids": (list_of(integer(-1), "target layer indices (0, 1, ...; -1 for the embedding output)"),
                         "list the target layers the drafter was trained to read"),
}
TARGET_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias")
"""The target's sizes, copied into our config (the drafter shares the target's embedding and LM head)."""
ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling")  # rope_theta/rope_scaling: transformers 4 spelling
DSPARK_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
                 "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor",
                 "dspark_bonus_anchor", "draft_vocab_size")
EAGLE3_FIELDS = ("target_layer_ids", "num_target_layers", "ttt_length", "draft_num_hidden_layers",
                 "eagle_aux_hidden_state_layer_ids", "draft_vocab_size")
KEPT_FIELDS = ("num_anchors", "step_loss_decay", "target_model_name_or_path")
"""Training-only DeepSpec fields (anchors per sequence, Eagle3's step loss decay, the target's name): unused here,
kept in `config.deepspec_fields` so that `hf-dspark convert` writes them back (DeepSpec's loader asserts them)."""
IRRELEVANT_FIELDS = {
    # HF bookkeeping (every PreTrainedConfig writes these; none enters the forward)
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "auto_map", "id2label", "label2id",
    "problem_type", "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder",
    # generation / tokenizer / initialisation / training settings of the copied target config
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
    # the stored embed_tokens and lm_head are separate tensors whatever the target tied
    "tie_word_embeddings",
    # only read for sliding-window layers, which `_check_fields` refuses
    "sliding_window", "max_window_layers",
}
CHECKED_FIELDS = ("architectures", "model_type", "num_hidden_layers", "layer_types", "use_sliding_window")
"""Read to pick and size the drafter, or checked to hold the value our layers assume (full attention only)."""

def check_fields_of(config: dict, source: str, architecture: str) -> None:
    """Every field of a DeepSpec `architecture`'s config.json (`deepspec_gemma4.normalized` for a Gemma 4 one)
    accounted for and checked (`_check_fields`)."""
    extra = ()
    if architecture in GEMMA4_ARCHITECTURES:
        check_gemma4(config, source)
        extra = (*GEMMA4_TEXT_FIELDS, *INFORMATIONAL_FIELDS)
    if architecture in EAGLE3_ARCHITECTURES:
        _check_fields(config, source, (*EAGLE3_FIELDS, *extra), required=("ttt_length", "target_layer_ids"))
    else:
        _check_fields(config, source, (*DSPARK_FIELDS, *extra),
                      required=("block_size", "mask_token_id", "target_layer_ids"))


def _architecture(config: dict, source: str) -> str:
    architectures = config.get("architectures") or []
    ours = [name for name in architectures if name in ARCHITECTURES]
    if len(architectures) != 1 or not ours:
        raise DrafterLoadError(f"{source} lists architectures {architectures}; a DeepSpec drafter names exactly one "
                               f"of {list(ARCHITECTURES)}. Fix the field to the class that saved the checkpoint.")
    return ours[0]


def _check_fields(config: dict, source: str, drafter_fields: tuple[str, ...], required: tuple[str, ...]) -> None:
    """Refuse any field we cannot account for (it might change the drafter's outputs), a missing required one, and
    sliding-window layers."""
    _require(config, source, ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                              "num_hidden_layers", *required))
    known = {*TARGET_SHAPE_FIELDS, *ROPE_FIELDS, *drafter_fields, *KEPT_FIELDS, *IRRELEVANT_FIELDS, *CHECKED_FIELDS}
    known |= _target_class_fields(config)
    unknown = sorted(name for name in config if name not in known)
    if unknown:
        raise DrafterLoadError(
            f"{source} has field(s) {unknown} that hf_dspark's DeepSpec reader does not know, so it cannot tell "
            "whether they change the drafter's outputs and refuses rather than ignore them. If a field only "
            "records training or bookkeeping, delete it from config.json; otherwise the layout needs support in "
            "hf_dspark/models/formats/deepspec.py.")
    check_config_fields(config, source, aliases=ALIASES, skip=LENIENT_FLAGS, rules=DEEPSPEC_RULES)
    layer_types = config.get("layer_types")
    if config.get("use_sliding_window") or (layer_types and set(layer_types) != {"full_attention"}):
        raise DrafterLoadError(
            f"{source} has sliding-window draft layers (use_sliding_window={config.get('use_sliding_window')}, "
            f"layer_types={layer_types}); DeepSpec builds full-attention drafters and hf_dspark's attend to the whole "
            "context. Supporting it would take a sliding-window option in the drafter's attention.")
    if layer_types is not None and len(layer_types) != config["num_hidden_layers"]:
        raise DrafterLoadError(f"{source} has {len(layer_types)} layer_types for num_hidden_layers="
                               f"{config['num_hidden_layers']}; fix config.json to the checkpoint's depth.")


def _require(config: dict, source: str, names) -> None:
    missing = [name for name in names if name not in config]
    if missing:
        raise DrafterLoadError(f"{source} lacks {missing}, which DeepSpec writes (the target's sizes and the "
                               "drafter's fields); restore them from the target's config and the training config.")


def _target_class_fields(config: dict) -> set[str]:
    """Fields of the copied target config's own class when it is not Qwen3's (hf_dspark exports drafters of other
    qk-normed families in this layout, e.g. Gemma3): hf_dspark's drafter reads only their shared sizes, as it does
    for a drafter trained here for that target. DeepSpec's own checkpoints are always `model_type: qwen3`."""
    model_type = config.get("model_type", "qwen3")
    if model_type == "qwen3":
        return set()
    try:
        return set(AutoConfig.for_model(model_type).to_dict())
    except (ValueError, KeyError):
        return set()


def _flag(config: dict, name: str, source: str) -> bool | None:
    """A boolean field however JSON-ish tools wrote it; None when absent. Anything else is refused: guessing a
    slot-convention flag could silently ruin the drafter."""
    value = config.get(name)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise DrafterLoadError(f"{source} has {name}={value!r}, which is not a boolean; write true or false.")


def _sample_from_anchor(config: dict, source: str) -> bool:
    """DeepSpec's convention (slot k predicts anchor + k + 1) unless the config says slot j predicts anchor + j:
    `sample_from_anchor: false`, or vLLM's `dspark_bonus_anchor: true` (the anchor as a separate bonus slot)."""
    from_anchor, bonus = _flag(config, "sample_from_anchor", source), _flag(config, "dspark_bonus_anchor", source)
    if from_anchor is not None and bonus is not None and from_anchor == bonus:
        raise DrafterLoadError(f"{source} has sample_from_anchor={from_anchor} and dspark_bonus_anchor={bonus}, which "
                               "contradict each other (a bonus anchor means slot j predicts anchor + j); keep one.")
    if from_anchor is not None:
        return from_anchor
    return not bonus


def _target_config(config: dict, source: str):
    """The target's config rebuilt from the copied fields (depth: `num_target_layers`; a Gemma 4 one's default
    sliding / full layer pattern, the full-attention layers sized by `global_head_dim`)."""
    model_type = config.get("model_type", "qwen3")
    fields = {name: config[name] for name in (*TARGET_SHAPE_FIELDS, *_target_class_fields(config))
              if name in config and name not in ("model_type", "architectures", "num_hidden_layers", "layer_types",
                                                 "per_layer_config")}
    if (config.get("architectures") or [None])[0] in GEMMA4_ARCHITECTURES:
        fields.update(gemma4_target_fields(config))
    fields["rope_parameters"] = _rope_parameters(config, source)
    for name in ("rope_theta", "rope_scaling"):
        fields.pop(name, None)
    depth = config.get("num_target_layers")
    if depth is not None:
        fields["num_hidden_layers"] = depth
    try:
        return AutoConfig.for_model(model_type, **fields), depth
    except (ValueError, KeyError, TypeError) as error:
        raise DrafterLoadError(f"{source} has model_type {model_type!r}, whose config cannot be rebuilt from the "
                               f"copied target fields ({error}).") from None


def _rope_parameters(config: dict, source: str) -> dict:
    """`rope_parameters`, or the transformers 4 fields hf_dspark's exports also write (which must then agree)."""
    rope, theta, scaling = config.get("rope_parameters"), config.get("rope_theta"), config.get("rope_scaling")
    if rope is None:
        rope = {"rope_type": "default", **(scaling or {}), "rope_theta": theta if theta is not None else 10000.0}
        rope["rope_type"] = rope.pop("type", rope["rope_type"])
    full = rope.get("full_attention", rope)  # per-layer-type rope (Gemma): drafters use the full-attention one
    if theta is not None and full.get("rope_theta") != theta:
        raise DrafterLoadError(f"{source} has rope_theta={theta} but rope_parameters={rope}; they disagree, so the "
                               "drafter's positions are unknown. Keep the target's value in both.")
    return rope


def _kept_fields(config: dict) -> dict | None:
    return {name: config[name] for name in KEPT_FIELDS if name in config} or None


def _draft_vocab_size(config: dict) -> int | None:
    size = config.get("draft_vocab_size")
    return size if size and size < config["vocab_size"] else None


def _read(config: dict, source: str, default: str) -> dict:
    """The config.json as read (`deepspec_gemma4.normalized` for a Gemma 4 drafter), every field checked for its
    architecture (`default` when it names none)."""
    architecture = _architecture(config, source) if config.get("architectures") else default
    config = gemma4_normalized(config) if architecture in GEMMA4_ARCHITECTURES else config
    check_fields_of(config, source, architecture)
    return config


def dspark_config(config: dict, source: str = "checkpoint", *, zero_markov_head: bool = False) -> DSparkDraftConfig:
    """Our `DSparkDraftConfig` for a DeepSpec `Qwen3DSparkModel` / `Gemma4DSparkModel` config.json. `zero_markov_head`:
    the checkpoint's vanilla Markov head has W1 = 0 (how hf_dspark exports DFlash), so it adds nothing and the
    drafter is DFlash."""
    config = _read(config, source, DSPARK_ARCHITECTURE)
    rank = int(config.get("markov_rank") or 0)
    head_type = config.get("markov_head_type", "vanilla")
    if rank and (not isinstance(head_type, str) or head_type not in MARKOV_TYPES):
        raise DrafterLoadError(f"{source} has markov_head_type={head_type!r}; DeepSpec's heads are "
                               f"{sorted(MARKOV_TYPES)}, which hf_dspark reads. Another head needs its own support.")
    confidence = bool(_flag(config, "enable_confidence_head", source))
    if confidence and _flag(config, "confidence_head_with_markov", source) and not rank:
        raise DrafterLoadError(f"{source} has confidence_head_with_markov true without a Markov head (markov_rank "
                               "0); DeepSpec itself refuses that. Set it false for a DFlash drafter.")
    if zero_markov_head:
        rank = 0  # W1 = 0: no bias and nothing for the confidence head to read, i.e. DFlash
    target, depth = _target_config(config, source)
    return built_naming(source, lambda: DSparkDraftConfig.from_target_config(
        target, num_hidden_layers=config["num_hidden_layers"], target_num_hidden_layers=depth,
        block_size=config["block_size"], sample_from_anchor=_sample_from_anchor(config, source),
        target_layer_ids=list(config["target_layer_ids"]), mask_token_id=config["mask_token_id"],
        markov_head=MARKOV_TYPES[head_type] if rank else None, markov_rank=rank, confidence_head=confidence,
        qk_norm=True, attention_bias=bool(config.get("attention_bias", False)),
        draft_vocab_size=_draft_vocab_size(config),
        confidence_threshold_rule="per_slot",  # DeepSpec's --confidence-threshold compares each slot's own c_k
        deepspec_fields=_kept_fields(config)))


def eagle3_config(config: dict, source: str = "checkpoint") -> Eagle3DraftConfig:
    """Our `Eagle3DraftConfig` for a DeepSpec `Qwen3Eagle3Model` / `Gemma4Eagle3Model` config.json (`ttt_length` is
    our `block_size`)."""
    config = _read(config, source, EAGLE3_ARCHITECTURE)
    layers = config.get("num_hidden_layers")
    if layers != 1 or config.get("draft_num_hidden_layers", 1) != 1:
        raise DrafterLoadError(
            f"{source} has num_hidden_layers={layers} (draft_num_hidden_layers="
            f"{config.get('draft_num_hidden_layers')}): DeepSpec's Eagle3 feeds [embedding ; hidden] to every layer "
            "(and its evaluator runs only 1), while hf_dspark's Eagle3DraftModel feeds it to the first layer only. "
            "Supporting deeper ones would take an Eagle3DraftConfig option giving every layer the embedding input.")
    layer_ids = list(config["target_layer_ids"])
    if len(layer_ids) < 2:
        raise DrafterLoadError(f"{source} has target_layer_ids={layer_ids}; DeepSpec's Eagle3 fuses several target "
                               "layers (5), and with one its chain steps would re-project their own states through fc.")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != [i + 1 for i in layer_ids]:
        raise DrafterLoadError(f"{source} has eagle_aux_hidden_state_layer_ids={aux}, not target_layer_ids + 1 "
                               f"({[i + 1 for i in layer_ids]}); fix the one that does not match the training.")
    target, depth = _target_config(config, source)
    return built_naming(source, lambda: Eagle3DraftConfig.from_target_config(
        target, num_hidden_layers=1, target_num_hidden_layers=depth, block_size=config["ttt_length"],
        target_layer_ids=layer_ids, qk_norm=True, attention_bias=bool(config.get("attention_bias", False)),
        draft_vocab_size=_draft_vocab_size(config), deepspec_fields=_kept_fields(config)))


__all__ = ["ARCHITECTURES", "DSPARK_ARCHITECTURE", "EAGLE3_ARCHITECTURE", "EAGLE3_ARCHITECTURES",
           "GEMMA4_ARCHITECTURES", "GEMMA4_DSPARK_ARCHITECTURE", "GEMMA4_EAGLE3_ARCHITECTURE", "MARKOV_TYPES",
           "check_fields_of", "dspark_config", "eagle3_config"]
