"""DeepSpec checkpoints <-> hf_dspark drafters.

DeepSpec (`deepseek-ai/dspark_qwen3_8b_block7`, `dflash_qwen3_8b_block7`) saves `Qwen3DSparkModel`, and
`eagle3_qwen3_8b_ttt7` saves `Qwen3Eagle3Model`: a copy of the target's Qwen3 config plus drafter fields, and flat
weight names. vLLM (`"method": "dspark"`) and SGLang load the `Qwen3DSparkModel` layout with the vanilla Markov
head (or none: DFlash), so exporting to it is how a drafter trained here is served at scale; gated/rnn heads and
Eagle3 exports are DeepSpec's layout, which those engines do not serve as such. The backbone keys are the same on both
sides; the heads are renamed:

    DeepSpec                          hf_dspark
    markov_head.markov_w1.weight      sequential_head.token_embedding.weight   (W1, rows indexed by token)
    markov_head.markov_w2.weight      sequential_head.output.weight            (W2)
    markov_head.gate_proj.*           sequential_head.gate.*                   (gated head)
    markov_head.joint_proj.*          sequential_head.cell.*                   (rnn head)
    confidence_head.proj.*            confidence_proj.*
    embed_tokens / lm_head            not stored: the target's own (checked against the target when given)
    d2t / t2d (vLLM draft vocab)      draft_to_target

Eagle3 keys (`fc`, `layers.0.*` with q/k norms, `norm`) are the same on both sides; `ttt_length` is our `block_size`.
The forward math was compared term by term with DeepSpec's modeling code (same weights give the same logits);
the tests check the mapping and that an export/import round trip keeps every logit.

DeepSpec's own loader asserts `num_anchors` (`Qwen3DSparkModel`) and `step_loss_decay` (`Qwen3Eagle3Model`): exports
write the imported checkpoint's values, else DeepSpec's defaults (512 and 0.8). Every other DeepSpec field that
hf_dspark does not use is kept in `config.deepspec_fields` on import and written back on export.

DFlash (no Markov head) is exported with a rank-1, all-zero vanilla Markov head (its bias is 0: the same logits):
SGLang refuses `markov_rank: 0`, and llama.cpp's converter reads a head-less drafter as `draft-dflash`, whose slots
are shifted by one. Importing such a head (W1 all zero) gives the DFlash drafter back.

`target_layer_ids` may hold -1 (DeepSpec's embedding output, HF `hidden_states[0]`). A DeepSpec `--confidence-threshold`
compares each slot's own confidence; imported drafters use that rule (`confidence_threshold_rule: "per_slot"`).

Slot convention: DeepSpec and hf_dspark both feed `[anchor, mask x (gamma-1)]` and train slot k to predict the
token at anchor + k + 1. z-lab DFlash and `vllm-project/speculators` checkpoints (`sample_from_anchor: false`)
train slot j to predict anchor + j with slot 0 unused. Same tensor names, different function: loading one as the
other gives tau ~ 1 with no error anywhere, so such checkpoints are refused here, and exports say
`sample_from_anchor: true` explicitly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.utils import logging

from ..models.common import (
    BLOCK_DRAFTER_TYPE,
    EAGLE3_DRAFTER_TYPE,
    EMBEDDING_OUTPUT,
    DrafterTargetMismatchError,
    drafter_type,
)
from ..models.configuration_dspark import DSparkDraftConfig
from ..models.configuration_eagle3 import Eagle3DraftConfig
from ..models.modeling_dspark import DSparkDraftModel
from ..models.modeling_eagle3 import Eagle3DraftModel

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
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
EAGLE3_ARCHITECTURE = "Qwen3Eagle3Model"
MARKOV_TYPES = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}  # DeepSpec markov_head_type -> our markov_head
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")
IGNORED = ("rotary_emb.inv_freq", "t2d")
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"

# DeepSpec's `__init__` asserts these fields (deepspec/modeling/*/qwen3/modeling.py); exports write every one.
DEEPSPEC_REQUIRED_FIELDS = {
    DSPARK_ARCHITECTURE: ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
                          "markov_rank"),  # + markov_head_type when markov_rank > 0, confidence_head_with_markov
    EAGLE3_ARCHITECTURE: ("target_layer_ids", "ttt_length", "step_loss_decay"),
}
DEEPSPEC_DEFAULTS = {DSPARK_ARCHITECTURE: {"num_anchors": 512}, EAGLE3_ARCHITECTURE: {"step_loss_decay": 0.8}}
"""Written when the drafter was not imported from DeepSpec (DeepSpec's training defaults; its loader only needs
them to be present)."""
# Fields of a DeepSpec config.json that the export writes itself (or that are HF bookkeeping); everything else that
# is not a field of the target's config class is kept through import and export (`config.deepspec_fields`).
_WRITTEN_BY_EXPORT = {
    "architectures", "model_type", "auto_map", "_name_or_path", "transformers_version", "dtype", "torch_dtype",
    "num_target_layers", "num_hidden_layers", "tie_word_embeddings", "layer_types", "target_layer_ids",
    "draft_vocab_size", "rope_theta", "rope_scaling", "attention_bias", "block_size", "mask_token_id",
    "enable_confidence_head", "markov_rank", "markov_head_type", "sample_from_anchor", "dspark_bonus_anchor",
    "confidence_head_with_markov", "ttt_length", "draft_num_hidden_layers", "eagle_aux_hidden_state_layer_ids",
}


logger = logging.get_logger(__name__)


def served_by_vllm(config) -> bool:
    """vLLM and SGLang serve DeepSpec's `Qwen3DSparkModel` with the vanilla Markov head or none (DFlash) only."""
    return (config.model_type == BLOCK_DRAFTER_TYPE and config.qk_norm
            and config.markov_head in (None, "markov"))


class SlotConventionError(ValueError):
    """The checkpoint's slot k predicts anchor + k (speculators / z-lab DFlash), not anchor + k + 1."""


# ------------------------------------------------------------------------------------------------------------------
# Slot convention
# ------------------------------------------------------------------------------------------------------------------


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _flag(config: dict, key: str, source: str) -> bool | None:
    """A boolean config field however it was written (JSON true/false, 1/0, "true"/"false", ...); None when
    absent. Anything else is refused: guessing a slot-convention flag could silently ruin the drafter."""
    value = config.get(key)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise SlotConventionError(f"{source}/config.json has {key}={value!r}, which is not a boolean; write true or "
                              "false (JSON) so the slot convention is known.")


def check_slot_convention(config: dict, source: str) -> None:
    """Refuse checkpoints whose slot k predicts anchor + k (they would silently give tau ~ 1)."""
    architectures = config.get("architectures") or []
    reasons = []
    if "DFlashDraftModel" in architectures:
        reasons.append("architecture DFlashDraftModel (z-lab DFlash: logits from slots 1..B-1)")
    nested = config.get("dflash_config") or {}
    from_anchor = _flag(config, "sample_from_anchor", source)
    nested_from_anchor = _flag(nested, "sample_from_anchor", f"{source} (dflash_config)") if isinstance(nested, dict) \
        else None
    if config.get("speculators_model_type") and not from_anchor:
        reasons.append(f"speculators_model_type={config['speculators_model_type']!r} without sample_from_anchor")
    if from_anchor is False or nested_from_anchor is False:
        reasons.append("sample_from_anchor: false")
    if _flag(config, "dspark_bonus_anchor", source):
        reasons.append("dspark_bonus_anchor: true")
    if reasons:
        raise SlotConventionError(
            f"{source} trains slot j to predict the token at anchor + j ({'; '.join(reasons)}), while DeepSpec and "
            "hf_dspark train slot k to predict anchor + k + 1 from the block [anchor, mask, ...]. The weights have "
            "the same names but a different function: loaded as-is the drafter would silently reach tau ~ 1. "
            "Relabelling slots cannot fix it (that slot 0 was never trained), so it is refused: retrain with "
            "`hf-dspark train`, or serve it with the engine it was made for (method 'dflash' in vLLM/SGLang)."
        )


# ------------------------------------------------------------------------------------------------------------------
# Import: DeepSpec -> hf_dspark
# ------------------------------------------------------------------------------------------------------------------


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights (hf_dspark loads safetensors only)")
    weights = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def _target_like(config: dict):
    """DeepSpec's drafter config is a copy of the target's: read the shared sizes through the target's class."""
    return AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map")})


def deepspec_extra_fields(config: dict) -> dict:
    """The fields of a DeepSpec config.json that are neither the target's config fields nor written by the export
    (e.g. `num_anchors`, `step_loss_decay`, loss settings): kept so that an export writes them back."""
    try:
        known = set(type(_target_like(config))().to_dict())
    except (ValueError, KeyError, TypeError):
        known = set()
    return {k: v for k, v in config.items() if k not in known and k not in _WRITTEN_BY_EXPORT}


def config_from_deepspec(config: dict, source: str = "checkpoint", *, zero_markov_head: bool = False
                         ) -> DSparkDraftConfig | Eagle3DraftConfig:
    """Our drafter config for a DeepSpec config.json. `zero_markov_head`: the checkpoint's vanilla Markov head has
    W1 = 0 (how DFlash is exported), so it adds nothing and the drafter is DFlash."""
    architectures = config.get("architectures") or []
    check_slot_convention(config, source)
    extra = deepspec_extra_fields(config) or None
    if EAGLE3_ARCHITECTURE in architectures:
        if config["num_hidden_layers"] != 1:
            raise ValueError(f"{source} is a {config['num_hidden_layers']}-layer Eagle3: DeepSpec feeds every layer "
                             "[embedding ; hidden] while hf_dspark's layers after the first are plain; only 1 layer "
                             "converts exactly")
        return Eagle3DraftConfig.from_target_config(
            _target_like(config), num_hidden_layers=1, **_target_depth(config),
            block_size=config.get("ttt_length", 7), target_layer_ids=list(config["target_layer_ids"]),
            qk_norm=True, attention_bias=bool(config.get("attention_bias", False)),
            draft_vocab_size=_draft_vocab_size(config), deepspec_fields=extra)
    if DSPARK_ARCHITECTURE not in architectures:
        raise ValueError(
            f"{source} is a {architectures or 'checkpoint without architectures'}; `hf-dspark convert` reads "
            f"DeepSpec's {DSPARK_ARCHITECTURE} (DSpark and DFlash) and {EAGLE3_ARCHITECTURE}. Gemma4DSparkModel "
            "uses Gemma layers, which hf_dspark's drafters do not reproduce."
        )
    rank = int(config.get("markov_rank", 0))
    head_type = config.get("markov_head_type", "vanilla")
    if rank and head_type not in MARKOV_TYPES:
        raise ValueError(f"{source} has markov_head_type={head_type!r}; hf_dspark converts {sorted(MARKOV_TYPES)}")
    confidence = bool(config.get("enable_confidence_head", False))
    if zero_markov_head:
        rank = 0  # W1 = 0: no bias and nothing for the confidence head to read, i.e. DFlash
    if confidence and rank and not config.get("confidence_head_with_markov", False):
        raise ValueError(f"{source}'s confidence head reads h_k only (confidence_head_with_markov false); "
                         "hf_dspark's reads [h_k ; W1[x_{k-1}]] whenever there is a Markov head")
    return DSparkDraftConfig.from_target_config(
        _target_like(config),
        num_hidden_layers=config["num_hidden_layers"],
        **_target_depth(config),
        block_size=config["block_size"],
        target_layer_ids=list(config["target_layer_ids"]),
        mask_token_id=config["mask_token_id"],
        markov_head=MARKOV_TYPES[head_type] if rank else None,
        markov_rank=rank,
        confidence_head=confidence,
        qk_norm=True,  # Qwen3 layers
        attention_bias=bool(config.get("attention_bias", False)),
        draft_vocab_size=_draft_vocab_size(config),
        confidence_threshold_rule="per_slot",  # DeepSpec's --confidence-threshold compares each slot's own c_k
        deepspec_fields=extra,
    )


def _target_depth(config: dict) -> dict:
    # DeepSpec overwrote num_hidden_layers with the drafter's depth; the target's is num_target_layers, if written.
    return {"target_num_hidden_layers": config["num_target_layers"]} if "num_target_layers" in config else {}


def _draft_vocab_size(config: dict) -> int | None:
    draft_vocab = config.get("draft_vocab_size")
    return draft_vocab if draft_vocab and draft_vocab < config["vocab_size"] else None


def import_deepspec(folder: str | Path, target=None) -> DSparkDraftModel | Eagle3DraftModel:
    """Load a DeepSpec `Qwen3DSparkModel` (or `Qwen3Eagle3Model`) folder as a `DSparkDraftModel` (or
    `Eagle3DraftModel`), every tensor accounted for.

    With `target`, its stored embedding and LM head must equal the target's (else the drafter was trained for
    another model); without, they are dropped and `attach_target` shares the target's at generation time.
    """
    folder = Path(folder)
    config_dict = json.loads((folder / "config.json").read_text())
    weights = _read_weights(folder)
    zero_head = _is_zero_vanilla_head(config_dict, weights)
    config = config_from_deepspec(config_dict, str(folder), zero_markov_head=zero_head)
    if zero_head:  # a DFlash export: drop the head and the confidence head's columns that read W1 (all zero)
        weights.pop(W1)
        weights.pop(W2, None)
        if "confidence_head.proj.weight" in weights:
            proj = weights["confidence_head.proj.weight"]
            weights["confidence_head.proj.weight"] = proj[:, : config.hidden_size].contiguous()
    state = {}
    draft_vocab = config.draft_vocab_size
    if draft_vocab:
        if "d2t" not in weights:
            raise ValueError(f"{folder}: draft_vocab_size={draft_vocab} needs the d2t offsets tensor")
        offsets = weights.pop("d2t").long()
        if offsets.shape != (draft_vocab,):
            raise ValueError(f"{folder}: d2t has shape {tuple(offsets.shape)}, expected ({draft_vocab},) for "
                             f"draft_vocab_size={draft_vocab}")
        state["draft_to_target"] = torch.arange(draft_vocab) + offsets
    for name, tensor in weights.items():
        if name in IGNORED or name in SHARED_WITH_TARGET:
            continue
        state[HEAD_NAMES.get(name, name)] = tensor
    if draft_vocab and "sequential_head.token_embedding.weight" in state:
        state["sequential_head.token_embedding.weight"] = _compress_rows(
            state["sequential_head.token_embedding.weight"], state["draft_to_target"], folder)
    drafter = Eagle3DraftModel(config) if isinstance(config, Eagle3DraftConfig) else DSparkDraftModel(config)
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{folder} does not fit DeepSpec's {config_dict['architectures'][0]} layout: missing "
                         f"{missing[:8]}, unexpected {unexpected[:8]}")
    wrong = [(name, tuple(state[name].shape), tuple(tensor.shape)) for name, tensor in expected.items()
             if state[name].shape != tensor.shape]
    if wrong:
        shapes = "; ".join(f"{name} {stored} stored, {needed} for the config" for name, stored, needed in wrong[:4])
        hint = ""
        if any(name == "fc.weight" for name, *_ in wrong):
            hint = (f" fc fuses len(target_layer_ids) = {len(config.target_layer_ids)} target layers of width "
                    f"{config.hidden_size}: check target_layer_ids (and hidden_size) in config.json.")
        raise ValueError(f"{folder}/config.json does not describe the weights in {folder} ({shapes}).{hint} Fix "
                         "config.json to match the checkpoint it was saved with.")
    drafter.load_state_dict(state, strict=True)
    stored = {t.dtype for n, t in state.items() if t.is_floating_point()}
    if len(stored) == 1:  # keep the checkpoint's precision (DeepSpec saves bf16)
        drafter.to(stored.pop())
    if target is not None:
        drafter.check_compatible(target.config)
        _check_shared_weights(weights, target, drafter, folder)
    return drafter.eval()


def _is_zero_vanilla_head(config: dict, weights: dict) -> bool:
    """A vanilla Markov head whose W1 is all zero contributes nothing (bias W2(W1[x]) = 0, and the confidence head
    reads W1[x] = 0): how DFlash drafters are exported."""
    return (DSPARK_ARCHITECTURE in (config.get("architectures") or []) and int(config.get("markov_rank", 0)) > 0
            and config.get("markov_head_type", "vanilla") == "vanilla" and W1 in weights
            and not bool(weights[W1].any()))


def _compress_rows(w1_full: torch.Tensor, draft_to_target: torch.Tensor, source) -> torch.Tensor:
    """W1 over the whole vocabulary -> our draft-vocabulary rows plus one row shared by every other token."""
    outside = torch.ones(w1_full.shape[0], dtype=torch.bool)
    outside[draft_to_target] = False
    others = w1_full[outside]
    if len(others) and not torch.equal(others, others[:1].expand_as(others)):
        raise ValueError(f"{source}: W1 rows of tokens outside the draft vocabulary differ; hf_dspark keeps one "
                         "shared row for them, so this head cannot be represented exactly")
    shared = others[:1] if len(others) else w1_full.new_zeros(1, w1_full.shape[1])
    return torch.cat([w1_full[draft_to_target], shared])


def _check_shared_weights(weights, target, drafter, source) -> None:
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    rows = drafter.draft_to_target if drafter.draft_to_target is not None else slice(None)
    for name, reference in (("embed_tokens.weight", embedding), ("lm_head.weight", head[rows])):
        if name not in weights:
            continue
        stored, reference = weights[name], reference.detach().cpu()
        if stored.shape != reference.shape:
            same = False
        elif stored.dtype == reference.dtype or reference.dtype == torch.float32:
            same = torch.equal(stored, reference.to(stored.dtype))  # the stored copy is a cast of the target's
        else:  # bf16 <-> fp16: compare through fp32, within the coarser format's rounding
            difference = (stored.float() - reference.float()).norm() / reference.float().norm()
            same = float(difference) < 1e-2
        if not same:
            raise DrafterTargetMismatchError(
                f"{source}'s {name} is not the target's ({tuple(stored.shape)} {stored.dtype} vs "
                f"{tuple(reference.shape)} {reference.dtype}): it was trained for another model. Pass the target "
                "it names.")


# ------------------------------------------------------------------------------------------------------------------
# Export: hf_dspark -> DeepSpec (what vLLM and SGLang load)
# ------------------------------------------------------------------------------------------------------------------


def export_deepspec(drafter: DSparkDraftModel | Eagle3DraftModel, folder: str | Path, target=None) -> Path:
    """Write `drafter` in DeepSpec's `Qwen3DSparkModel` / `Qwen3Eagle3Model` layout (flat config, safetensors,
    explicit `sample_from_anchor: true`, the fields DeepSpec's loader asserts). With `target`, its embedding and LM
    head are included (DeepSpec's own loader wants them; vLLM and SGLang share the target's when absent, except for
    a draft vocabulary's LM head). A DFlash drafter gets a rank-1, all-zero vanilla Markov head (numerically the
    same drafter), which SGLang requires and which makes llama.cpp read its slots the right way."""
    kind = drafter_type(drafter)
    if kind not in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE):
        raise ValueError(f"DeepSpec's layouts hold DSpark/DFlash and Eagle3 drafters, not {type(drafter).__name__}")
    config = drafter.config
    architecture = DSPARK_ARCHITECTURE if kind == BLOCK_DRAFTER_TYPE else EAGLE3_ARCHITECTURE
    if not config.qk_norm:
        raise ValueError(
            f"DeepSpec/vLLM's {architecture} has Qwen3 layers with per-head q/k RMSNorm, and this drafter "
            f"(for a {config.target_model_type} target) has none, so exporting would change its outputs. Train the "
            "drafter with qk_norm=True (from_target_config(..., qk_norm=True)) to serve it there."
        )
    if kind == EAGLE3_DRAFTER_TYPE and config.num_hidden_layers != 1:
        raise ValueError("DeepSpec's Eagle3 feeds every layer [embedding ; hidden]; only 1-layer drafters export")
    if getattr(config, "confidence_temperatures", None) is not None:
        raise ValueError("DeepSpec's layout has no per-slot confidence temperatures; they would be lost")
    for warning in export_warnings(config):
        logger.warning("%s export: %s", type(drafter).__name__, warning)
    draft_ids = drafter.draft_to_target
    if draft_ids is not None and target is None:
        raise ValueError("a drafter with a draft vocabulary exports its LM head rows (vLLM requires them with "
                         "d2t): pass the target")
    if target is not None:
        drafter.check_compatible(target.config)
    ours_to_theirs = {v: k for k, v in HEAD_NAMES.items()}
    weights = {}
    for name, tensor in drafter.state_dict().items():
        if name == "draft_to_target":
            continue
        weights[ours_to_theirs.get(name, name)] = tensor.detach().cpu().contiguous()
    vocab = config.vocab_size
    dtype = next(drafter.parameters()).dtype
    if kind == BLOCK_DRAFTER_TYPE and config.markov_head is None:
        # DFlash: a rank-1 vanilla head with W1 = W2 = 0 adds a zero bias, and the confidence head's extra W1
        # column multiplies W1[x] = 0, so every logit and confidence is unchanged.
        weights[W1] = torch.zeros(vocab, 1, dtype=dtype)
        weights[W2] = torch.zeros(config.draft_vocab_size or vocab, 1, dtype=dtype)
        if "confidence_head.proj.weight" in weights:
            proj = weights["confidence_head.proj.weight"]
            weights["confidence_head.proj.weight"] = torch.cat([proj, proj.new_zeros(proj.shape[0], 1)], dim=1)
    if draft_ids is not None:
        draft_ids = draft_ids.cpu()
        weights["d2t"] = (draft_ids - torch.arange(len(draft_ids))).contiguous()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_ids] = True
        weights["t2d"] = t2d
        if kind == BLOCK_DRAFTER_TYPE and config.markov_head is not None:  # our W1: draft rows + one shared row
            rows = weights[W1]
            full = rows[-1:].expand(vocab, -1).clone()
            full[draft_ids] = rows[:-1]
            weights[W1] = full
    if target is not None:
        head = target.get_output_embeddings().weight.detach().cpu()
        embedding = target.get_input_embeddings().weight.detach().cpu()
        # clone(): a target with tied embeddings (SmolLM2, Qwen3-0.6B..4B, Gemma) shares one tensor between the two,
        # and safetensors refuses to write shared tensors.
        weights["embed_tokens.weight"] = embedding.to(dtype).clone().contiguous()
        weights["lm_head.weight"] = (head[draft_ids] if draft_ids is not None else head).to(dtype).clone().contiguous()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(deepspec_config(drafter, target), indent=2) + "\n")
    return folder


def export_warnings(config) -> list[str]:
    """What the engines that read DeepSpec's layout cannot serve from this drafter's export (each engine's loader
    was read: vLLM 0.33 `qwen3_dspark.py`, SGLang 0.5.23 `models/dspark.py` and `dflash_utils.py`, llama.cpp
    `conversion/qwen.py`, DeepSpec `modeling/*/qwen3/modeling.py`)."""
    warnings = []
    if not served_by_vllm(config):
        warnings.append("DeepSpec's layout holds it exactly, but vLLM, SGLang and llama.cpp serve only DSpark with the "
                        "vanilla Markov head and DFlash from it")
    if config.draft_vocab_size:
        warnings.append(
            f"the draft vocabulary ({config.draft_vocab_size} of {config.vocab_size} tokens, d2t/t2d) is served by "
            "vLLM and llama.cpp only: SGLang cannot load it (its markov_w2 is full-vocabulary) and DeepSpec has no "
            "draft vocabulary (its lm_head has vocab_size rows). Train without --draft-vocab-size for those.")
    if EMBEDDING_OUTPUT in config.target_layer_ids:
        warnings.append("target_layer_ids contains -1 (the embedding output): DeepSpec, vLLM and llama.cpp read it, "
                        "SGLang refuses negative target layer ids")
    return warnings


def deepspec_config(drafter: DSparkDraftModel | Eagle3DraftModel, target=None) -> dict:
    config = drafter.config
    base = target.config.get_text_config().to_dict() if target is not None else {
        "model_type": config.target_model_type or "qwen3", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, "rope_parameters": config.rope_parameters,
        "attention_bias": config.attention_bias}
    for key in ("auto_map", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "layer_types",
                "sliding_window", "max_window_layers", "use_sliding_window"):
        base.pop(key, None)
    common = {
        "num_target_layers": config.target_num_hidden_layers,
        "num_hidden_layers": config.num_hidden_layers,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "target_layer_ids": list(config.target_layer_ids),
    }
    if config.draft_vocab_size:
        common["draft_vocab_size"] = config.draft_vocab_size
    # transformers 5 writes rope_parameters only; DeepSpec's code and engines on transformers 4 read these.
    rope = dict(config.rope_parameters)
    common["rope_theta"] = rope.get("rope_theta", 10000.0)
    common["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else {**rope, "type": rope["rope_type"]}
    common["attention_bias"] = config.attention_bias
    common["torch_dtype"] = str(next(drafter.parameters()).dtype).replace("torch.", "")
    if drafter_type(drafter) == EAGLE3_DRAFTER_TYPE:
        fields = {"architectures": [EAGLE3_ARCHITECTURE], "ttt_length": config.block_size,
                  "draft_num_hidden_layers": config.num_hidden_layers,
                  # vLLM's eagle3 reads the capture indices (HF hidden_states indices: layer id + 1).
                  "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids]}
        return _with_deepspec_fields({**base, **common, **fields}, config, EAGLE3_ARCHITECTURE)
    rank = config.markov_rank if config.markov_head is not None else 1  # DFlash: the rank-1 zero head
    head_type = config.markov_head if config.markov_head is not None else "markov"
    fields = {
        "architectures": [DSPARK_ARCHITECTURE],
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "enable_confidence_head": bool(config.confidence_head),
        "markov_rank": rank,
        "markov_head_type": {v: k for k, v in MARKOV_TYPES.items()}[head_type],
        "sample_from_anchor": True,  # slot k predicts anchor + k + 1 (DeepSpec's convention), said explicitly
        "dspark_bonus_anchor": False,
    }
    if config.confidence_head:
        fields["confidence_head_with_markov"] = True  # [h_k ; W1[x_{k-1}]], as ours (the zero head's W1 for DFlash)
    return _with_deepspec_fields({**base, **common, **fields}, config, DSPARK_ARCHITECTURE)


def _with_deepspec_fields(exported: dict, config, architecture: str) -> dict:
    """Add the DeepSpec fields kept from an import (never overriding what the export wrote), then the defaults of
    the fields DeepSpec's loader asserts."""
    for key, value in (getattr(config, "deepspec_fields", None) or {}).items():
        exported.setdefault(key, value)
    for key, value in DEEPSPEC_DEFAULTS[architecture].items():
        exported.setdefault(key, value)
    return exported
