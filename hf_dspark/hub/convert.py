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
Drafters with Gemma 4 layers (`layer_style="gemma4"`, made for Gemma 4 targets) are written as DeepSpec's
`Gemma4DSparkModel` / `Gemma4Eagle3Model` (the target's Gemma4TextConfig fields as transformers 5.10 writes them,
`models/formats/deepspec_gemma4.py`); DeepSpec's own classes load those exports with nothing missing or left over.
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
token at anchor + k + 1; checkpoints whose slot j predicts anchor + j (`sample_from_anchor: false`) keep that
convention through import and export, and exports always write the field.

Reading DeepSpec's layout is `hf_dspark.models.formats.deepspec` (which every `from_pretrained` uses too); this
module adds the checks against a target and the export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.utils import logging

from ..models.errors import DrafterLoadError, DrafterTargetMismatchError, UserInputError
from ..models.identity import (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE, OWN_DRAFTER_TYPES, drafter_kind,
                               drafting_core)
from ..models.target_info import EMBEDDING_OUTPUT, target_text_config
from ..models.modeling_dspark import DSparkDraftModel
from ..models.modeling_eagle3 import Eagle3DraftModel
from ..models.formats import deepspec, deepspec_gemma4
from ..models.formats.deepspec import DSPARK_ARCHITECTURE, EAGLE3_ARCHITECTURE, HEAD_NAMES, MARKOV_TYPES, W1, W2
from ..models.formats.deepspec_config import GEMMA4_DSPARK_ARCHITECTURE, GEMMA4_EAGLE3_ARCHITECTURE
from ..models.saved_config import read_folder_config

SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")

# DeepSpec's `__init__` asserts these fields (deepspec/modeling/*/qwen3/modeling.py); exports write every one.
DEEPSPEC_REQUIRED_FIELDS = {
    DSPARK_ARCHITECTURE: ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
                          "markov_rank"),  # + markov_head_type when markov_rank > 0, confidence_head_with_markov
    EAGLE3_ARCHITECTURE: ("target_layer_ids", "ttt_length", "step_loss_decay"),
}
DEEPSPEC_DEFAULTS = {DSPARK_ARCHITECTURE: {"num_anchors": 512}, EAGLE3_ARCHITECTURE: {"step_loss_decay": 0.8}}
DEEPSPEC_DEFAULTS.update({GEMMA4_DSPARK_ARCHITECTURE: DEEPSPEC_DEFAULTS[DSPARK_ARCHITECTURE],
                          GEMMA4_EAGLE3_ARCHITECTURE: DEEPSPEC_DEFAULTS[EAGLE3_ARCHITECTURE]})
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


# ------------------------------------------------------------------------------------------------------------------
# Import: DeepSpec -> hf_dspark (the reader is `hf_dspark.models.formats.deepspec`, which from_pretrained uses too)
# ------------------------------------------------------------------------------------------------------------------


def import_deepspec(folder: str | Path, target=None) -> DSparkDraftModel | Eagle3DraftModel:
    """Load a DeepSpec `Qwen3DSparkModel` (or `Qwen3Eagle3Model`) folder as a `DSparkDraftModel` (or
    `Eagle3DraftModel`), every tensor accounted for (`formats.deepspec.load`). With `target`, the drafter must be
    for its architecture and shapes, and the stored embedding / LM head copies must be the target's."""
    folder = Path(folder)
    config = read_folder_config(folder, "DeepSpec drafter", DrafterLoadError)
    if config is None:
        raise DrafterLoadError(f"{folder} has no config.json: pass a DeepSpec checkpoint folder")
    if not deepspec.matches(config):
        raise DrafterLoadError(
            f"{folder} is a {config.get('architectures') or 'checkpoint without architectures'}, not DeepSpec's "
            f"{DSPARK_ARCHITECTURE} / {EAGLE3_ARCHITECTURE}; other layouts load with "
            "hf_dspark.AutoDrafter.from_pretrained(path) (`hf-dspark convert` writes them out as hf_dspark's).")
    drafter = deepspec.load(folder, config)
    if target is not None:
        check_against_target(drafter, target, folder, deepspec.FORMAT)
    return drafter


def check_against_target(drafter, target, source, layout: str) -> None:
    """The drafter read from `source` (in `layout`) fits `target`: its architecture, its shapes and, for a DeepSpec
    checkpoint, the stored copies of the target's embedding and LM head."""
    check_target_architecture(drafter.config, target.config, source)
    drafter.check_compatible(target.config)
    if layout == deepspec.FORMAT:
        deepspec.check_stored_heads_match(drafter, target, str(source))


def source_layout(folder: str | Path) -> str:
    """"hf_dspark", or the name of the other project's layout the drafter folder is in (`formats.layout_of`)."""
    from ..models.formats import layout_of, unread_layout_refusal
    from ..models.saved_config import read_config

    config, _ = read_config(folder, {})
    if config.get("model_type") in OWN_DRAFTER_TYPES:
        return "hf_dspark"
    module = layout_of(config)
    if module is None:
        refusal = unread_layout_refusal(config, folder)  # a layout known and not read
        if refusal is not None:
            raise DrafterLoadError(refusal)
        raise DrafterLoadError(f"{folder} holds no drafter layout hf_dspark reads (model_type "
                               f"{config.get('model_type')!r}, architectures {config.get('architectures')}).")
    return module.FORMAT


def convert_drafter(source: str | Path, output: str | Path, layout: str | None = None, target=None
                    ) -> tuple[str, str]:
    """Read the drafter at `source` (any layout `AutoDrafter` reads) and write it to `output` in `layout`
    ("hf_dspark", "deepspec", "speculators" or "zlab"; None: for an hf_dspark drafter deepspec, or speculators for
    a DFlash 2 drafter, which DeepSpec's layout cannot hold; else hf_dspark). `target` (a model or its folder) is
    checked against the drafter (`check_against_target`) and given to the export. Returns (the layout read, the
    layout written)."""
    from ..models.loading import load_drafter, load_target_model
    from .export_speculators import export_speculators
    from .export_zlab import export_zlab

    found = source_layout(source)
    if layout not in (None, "hf_dspark", "deepspec", "speculators", "zlab"):
        raise ValueError(f"no layout {layout!r}: write hf_dspark, deepspec, speculators or zlab")
    if isinstance(target, (str, Path)):
        target = load_target_model(target)
    drafter = load_drafter(source, None)
    if layout is None:
        ours = "speculators" if drafter_kind(drafter.config) == "dflash2" else "deepspec"
        layout = ours if found == "hf_dspark" else "hf_dspark"
    refused = getattr(drafter, "export_refusal", None)  # e.g. Kimi K3's MLA layers (models/modeling_dspark_mla.py)
    if refused:
        raise UserInputError(f"{source} cannot be written in {layout}'s layout: {refused}.")
    if target is not None:
        check_against_target(drafter, target, source, found)
    if layout == "hf_dspark":
        drafter.save_pretrained(output)
    elif layout == "deepspec":
        export_deepspec(drafter, output, target=target)
    elif layout == "speculators":
        export_speculators(drafter, output, target=target)
    else:
        export_zlab(drafter, output)
    return found, layout


def check_target_architecture(draft_config, target_config, source) -> None:
    """Refuse a target of another architecture than the one the drafter was built for (its `target_model_type`):
    one whose sizes happen to match passes every shape check, yet its hidden states mean something else."""
    wanted = getattr(draft_config, "target_model_type", None)
    found = target_text_config(target_config).model_type
    if wanted and wanted not in (found, target_config.model_type):
        raise DrafterTargetMismatchError(
            f"{source} is a drafter for a {wanted!r} target (target_model_type), but the target is a {found!r} "
            "model: matching sizes do not make its hidden states the ones the drafter reads. Pass the target the "
            "drafter was trained for.")


# ------------------------------------------------------------------------------------------------------------------
# Export: hf_dspark -> DeepSpec (what vLLM and SGLang load)
# ------------------------------------------------------------------------------------------------------------------


def export_deepspec(drafter: DSparkDraftModel | Eagle3DraftModel, folder: str | Path, target=None) -> Path:
    """Write `drafter` in DeepSpec's `Qwen3DSparkModel` / `Qwen3Eagle3Model` layout (flat config, safetensors,
    an explicit `sample_from_anchor`, the fields DeepSpec's loader asserts). With `target`, its embedding and LM
    head are included, in the target's dtype (DeepSpec's own loader wants them; vLLM and SGLang share the target's
    when absent, except for a draft vocabulary's LM head). A DFlash drafter gets a rank-1, all-zero vanilla Markov
    head (numerically the same drafter), which SGLang requires and which makes llama.cpp read its slots the right
    way."""
    kind = drafting_core(drafter)
    if kind not in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE):
        raise ValueError(f"DeepSpec's layouts hold DSpark/DFlash and Eagle3 drafters, not {type(drafter).__name__}")
    if drafter_kind(drafter.config) == "dflash2":
        raise UserInputError("DeepSpec's layouts have no DFlash 2 (its convolutions and candidate selector): write "
                             "the drafter in z-lab's (hf-dspark convert --to zlab) or speculators' layout "
                             "(--to speculators), or keep hf_dspark's (save_pretrained).")
    config = drafter.config
    architecture = deepspec_architecture(config)
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
    _check_drafting_options(config)
    for warning in export_warnings(config):
        logger.warning("%s export: %s", type(drafter).__name__, warning)
    draft_ids = drafter.draft_to_target
    if draft_ids is not None and target is None:
        raise ValueError("a drafter with a draft vocabulary exports its LM head rows (vLLM requires them with "
                         "d2t): pass the target")
    if target is not None:
        check_target_architecture(config, target.config, f"this {type(drafter).__name__}")
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
        if kind == BLOCK_DRAFTER_TYPE and config.markov_head is not None and not config.markov_w1_full_vocab:
            # our compact W1: draft rows + one shared row; DeepSpec's: one row per target token
            rows = weights[W1]
            full = rows[-1:].expand(vocab, -1).clone()
            full[draft_ids] = rows[:-1]
            weights[W1] = full
    if target is not None:
        head = target.get_output_embeddings().weight.detach().cpu()
        embedding = target.get_input_embeddings().weight.detach().cpu()
        # In the target's own dtype, not the drafter's: hf_dspark drafts with the target's tensors as they are, and
        # an engine that reads these copies (llama.cpp: the embedding, a draft vocabulary's head rows) must too.
        # clone(): a target with tied embeddings (SmolLM2, Qwen3-0.6B..4B, Gemma) shares one tensor between the two,
        # and safetensors refuses to write shared tensors.
        weights["embed_tokens.weight"] = embedding.clone().contiguous()
        weights["lm_head.weight"] = (head[draft_ids] if draft_ids is not None else head).clone().contiguous()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(deepspec_config(drafter, target), indent=2) + "\n")
    return folder


def _check_drafting_options(config) -> None:
    """Refuse drafting options DeepSpec's classes do not have (soft-capped logits only in its Gemma 4 ones)."""
    options = dict(getattr(config, "drafting_options", {}))
    if _gemma4(config):  # Gemma4DSparkModel soft-caps its logits with the config's final_logit_softcapping
        options.pop("final_logit_softcapping", None)
    elif getattr(config, "final_logit_softcapping", None) is not None:
        options["final_logit_softcapping"] = config.final_logit_softcapping
    if options:
        raise UserInputError(
            f"DeepSpec's layout cannot express {options}: its Qwen3DSparkModel (and vLLM, SGLang and llama.cpp reading "
            "it) drafts with uncapped logits, the target's embedding module and full, bidirectional attention in every "
            "layer, so this drafter would draft differently there. Keep it in hf_dspark's layout (save_pretrained) "
            "and load it with hf_dspark.AutoDrafter.from_pretrained(path).")


def _gemma4(config) -> bool:
    return getattr(config, "layer_style", "llama") == "gemma4"


def deepspec_architecture(config) -> str:
    """DeepSpec's class for a drafter config: Qwen3 layers, or Gemma 4 ones (`layer_style="gemma4"`)."""
    eagle3 = config.model_type == EAGLE3_DRAFTER_TYPE
    if _gemma4(config):
        return GEMMA4_EAGLE3_ARCHITECTURE if eagle3 else GEMMA4_DSPARK_ARCHITECTURE
    if getattr(config, "attention_k_eq_v", False):
        raise UserInputError("DeepSpec's Qwen3 layers have a v_proj, and this drafter (attention_k_eq_v, without "
                             "Gemma 4 layers) has none; keep it in hf_dspark's layout (save_pretrained).")
    return EAGLE3_ARCHITECTURE if eagle3 else DSPARK_ARCHITECTURE


def export_warnings(config) -> list[str]:
    """What the engines that read DeepSpec's layout cannot serve from this drafter's export (each engine's loader
    was read: vLLM 0.33 `qwen3_dspark.py`, SGLang 0.5.23 `models/dspark.py` and `dflash_utils.py`, llama.cpp
    `conversion/qwen.py`, DeepSpec `modeling/*/qwen3/modeling.py`)."""
    warnings = []
    if not served_by_vllm(config):
        warnings.append("DeepSpec's layout holds it exactly, but vLLM, SGLang and llama.cpp serve only DSpark with the "
                        "vanilla Markov head and DFlash from it")
    if config.model_type == EAGLE3_DRAFTER_TYPE:
        # llama.cpp build 11434: read in its converter (conversion/llama.py) and graph (src/models/eagle3.cpp); the
        # refusal is recorded by benchmarks/interop/llama_cpp.py, and a q/k-norm-free drafter's speculators export
        # was run there (same text and per-round accepted counts as hf_dspark).
        warnings.append(
            "llama.cpp cannot run this Eagle3 export: its converter has no Qwen3Eagle3Model, and its EAGLE3 is a "
            "Llama layer without per-head q/k norms reading exactly 3 target layers, while DeepSpec's Qwen3Eagle3Model "
            "always has q/k norms (renaming the export would drop them and change every draft). An Eagle3 drafter built "
            "with qk_norm=False and 3 target layers runs there from `hf-dspark convert --to speculators` "
            "(`--spec-type draft-eagle3`)")
    if config.draft_vocab_size and served_by_vllm(config):  # else no engine serves it anyway (said above)
        warnings.append(
            f"the draft vocabulary ({config.draft_vocab_size} of {config.vocab_size} tokens, d2t/t2d) is served by "
            "vLLM and llama.cpp only: SGLang cannot load it (its markov_w2 is full-vocabulary) and DeepSpec has no "
            "draft vocabulary (its lm_head has vocab_size rows). Train without --draft-vocab-size for those.")
    if EMBEDDING_OUTPUT in config.target_layer_ids:
        warnings.append("target_layer_ids contains -1 (the embedding output): DeepSpec, vLLM and llama.cpp read it, "
                        "SGLang refuses negative target layer ids")
    if _gemma4(config) and config.model_type == BLOCK_DRAFTER_TYPE:
        warnings.append("llama.cpp's converter reads DeepSpec's Qwen3DSparkModel only: it has no Gemma4DSparkModel "
                        "(Gemma 4 DSpark is an open request there, llama.cpp#25549)")
    return warnings


def deepspec_config(drafter: DSparkDraftModel | Eagle3DraftModel, target=None) -> dict:
    config = drafter.config
    architecture = deepspec_architecture(config)
    base = target.config.get_text_config().to_dict() if target is not None else {
        "model_type": config.target_model_type or "qwen3", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, "rope_parameters": config.rope_parameters,
        "attention_bias": config.attention_bias}
    for key in ("auto_map", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "layer_types",
                "sliding_window", "max_window_layers", "use_sliding_window", "per_layer_config"):
        base.pop(key, None)
    if _gemma4(config):  # Gemma4TextConfig's fields as transformers 5.10 (DeepSpec's pin) writes them
        base.pop("hidden_act", None)  # Gemma's name is hidden_activation
        base.update(deepspec_gemma4.export_fields(config, target.config.get_text_config() if target else None))
    common = {
        "num_target_layers": config.target_num_hidden_layers,
        "num_hidden_layers": config.num_hidden_layers,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "target_layer_ids": list(config.target_layer_ids),
    }
    if config.draft_vocab_size:
        common["draft_vocab_size"] = config.draft_vocab_size
    # transformers 5 writes rope_parameters only; DeepSpec's Qwen3 code and engines on transformers 4 read these.
    rope = dict(config.rope_parameters)
    if not _gemma4(config):  # Gemma 4's rotary parameters are per layer type (rope_parameters) only
        common["rope_theta"] = rope.get("rope_theta", 10000.0)
        common["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else \
            {**rope, "type": rope["rope_type"]}
    common["attention_bias"] = config.attention_bias
    common["torch_dtype"] = str(next(drafter.parameters()).dtype).replace("torch.", "")
    if drafting_core(drafter) == EAGLE3_DRAFTER_TYPE:
        fields = {"architectures": [architecture], "ttt_length": config.block_size,
                  "draft_num_hidden_layers": config.num_hidden_layers,
                  # vLLM's eagle3 reads the capture indices (HF hidden_states indices: layer id + 1).
                  "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids]}
        return _with_deepspec_fields({**base, **common, **fields}, config, architecture)
    rank = config.markov_rank if config.markov_head is not None else 1  # DFlash: the rank-1 zero head
    head_type = config.markov_head if config.markov_head is not None else "markov"
    fields = {
        "architectures": [architecture],
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "enable_confidence_head": bool(config.confidence_head),
        "markov_rank": rank,
        "markov_head_type": {v: k for k, v in MARKOV_TYPES.items()}[head_type],
        # Said explicitly either way: True, slot k predicts anchor + k + 1 (DeepSpec's convention); False, slot j
        # predicts anchor + j (a speculators / z-lab drafter), which vLLM also reads as a bonus anchor slot.
        "sample_from_anchor": bool(config.sample_from_anchor),
        "dspark_bonus_anchor": not config.sample_from_anchor,
    }
    if config.confidence_head:
        fields["confidence_head_with_markov"] = True  # [h_k ; W1[x_{k-1}]], as ours (the zero head's W1 for DFlash)
    return _with_deepspec_fields({**base, **common, **fields}, config, architecture)


def _with_deepspec_fields(exported: dict, config, architecture: str) -> dict:
    """Add the DeepSpec fields kept from an import (never overriding what the export wrote), then the defaults of
    the fields DeepSpec's loader asserts."""
    for key, value in (getattr(config, "deepspec_fields", None) or {}).items():
        exported.setdefault(key, value)
    for key, value in DEEPSPEC_DEFAULTS[architecture].items():
        exported.setdefault(key, value)
    return exported
