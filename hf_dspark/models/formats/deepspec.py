"""DeepSpec's drafter layout (github.com/deepseek-ai/DeepSpec), read into hf_dspark drafters in memory.

DeepSpec saves `Qwen3DSparkModel` (DSpark with a vanilla, gated or rnn Markov head, with or without a confidence
head; DFlash is the same class with `markov_rank: 0`) and `Qwen3Eagle3Model` with `save_pretrained`: config.json is
a copy of the target's Qwen3 config (`model_type: qwen3`, so `AutoModel` would build a plain `Qwen3Model`) with the
drafter's depth and fields added, and the weights carry frozen copies of the target's `embed_tokens` and `lm_head`.
Tensor names (DeepSpec -> hf_dspark; every other name is the same on both sides):

    markov_head.markov_w1.weight      sequential_head.token_embedding.weight   (W1, one row per token)
    markov_head.markov_w2.weight      sequential_head.output.weight            (W2)
    markov_head.gate_proj.*           sequential_head.gate.*                   (gated head)
    markov_head.joint_proj.*          sequential_head.cell.*                   (rnn head: [s ; W1[x] ; h] -> g, c, o)
    confidence_head.proj.*            confidence_proj.*
    embed_tokens / lm_head            drafter.attach_stored_heads(...) until a target is attached
    d2t / t2d (hf_dspark's exports)   draft_to_target (t2d is checked against it)

The forward math was checked against DeepSpec's own code run on random drafters (tests/data/deepspec_golden/, made
by benchmarks/interop/make_deepspec_goldens.py): the same per-slot logits within 1e-5 in float32.

The weights keep the checkpoint's floating dtype when all of them share one (DeepSpec saves bfloat16, and its own
evaluator runs in it), as `from_pretrained`'s default `dtype="auto"` does; mixed dtypes load as float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from ..errors import DrafterLoadError, DrafterTargetMismatchError
from ..configuration_dspark import DSparkDraftConfig
from ..configuration_eagle3 import Eagle3DraftConfig
from ..modeling_dspark import DSparkDraftModel
from ..modeling_eagle3 import Eagle3DraftModel
from ..weight_files import check_state_fits, read_checkpoint_tensors

FORMAT = "deepspec"
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
EAGLE3_ARCHITECTURE = "Qwen3Eagle3Model"
GEMMA4_ARCHITECTURES = ("Gemma4DSparkModel", "Gemma4Eagle3Model")
ARCHITECTURES = (DSPARK_ARCHITECTURE, EAGLE3_ARCHITECTURE, *GEMMA4_ARCHITECTURES)

HEAD_NAMES = {  # DeepSpec -> hf_dspark
    "markov_head.markov_w1.weight": "sequential_head.token_embedding.weight",
    "markov_head.markov_w2.weight": "sequential_head.output.weight",
    "markov_head.gate_proj.weight": "sequential_head.gate.weight",
    "markov_head.gate_proj.bias": "sequential_head.gate.bias",
    "markov_head.joint_proj.weight": "sequential_head.cell.weight",
    "markov_head.joint_proj.bias": "sequential_head.cell.bias",
    "confidence_head.proj.weight": "confidence_proj.weight",
    "confidence_head.proj.bias": "confidence_proj.bias",
}
MARKOV_TYPES = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}  # DeepSpec markov_head_type -> our markov_head
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
STORED_HEADS = ("embed_tokens.weight", "lm_head.weight")
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # recomputed from rope_parameters (older transformers saved it)

# --- config.json fields: each one is used, checked, or known not to change the drafter's outputs ---------------
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

UNSUPPORTED_GEMMA4 = (
    "{architecture} is DeepSpec's drafter for Gemma4 targets, whose layers differ from the Qwen3-style layers of "
    "hf_dspark's drafters: attention with scaling 1.0, an unscaled RMSNorm on the values, values equal to the keys "
    "when attention_k_eq_v is set, global_head_dim / num_global_key_value_heads, sandwich norms "
    "(post_attention, pre_ and post_feedforward layernorms), a per-layer layer_scalar, embeddings scaled by "
    "sqrt(hidden_size) and final_logit_softcapping. Supporting it would take those options in "
    "DSparkDraftConfig / Eagle3DraftConfig and their layers; until then it is refused rather than loaded wrong."
)


def matches(config: dict) -> bool:
    """A DeepSpec drafter config: one of DeepSpec's drafter architectures on a copied target config."""
    architectures = config.get("architectures") or []
    return (isinstance(architectures, list) and any(name in ARCHITECTURES for name in architectures)
            and "speculators_model_type" not in config)


def load(folder: Path, config: dict) -> DSparkDraftModel | Eagle3DraftModel:
    """The drafter in `folder` (config.json already read into `config`), converted strictly: every tensor of ours
    filled from the checkpoint, every stored tensor used, every config field accounted for. Stored copies of the
    target's embedding and LM head are attached with `attach_stored_heads`, so no target is needed to run it."""
    folder = Path(folder)
    source = str(folder / "config.json")
    architecture = _architecture(config, source)
    weights = read_checkpoint_tensors(folder, "DeepSpec drafter", "save the drafter with DeepSpec's save_pretrained")
    if architecture == EAGLE3_ARCHITECTURE:
        drafter = Eagle3DraftModel(eagle3_config(config, source))
    else:
        zero_head = _is_zero_vanilla_head(config, weights)
        ours = dspark_config(config, source, zero_markov_head=zero_head)
        ours.markov_w1_full_vocab = ours.markov_head is not None and _rows_differ_outside(weights, config)
        drafter = DSparkDraftModel(ours)
        weights = _dspark_weights(config, weights, drafter.config, source, zero_head)
    heads = {name: weights.pop(name) for name in STORED_HEADS if name in weights}
    state = _our_state(weights, drafter.config, source)
    _load_strictly(drafter, state, source)
    dtype = _kept_dtype([*state.values(), *heads.values()])
    drafter.to(dtype)
    # Gemma targets scale their embedding by sqrt(hidden_size) inside the embedding module, so a plain lookup of
    # the stored copy would be wrong: drafters exported for them (DeepSpec's own are Qwen3) wait for their target.
    if heads and not str(config.get("model_type", "qwen3")).startswith("gemma"):
        _attach_heads(drafter, heads, dtype, source)
    return drafter.eval()


def _architecture(config: dict, source: str) -> str:
    architectures = config.get("architectures") or []
    ours = [name for name in architectures if name in ARCHITECTURES]
    if len(architectures) != 1 or not ours:
        raise DrafterLoadError(f"{source} lists architectures {architectures}; a DeepSpec drafter names exactly one "
                               f"of {list(ARCHITECTURES)}. Fix the field to the class that saved the checkpoint.")
    if ours[0] in GEMMA4_ARCHITECTURES:
        raise DrafterLoadError(f"{source}: architectures {ours}: " + UNSUPPORTED_GEMMA4.format(architecture=ours[0]))
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
    """The target's config rebuilt from the copied fields (depth: `num_target_layers`)."""
    model_type = config.get("model_type", "qwen3")
    fields = {name: config[name] for name in (*TARGET_SHAPE_FIELDS, *_target_class_fields(config))
              if name in config and name not in ("model_type", "architectures", "num_hidden_layers", "layer_types")}
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


def dspark_config(config: dict, source: str = "checkpoint", *, zero_markov_head: bool = False) -> DSparkDraftConfig:
    """Our `DSparkDraftConfig` for a DeepSpec `Qwen3DSparkModel` config.json. `zero_markov_head`: the checkpoint's
    vanilla Markov head has W1 = 0 (how hf_dspark exports DFlash), so it adds nothing and the drafter is DFlash."""
    _check_fields(config, source, DSPARK_FIELDS, required=("block_size", "mask_token_id", "target_layer_ids"))
    rank = int(config.get("markov_rank") or 0)
    head_type = config.get("markov_head_type", "vanilla")
    if rank and head_type not in MARKOV_TYPES:
        raise DrafterLoadError(f"{source} has markov_head_type={head_type!r}; DeepSpec's heads are "
                               f"{sorted(MARKOV_TYPES)}, which hf_dspark reads. Another head needs its own support.")
    confidence = bool(_flag(config, "enable_confidence_head", source))
    if confidence and _flag(config, "confidence_head_with_markov", source) and not rank:
        raise DrafterLoadError(f"{source} has confidence_head_with_markov true without a Markov head (markov_rank "
                               "0); DeepSpec itself refuses that. Set it false for a DFlash drafter.")
    if zero_markov_head:
        rank = 0  # W1 = 0: no bias and nothing for the confidence head to read, i.e. DFlash
    target, depth = _target_config(config, source)
    return DSparkDraftConfig.from_target_config(
        target, num_hidden_layers=config["num_hidden_layers"], target_num_hidden_layers=depth,
        block_size=config["block_size"], sample_from_anchor=_sample_from_anchor(config, source),
        target_layer_ids=list(config["target_layer_ids"]), mask_token_id=config["mask_token_id"],
        markov_head=MARKOV_TYPES[head_type] if rank else None, markov_rank=rank, confidence_head=confidence,
        qk_norm=True, attention_bias=bool(config.get("attention_bias", False)),
        draft_vocab_size=_draft_vocab_size(config),
        confidence_threshold_rule="per_slot",  # DeepSpec's --confidence-threshold compares each slot's own c_k
        deepspec_fields=_kept_fields(config))


def eagle3_config(config: dict, source: str = "checkpoint") -> Eagle3DraftConfig:
    """Our `Eagle3DraftConfig` for a DeepSpec `Qwen3Eagle3Model` config.json (`ttt_length` is our `block_size`)."""
    _check_fields(config, source, EAGLE3_FIELDS, required=("ttt_length", "target_layer_ids"))
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
    return Eagle3DraftConfig.from_target_config(
        target, num_hidden_layers=1, target_num_hidden_layers=depth, block_size=config["ttt_length"],
        target_layer_ids=layer_ids, qk_norm=True, attention_bias=bool(config.get("attention_bias", False)),
        draft_vocab_size=_draft_vocab_size(config), deepspec_fields=_kept_fields(config))


def _is_zero_vanilla_head(config: dict, weights: dict) -> bool:
    """A vanilla Markov head whose W1 is all zero adds nothing (bias W2(W1[x]) = 0, and the confidence head reads
    W1[x] = 0): how hf_dspark exports DFlash (SGLang needs markov_rank > 0). It loads back as DFlash."""
    return (int(config.get("markov_rank") or 0) > 0 and config.get("markov_head_type", "vanilla") == "vanilla"
            and W1 in weights and not bool(weights[W1].any()))


def _dspark_weights(config: dict, weights: dict, ours: DSparkDraftConfig, source: str, zero_head: bool) -> dict:
    """DSpark tensors adapted where the layouts differ in shape, not in function."""
    weights = dict(weights)
    proj = weights.get("confidence_head.proj.weight")
    if zero_head:  # drop the zero head and the confidence columns that read W1[x] = 0
        weights.pop(W1)
        weights.pop(W2, None)
        if proj is not None:
            weights["confidence_head.proj.weight"] = proj[:, : ours.hidden_size].contiguous()
    elif proj is not None and ours.markov_head is not None and not _flag(config, "confidence_head_with_markov", source):
        # DeepSpec's confidence head may read h_k alone; ours reads [h_k ; W1[x_{k-1}]] whenever there is a Markov
        # head. Zero columns for W1[x] give exactly the same logit.
        weights["confidence_head.proj.weight"] = torch.cat(
            [proj, proj.new_zeros(proj.shape[0], ours.markov_rank)], dim=1)
    return weights


def _our_state(weights: dict, config, source: str) -> dict[str, torch.Tensor]:
    """Our names for the stored tensors (everything but the stored embedding / LM head, popped before)."""
    weights = dict(weights)
    state = {}
    if config.draft_vocab_size:
        state["draft_to_target"] = _draft_to_target(weights, config, source)
    elif "d2t" in weights or "t2d" in weights:
        raise DrafterLoadError(f"{source}: the weights hold a draft vocabulary (d2t/t2d) but config.json has no "
                               "draft_vocab_size below vocab_size; add the draft_vocab_size they were saved with.")
    for name, tensor in weights.items():
        if name not in IGNORED_TENSORS:
            state[HEAD_NAMES.get(name, name)] = tensor
    head = "sequential_head.token_embedding.weight"
    if config.draft_vocab_size and head in state and not getattr(config, "markov_w1_full_vocab", False):
        state[head] = _compress_rows(state[head], state["draft_to_target"], source)
    return state


def _draft_to_target(weights: dict, config, source: str) -> torch.Tensor:
    """Draft-vocabulary ids from vLLM's d2t offsets (draft id + offset = target id), checked against t2d."""
    size = config.draft_vocab_size
    if "d2t" not in weights:
        raise DrafterLoadError(f"{source}: draft_vocab_size={size} needs the d2t offsets tensor in the weights.")
    offsets = weights.pop("d2t")
    if offsets.shape != (size,) or offsets.is_floating_point():
        raise DrafterLoadError(f"{source}: d2t is {tuple(offsets.shape)} {offsets.dtype}, expected ({size},) integers "
                               f"for draft_vocab_size={size}.")
    ids = torch.arange(size) + offsets.long()
    if ids.min() < 0 or ids.max() >= config.vocab_size or ids.unique().numel() != size:
        raise DrafterLoadError(f"{source}: d2t maps draft ids outside the {config.vocab_size}-token vocabulary or "
                               "twice to one token; the checkpoint is corrupt.")
    mask = weights.pop("t2d", None)
    if mask is not None:
        expected = torch.zeros(config.vocab_size, dtype=torch.bool)
        expected[ids] = True
        if mask.shape != expected.shape or not torch.equal(mask.bool(), expected):
            raise DrafterLoadError(f"{source}: t2d does not mark exactly the tokens d2t maps to; the checkpoint is "
                                   "corrupt (re-export it).")
    return ids


def _rows_differ_outside(weights: dict, config: dict) -> bool:
    """Whether a full-vocabulary W1 has different rows for tokens outside the draft vocabulary (then it stays full,
    `markov_w1_full_vocab`; else it compresses to the draft rows plus one shared row)."""
    size, w1, offsets = config.get("draft_vocab_size"), weights.get(W1), weights.get("d2t")
    if not size or w1 is None or offsets is None or size >= w1.shape[0] or offsets.shape != (size,):
        return False
    outside = torch.ones(w1.shape[0], dtype=torch.bool)
    outside[(torch.arange(size) + offsets.long()).clamp(0, w1.shape[0] - 1)] = False
    others = w1[outside]
    return bool(len(others)) and not torch.equal(others, others[:1].expand_as(others))


def _compress_rows(w1_full: torch.Tensor, draft_to_target: torch.Tensor, source: str) -> torch.Tensor:
    """W1 over the whole vocabulary -> our draft-vocabulary rows plus one row shared by every other token."""
    outside = torch.ones(w1_full.shape[0], dtype=torch.bool)
    outside[draft_to_target] = False
    others = w1_full[outside]
    shared = others[:1] if len(others) else w1_full.new_zeros(1, w1_full.shape[1])
    return torch.cat([w1_full[draft_to_target], shared])


def _load_strictly(drafter, state: dict, source: str) -> None:
    theirs = {ours: theirs for theirs, ours in HEAD_NAMES.items()}
    check_state_fits(drafter.state_dict(), state, Path(source).parent, "DeepSpec drafter",
                     "Fix config.json to the checkpoint it was saved with (markov_rank, markov_head_type, "
                     "enable_confidence_head, num_hidden_layers; fc fuses len(target_layer_ids) target layers).",
                     stored_name=lambda name: theirs.get(name, name))
    drafter.load_state_dict(state, strict=True)


def _kept_dtype(tensors) -> torch.dtype:
    dtypes = {tensor.dtype for tensor in tensors if tensor.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _attach_heads(drafter, heads: dict, dtype: torch.dtype, source: str) -> None:
    """The stored copies of the target's embedding and LM head, as the drafter's heads until a target is attached.
    With a draft vocabulary the LM head holds its rows only; they go to the draft ids of a full-vocabulary head
    (`compute_logits` reads only those rows)."""
    if len(heads) != 2:
        raise DrafterLoadError(f"the weights beside {source} hold {sorted(heads)}, not both of "
                               f"{list(STORED_HEADS)}; DeepSpec stores the target's embedding and LM head together.")
    embedding, lm_head = heads["embed_tokens.weight"].to(dtype), heads["lm_head.weight"].to(dtype)
    draft_ids = drafter.draft_to_target
    if draft_ids is not None and lm_head.shape[0] == len(draft_ids):
        full = lm_head.new_zeros(drafter.config.vocab_size, lm_head.shape[1])
        full[draft_ids] = lm_head
        lm_head = full
    drafter.attach_stored_heads(embedding, lm_head)


def check_stored_heads_match(drafter, target, source: str) -> None:
    """Before `attach_target`: refuse a target whose embedding or LM head differs from the copies the checkpoint
    stores (it was trained for another model). Casts of the target's weights (bf16 copies) pass."""
    stored = drafter._target_heads
    if stored is None:
        return
    rows = drafter.draft_to_target if drafter.draft_to_target is not None else slice(None)
    pairs = (("embed_tokens", stored.embed_tokens.weight, target.get_input_embeddings().weight),
             ("lm_head", stored.lm_head.weight[rows], target.get_output_embeddings().weight[rows]))
    for name, mine, theirs in pairs:
        mine, theirs = mine.detach().cpu(), theirs.detach().cpu()
        if mine.shape != theirs.shape:
            same = False
        elif mine.dtype == theirs.dtype or theirs.dtype == torch.float32:
            same = torch.equal(mine, theirs.to(mine.dtype))  # the stored copy is a cast of the target's
        else:  # bf16 <-> fp16: compare through fp32, within the coarser format's rounding
            same = float((mine.float() - theirs.float()).norm() / theirs.float().norm()) < 1e-2
        if not same:
            raise DrafterTargetMismatchError(
                f"{source}'s stored {name} is not the target's ({tuple(mine.shape)} {mine.dtype} vs "
                f"{tuple(theirs.shape)} {theirs.dtype}): it was trained for another model. Pass the target it names.")


__all__ = ["FORMAT", "check_stored_heads_match", "dspark_config", "eagle3_config", "load", "matches"]
