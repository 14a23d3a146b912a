"""z-lab DFlash drafters (`dflash` on PyPI: `DFlashDraftModel`, and `DFlash2DraftModel`, DFlash 2), read into a
`DSparkDraftModel` (a `DFlash2DraftModel`) in memory.

z-lab saves a Qwen3Config (model_type "qwen3") with a nested `dflash_config` (`mask_token_id`, `target_layer_ids`,
`block_size`, ...) and the weights of `fc`, `hidden_norm`, `layers.*` and `norm` under exactly our names: the same
backbone as hf_dspark's DFlash (target features fused by fc + RMSNorm and injected as keys/values in every layer,
per-head q/k norms, rotary positions continuing the context's, one bidirectional block). Its slot j predicts the
token at anchor + j and slot 0 is never read, so the drafter loads with `sample_from_anchor=False`. Its
`target_layer_ids` mean ours: decoder layer i is HF `hidden_states[i + 1]`. z-lab embeds the block with its
target's raw embedding rows, hf_dspark through the target's embedding module: the same for the plain lookups of the
targets z-lab publishes drafters for (Qwen3, Qwen3.5, Llama 3.1, gpt-oss), not for a scaled embedding (Gemma's).

Like z-lab's own code, a dflash_config value falls back to the top-level field of the same name, then to z-lab's
default. z-lab's optional settings map to DSparkDraftConfig fields of the same meaning: `final_logit_softcapping`
(when positive), `input_embedding_scale` (when not 1: the target's raw embedding rows times it), `is_causal` and
`layer_types` / `sliding_window` (per layer `block_causal` and sliding windows, by z-lab's rule: a sliding layer is
block-causal unless `is_causal` says otherwise). What hf_dspark's drafter does not build (a learned mask embedding,
attention kinds other than full and sliding) is refused with one error naming each field, never loaded approximately.

DFlash 2 (`architectures: ["DFlash2DraftModel"]`, or no z-lab class named and `conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k` set) loads as hf_dspark's `DFlash2DraftModel`, whose tensors have z-lab's names
(`layers.<i>.attention_conv.{base_kernel, kernel_projection.weight}`, `layers.<i>.mlp_conv.*`,
`candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection}.weight`); the codebooks may also
be stored without `.weight`, which z-lab's `DFlash2DraftModel.from_pretrained` maps the same way.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from ..config_checks import check_config_fields, is_finite_number
from ..errors import DrafterLoadError
from ..target_info import EMBEDDING_OUTPUT
from ..configuration_dflash2 import DFlash2DraftConfig
from ..configuration_dspark import DSparkDraftConfig
from ..modeling_dflash2 import DFlash2DraftModel
from ..modeling_dspark import DSparkDraftModel
from ..weight_files import check_fits_before_building, read_checkpoint_tensors
from .qwen3_shell import dspark_config

FORMAT = "zlab_dflash"

DFLASH_CLASS = "DFlashDraftModel"
DFLASH2_CLASS = "DFlash2DraftModel"
BLOCK_SIZE_DEFAULT = 16  # z-lab's DFlashDraftModel when neither dflash_config nor config.json sets block_size
_HOW_TO_LOAD = "hf_dspark.AutoDrafter.from_pretrained(path)"

_USED_QWEN3_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "attention_bias", "initializer_range",
    # Each layer's attention: full or sliding window, block-causal or not (with is_causal).
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
}
_ZLAB_FIELDS = {"dflash_config", "num_target_layers", "is_causal", "model_type", "architectures"}
_IRRELEVANT_FIELDS = {
    # The drafter owns no embedding or LM head, drafts with the target's tokenizer, loads as float32 and runs
    # in eval mode; the rest is bookkeeping of transformers' save_pretrained (4.x and 5.x).
    "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "attention_dropout", "use_cache",
    "dtype", "torch_dtype", "transformers_version", "auto_map", "_name_or_path", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type",
}
_DRAFT_SETTINGS = {  # read from dflash_config, else the top-level field (z-lab's `_draft_value`)
    "mask_token_id", "target_layer_ids", "block_size", "output_multiplier", "final_logit_softcapping",
    "input_embedding_scale", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
}
_DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_BARE_CODEBOOKS = {f"candidate_selector.{name}": f"candidate_selector.{name}.weight"
                   for name in ("predecessor_codebook", "successor_codebook")}
"""Codebook names z-lab's `DFlash2DraftModel.from_pretrained` maps to the modules' `.weight` (its `key_mapping`)."""


def matches(config: dict) -> bool:
    """A config.json written by z-lab's `DFlashDraftModel` / `DFlash2DraftModel` (their class in `architectures`,
    or a Qwen3 config carrying a `dflash_config`)."""
    architectures = config.get("architectures")
    named = isinstance(architectures, list) and bool({DFLASH_CLASS, DFLASH2_CLASS} & set(map(str, architectures)))
    return named or (config.get("model_type") == "qwen3" and isinstance(config.get("dflash_config"), dict))


def load(folder: Path, config: dict) -> DSparkDraftModel:
    """The z-lab DFlash drafter in `folder` (its config.json read as `config`) as a float32 `DSparkDraftModel` (a
    `DFlash2DraftModel` for DFlash 2) in eval mode on the CPU, every stored tensor used. It shares its target's
    embedding and LM head, as z-lab's does (attached by generate())."""
    folder = Path(folder)
    source = f"{folder / 'config.json'}"
    _refuse_trainer_pickles(folder)
    settings = _draft_settings(config, source)
    # Every value as z-lab's code reads it (dflash_config over the top level), before anything is built; z-lab's
    # own settings keep their own checks (a soft cap <= 0 means none; attention kinds are named below).
    check_config_fields({**config, **settings}, source, aliases={"num_target_layers": "target_num_hidden_layers"},
                        skip=("dflash_config", "final_logit_softcapping"))
    qwen3 = _qwen3_config(config, source)
    _refuse_unsupported(config, settings, qwen3, source)
    dflash2 = is_dflash2(config, settings)
    ours = _our_config(config, settings, qwen3, source, dflash2)
    model_class = DFlash2DraftModel if dflash2 else DSparkDraftModel
    state = read_checkpoint_tensors(folder, "z-lab DFlash drafter", "save the drafter with z-lab's save_pretrained")
    state = {_BARE_CODEBOOKS.get(name, name): tensor for name, tensor in state.items()}
    check_fits_before_building(model_class, ours, state, folder, "z-lab DFlash drafter",
                               "Restore the folder (config.json and weights) as z-lab's save_pretrained wrote it.")
    drafter = model_class(ours)
    multiplier = settings.get("output_multiplier", 1.0)
    if multiplier != 1.0:
        # z-lab scales the logits W (g * x_hat); logits are linear in the final norm's weight g: fold it in.
        state["norm.weight"] = state["norm.weight"].float() * multiplier
        if dflash2:  # its selector reads the unscaled final state: W (g * x_hat) = (W / m)(m g * x_hat)
            name = "candidate_selector.hidden_projection.weight"
            state[name] = state[name].float() / multiplier
    drafter.load_state_dict(state, strict=True)
    return drafter.float().eval()


# -- config ------------------------------------------------------------------------------------------------------


def _draft_settings(config: dict, source: str) -> dict:
    """The draft settings as z-lab's code reads them: dflash_config first, then the top-level field; an unknown
    dflash_config key is an error."""
    nested = config.get("dflash_config", {})
    if not isinstance(nested, dict):
        raise DrafterLoadError(f"{source} has dflash_config={nested!r}, which is not a JSON object; restore the "
                               "config.json saved with the drafter.")
    unknown = sorted(set(nested) - _DRAFT_SETTINGS)
    if unknown:
        raise DrafterLoadError(
            f"{source} has dflash_config fields hf_dspark does not know: {unknown}. Loading without them could "
            f"change what the drafter computes, so it is refused; hf_dspark reads {sorted(_DRAFT_SETTINGS)} "
            "(z-lab's dflash 0.1.0).")
    settings = {name: nested[name] if name in nested else config[name] for name in _DRAFT_SETTINGS
                if name in nested or name in config}
    for name in ("output_multiplier", "input_embedding_scale", "final_logit_softcapping"):
        if name not in settings:
            continue
        switched_off = settings[name] is None and name == "final_logit_softcapping"  # z-lab: None means no cap
        if not switched_off and not is_finite_number(settings[name]):
            raise DrafterLoadError(f"{source} has {name}={settings[name]!r}; z-lab's dflash needs a number there.")
    return settings


def _qwen3_config(config: dict, source: str):
    """config.json through transformers' Qwen3Config, as z-lab's class reads it (legacy rope_theta / rope_scaling
    become rope_parameters, layer_types is derived from use_sliding_window / max_window_layers when absent)."""
    from transformers import Qwen3Config

    if config.get("model_type") != "qwen3":
        raise DrafterLoadError(f"{source} has model_type {config.get('model_type')!r}; z-lab's DFlashDraftModel "
                               "saves a Qwen3 config (model_type \"qwen3\"). Restore the config.json saved with it.")
    unknown = sorted(set(config) - _USED_QWEN3_FIELDS - _ZLAB_FIELDS - _IRRELEVANT_FIELDS - _DRAFT_SETTINGS)
    if unknown:
        raise DrafterLoadError(
            f"{source} has fields hf_dspark does not know for a z-lab DFlash drafter: {unknown}. Loading without them "
            "could change what the drafter computes, so it is refused.")
    try:
        return Qwen3Config.from_dict(dict(config))
    except (ValueError, TypeError, KeyError, StrictDataclassError) as error:
        raise DrafterLoadError(f"{source} is not a valid Qwen3 config ({error}); restore the config.json saved "
                               "with the drafter.") from None


def _refuse_unsupported(config: dict, settings: dict, qwen3, source: str) -> None:
    """One error naming every feature of the checkpoint that hf_dspark's DSparkDraftModel does not build."""
    problems = []
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise DrafterLoadError(f"{source} has architectures={architectures!r}, which is not a list; restore the "
                               "config.json saved with the drafter.")
    dflash2 = [name for name in _DFLASH2_SETTINGS if name in settings]
    if DFLASH_CLASS in architectures and dflash2:
        problems.append(f"architectures={architectures} with DFlash 2's {dflash2}: z-lab's {DFLASH_CLASS} ignores "
                        f"them, its {DFLASH2_CLASS} needs them; name the class the drafter was trained as")
    elif is_dflash2(config, settings) and len(dflash2) < len(_DFLASH2_SETTINGS):
        missing = [name for name in _DFLASH2_SETTINGS if name not in settings]
        problems.append(f"{missing} missing: z-lab's {DFLASH2_CLASS} needs every one of {list(_DFLASH2_SETTINGS)}")
    if [name for name in architectures if name not in (DFLASH_CLASS, DFLASH2_CLASS)] or len(architectures) > 1:
        problems.append(f"architectures={architectures}: hf_dspark reads z-lab's {DFLASH_CLASS} and "
                        f"{DFLASH2_CLASS}, one of them")
    if is_dflash2(config, settings) and settings.get("output_multiplier", 1.0) == 0:
        problems.append("output_multiplier=0: every draft logit is 0, so the selector's candidates are arbitrary")
    layer_types = list(qwen3.layer_types or ["full_attention"] * qwen3.num_hidden_layers)
    if [kind for kind in layer_types if kind not in ("full_attention", "sliding_attention")]:
        problems.append(f"layer_types={layer_types}: z-lab's drafter knows full_attention and sliding_attention")
    if problems:
        raise DrafterLoadError(f"{source} uses what hf_dspark's DSparkDraftModel does not build, so it cannot be "
                               f"loaded exactly and is refused: {'; '.join(problems)}.")


def is_dflash2(config: dict, settings: dict) -> bool:
    """Whether the checkpoint is z-lab's DFlash 2: its class named, or no class named and its settings present."""
    architectures = config.get("architectures") or []
    return DFLASH2_CLASS in architectures or (
        DFLASH_CLASS not in architectures and any(name in settings for name in _DFLASH2_SETTINGS))


def _optional_settings(config: dict, settings: dict, qwen3, source: str) -> dict:
    """z-lab's optional settings as DSparkDraftConfig fields (None / False where z-lab's drafter does not use them).

    Attention, per layer as z-lab's Qwen3DFlashAttention decides it: a sliding_attention layer attends within
    `sliding_window` positions (when the Qwen3 config keeps one: use_sliding_window) and is block-causal unless
    `is_causal` says otherwise; `is_causal` set makes every layer causal or every layer bidirectional."""
    is_causal = config.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise DrafterLoadError(f"{source} has is_causal={is_causal!r}; z-lab's dflash reads true, false or null.")
    layer_types = list(qwen3.layer_types or ["full_attention"] * qwen3.num_hidden_layers)
    causal = [kind == "sliding_attention" if is_causal is None else is_causal for kind in layer_types]
    window = qwen3.sliding_window if "sliding_attention" in layer_types else None
    softcap = settings.get("final_logit_softcapping")
    scale = float(settings.get("input_embedding_scale", 1.0))
    return {
        "block_causal": causal[0] if len(set(causal)) == 1 else causal,
        "layer_types": layer_types if window is not None else None,
        "sliding_window": window,
        "final_logit_softcapping": float(softcap) if softcap is not None and softcap > 0 else None,  # z-lab: > 0
        "input_embedding_scale": scale if scale != 1.0 else None,
    }


def _our_config(config: dict, settings: dict, qwen3, source: str, dflash2: bool) -> DSparkDraftConfig:
    mask_token_id = settings.get("mask_token_id")
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int):
        raise DrafterLoadError(f"{source} has mask_token_id={mask_token_id!r} (dflash_config): z-lab's drafter "
                               "needs the integer id whose embedding fills the block's mask slots.")
    if not 0 <= mask_token_id < qwen3.vocab_size:
        raise DrafterLoadError(
            f"{source} has mask_token_id={mask_token_id}, outside the vocabulary of {qwen3.vocab_size}: the drafter "
            "was trained with a mask embedding its target does not have, which hf_dspark's drafter (embedding mask "
            "slots with the target's row) cannot reproduce.")
    block_size = settings.get("block_size", BLOCK_SIZE_DEFAULT)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise DrafterLoadError(f"{source} has block_size={block_size!r}: a z-lab block is [anchor, mask x "
                               "(block_size - 1)], so it needs an integer of at least 2.")
    depth = config.get("num_target_layers")
    layer_ids = settings.get("target_layer_ids")
    if layer_ids is None:
        if not isinstance(depth, int):
            raise DrafterLoadError(f"{source} has neither target_layer_ids nor num_target_layers: the target "
                                   "layers the drafter reads are unknown. Restore the config.json saved with it.")
        layer_ids = zlab_default_layer_ids(depth, qwen3.num_hidden_layers)
    bad = [i for i in layer_ids if isinstance(i, bool) or not isinstance(i, int) or i < EMBEDDING_OUTPUT] \
        if isinstance(layer_ids, list) and layer_ids else [layer_ids]
    if bad:
        raise DrafterLoadError(f"{source} has target_layer_ids={layer_ids!r}: expected a list of decoder layer "
                               "indices (0, 1, ...; -1 for the embedding output).")
    optional = _optional_settings(config, settings, qwen3, source)
    if dflash2:
        optional.update({name: settings[name] for name in _DFLASH2_SETTINGS})
    return dspark_config(qwen3, source, DFlash2DraftConfig if dflash2 else DSparkDraftConfig,
                         block_size=block_size, sample_from_anchor=False,
                         target_layer_ids=list(layer_ids),
                         target_num_hidden_layers=depth if isinstance(depth, int) else None,
                         mask_token_id=mask_token_id, markov_head=None, markov_rank=0, confidence_head=False,
                         **optional)


def zlab_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's target layers when a config names none: the middle layer for a 1-layer drafter, else
    `num_draft_layers` layers spread evenly from layer 1 to layer L - 3 (rounded half to even, as Python rounds)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# -- files ---------------------------------------------------------------------------------------------------------


def _refuse_trainer_pickles(folder: Path) -> None:
    """DFlash trainers save beside the drafter what z-lab's package never reads: `mask_embedding.pt` (the mask
    token's embedding row) and `embeddings.pt` (a trained embedding and LM head). Both are torch pickles, which
    hf_dspark never unpickles, and both would change the drafter's inputs or outputs if they differ from the
    target's own, so they are refused rather than ignored."""
    if (folder / "mask_embedding.pt").exists():
        raise DrafterLoadError(
            f"{folder / 'mask_embedding.pt'} is a torch pickle (hf_dspark never unpickles one) holding the embedding "
            "its trainer gave the block's mask slots. hf_dspark's drafter, like z-lab's dflash package (which never "
            "reads this file), embeds them with the target's embedding row mask_token_id, and has no learned mask "
            "embedding. If the trainer kept that row frozen (the file then equals it), move mask_embedding.pt out "
            f"of the folder and load again with {_HOW_TO_LOAD}; otherwise the drafter needs its own mask embedding, "
            "which hf_dspark does not support.")
    if (folder / "embeddings.pt").exists():
        raise DrafterLoadError(
            f"{folder / 'embeddings.pt'} is a torch pickle (hf_dspark never unpickles one) holding an input "
            "embedding and LM head its trainer trained with the drafter, while hf_dspark's drafter, like z-lab's, "
            "drafts with its target's own. Use a drafter trained with the target's embedding and LM head frozen.")
