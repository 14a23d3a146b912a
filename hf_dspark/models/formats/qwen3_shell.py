"""What two DSpark layouts published since DeepSpec share, read into a `DSparkDraftModel`: a Qwen3 config.json
"shell" (`model_type: qwen3`, the drafter's own sizes, the draft settings in a nested `dflash_config`, as z-lab's
DFlash saves them) around z-lab's DFlash backbone tensors and DeepSpec's DSpark heads. Used by `specforge_dspark`
(SpecForge / RadixArk `DSparkDraftModel`) and `lfm2_dspark` (LiquidAI's `Lfm2DSparkDraftModel`), and for its heads
by `k3_dspark`; each names the sources of its own fields.

Tensors (both layouts; every other name is ours too): `fc.weight`, `hidden_norm.weight`, `norm.weight`,
`layers.<i>.{input_layernorm, post_attention_layernorm}.weight`, `layers.<i>.self_attn.{q,k,v,o}_proj.weight`,
`layers.<i>.self_attn.{q,k}_norm.weight`, `layers.<i>.mlp.{gate,up,down}_proj.weight` (z-lab / SpecForge
`Qwen3DFlashDecoderLayer`), and DeepSpec's head names (`deepspec.HEAD_NAMES`: `markov_head.markov_w1/w2`,
`markov_head.gate_proj`, `markov_head.joint_proj`, `confidence_head.proj`). Neither layout stores the target's
embedding or LM head: generate() attaches the target's.

The Qwen3 fields are read through transformers' `Qwen3Config` (legacy `rope_theta` / `rope_scaling` become
`rope_parameters`, as the publishers' own `Qwen3RotaryEmbedding` reads them). Unknown fields, sliding-window layers
and anything else the drafter would compute differently are refused before any tensor is read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from ..config_checks import check_config_fields
from ..configuration_dspark import DSparkDraftConfig
from ..errors import DrafterLoadError
from ..modeling_dspark import DSparkDraftModel
from ..weight_files import check_fits_before_building
from .deepspec import HEAD_NAMES, W1
from .deepspec_config import MARKOV_TYPES

QWEN3_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "attention_bias", "initializer_range",
    # checked to describe full attention in every layer (the publishers' configs all do)
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
}
BOOKKEEPING = {
    # the drafter owns no embedding or LM head, drafts with its target's tokenizer, runs in eval mode; the rest is
    # transformers' save_pretrained bookkeeping (4.x and 5.x)
    "model_type", "architectures", "auto_map", "tie_word_embeddings", "pad_token_id", "bos_token_id",
    "eos_token_id", "attention_dropout", "use_cache", "dtype", "torch_dtype", "transformers_version",
    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type",
}
_MISSING = object()


def nested_settings(config: dict, field: str, allowed, source: str, reader: str) -> dict:
    """The JSON object `config[field]` (empty when absent), every key known (`allowed`)."""
    nested = config.get(field, {})
    if not isinstance(nested, dict):
        raise DrafterLoadError(f"{source} has {field}={nested!r}, which is not a JSON object; restore the "
                               "config.json saved with the drafter.")
    unknown = sorted(set(nested) - set(allowed))
    if unknown:
        raise DrafterLoadError(
            f"{source} has {field} field(s) {unknown} that hf_dspark's {reader} reader does not know; loading "
            f"without them could change what the drafter computes, so it is refused (it reads {sorted(allowed)}).")
    return nested


def setting(name: str, nested: dict, config: dict, source: str, default=_MISSING, where: str = "dflash_config"):
    """`name` from the nested settings, else the top-level field of the same name, else `default`; both present and
    different is refused (exports rewritten for SGLang copy nested fields to the top level)."""
    if name in nested and name in config and nested[name] != config[name]:
        raise DrafterLoadError(f"{source} has {name}={config[name]!r} and {where}.{name}={nested[name]!r}, which "
                               "disagree; keep the value the drafter was trained with in both.")
    if name in nested:
        return nested[name]
    if name in config:
        return config[name]
    if default is _MISSING:
        raise DrafterLoadError(f"{source} lacks {name} (in {where} or at the top level), which the drafter needs; "
                               "restore the config.json saved with it.")
    return default


def qwen3_config(config: dict, source: str, own_fields, reader: str):
    """The shell's Qwen3 fields through transformers' `Qwen3Config`, once every top-level field is known (Qwen3's,
    bookkeeping, or the layout's `own_fields`), typed, and describes full attention in every layer."""
    from transformers import Qwen3Config

    unknown = sorted(set(config) - QWEN3_FIELDS - BOOKKEEPING - set(own_fields))
    if unknown:
        raise DrafterLoadError(
            f"{source} has field(s) {unknown} that hf_dspark's {reader} reader does not know, so it cannot tell "
            "whether they change the drafter's outputs and refuses rather than ignore them.")
    if config.get("model_type") != "qwen3":
        raise DrafterLoadError(f"{source} has model_type {config.get('model_type')!r}; the {reader} layout saves a "
                               "Qwen3 config (model_type \"qwen3\"). Restore the config.json saved with it.")
    check_config_fields({k: v for k, v in config.items() if k in QWEN3_FIELDS}, source)
    sliding = [kind for kind in config.get("layer_types") or [] if kind != "full_attention"]
    if sliding or config.get("use_sliding_window"):
        raise DrafterLoadError(
            f"{source} has layer_types={config.get('layer_types')} / use_sliding_window="
            f"{config.get('use_sliding_window')}: the {reader} drafters published so far attend over the whole "
            "context, and how this layout masks a sliding drafter layer is not pinned down by its publisher's "
            "inference code; supporting it would take that rule in DSparkDraftConfig.layer_attention.")
    try:
        return Qwen3Config.from_dict({k: v for k, v in config.items() if k in QWEN3_FIELDS})
    except (ValueError, TypeError, KeyError, StrictDataclassError) as error:
        raise DrafterLoadError(f"{source} is not a valid Qwen3 config ({error}); restore the config.json saved "
                               "with the drafter.") from None


def heads_settings(rank, head_type, confidence, with_markov, source: str) -> tuple:
    """(our markov_head or None, rank, confidence head?) from a layout's DSpark head fields, checked."""
    check_config_fields({"markov_rank": rank, "enable_confidence_head": confidence}, source,
                        aliases={"enable_confidence_head": "confidence_head"})
    if not isinstance(with_markov, bool):
        raise DrafterLoadError(f"{source} has confidence_head_with_markov={with_markov!r}; write true or false.")
    if rank and (not isinstance(head_type, str) or head_type not in MARKOV_TYPES):
        raise DrafterLoadError(f"{source} has markov_head_type={head_type!r}; the DSpark heads are "
                               f"{sorted(MARKOV_TYPES)}, which hf_dspark reads. Another head needs its own support.")
    if confidence and with_markov and not rank:
        raise DrafterLoadError(f"{source} has confidence_head_with_markov true with markov_rank 0: the confidence "
                               "head would read a Markov head the drafter does not have (the publishers refuse it).")
    return (MARKOV_TYPES[head_type] if rank else None), rank, confidence


def dspark_config(qwen3, source: str, config_class=DSparkDraftConfig, **fields) -> DSparkDraftConfig:
    """Our config (`config_class`: DSpark's, or a subclass such as DFlash 2's): the Qwen3 shell's sizes with the
    layout's draft settings (`fields`)."""
    try:
        return config_class(
            vocab_size=qwen3.vocab_size, hidden_size=qwen3.hidden_size, intermediate_size=qwen3.intermediate_size,
            num_hidden_layers=qwen3.num_hidden_layers, num_attention_heads=qwen3.num_attention_heads,
            num_key_value_heads=qwen3.num_key_value_heads, head_dim=qwen3.head_dim, hidden_act=qwen3.hidden_act,
            rms_norm_eps=qwen3.rms_norm_eps, max_position_embeddings=qwen3.max_position_embeddings,
            rope_parameters=dict(qwen3.rope_parameters), attention_bias=bool(qwen3.attention_bias), qk_norm=True,
            initializer_range=qwen3.initializer_range, target_model_type=None, **fields)
    except (ValueError, TypeError, StrictDataclassError) as error:  # the last: DSparkDraftConfig's own checks
        raise DrafterLoadError(f"{source} does not describe a drafter hf_dspark can build ({error}).") from None


def our_state(weights: dict, ours: DSparkDraftConfig, confidence_with_markov: bool, renamed=None) -> dict:
    """The stored tensors under our names (`renamed`: a layout's extra old -> new names first). A confidence head that
    reads h_k alone (`confidence_with_markov` false) beside a Markov head gets zero columns for W1[x_{k-1}], which
    ours also reads: the same logit (as many columns as the stored W1 has; a wrong rank fails the shape check)."""
    state = {}
    for name, tensor in weights.items():
        name = (renamed or {}).get(name, name)
        state[HEAD_NAMES.get(name, name)] = tensor
    proj, w1 = state.get("confidence_proj.weight"), weights.get(W1)
    if proj is not None and ours.markov_head is not None and not confidence_with_markov and w1 is not None \
            and w1.dim() == 2:
        state["confidence_proj.weight"] = torch.cat([proj, proj.new_zeros(proj.shape[0], w1.shape[1])], dim=1)
    return state


def built(folder: Path, ours: DSparkDraftConfig, state: dict, what: str, fix: str,
          stored_name=lambda name: name, prepare=lambda state: state) -> DSparkDraftModel:
    """The drafter, once every stored tensor fits the config (names and shapes, on the meta device first), loaded
    strictly, float32, in eval mode. `prepare(state)` rewrites the fitting tensors before they load (a reordering
    that allocates by the config's sizes runs only once those are known to be the weights')."""
    theirs = {ours_name: their_name for their_name, ours_name in HEAD_NAMES.items()}
    check_fits_before_building(DSparkDraftModel, ours, state, folder, what, fix,
                               stored_name=lambda name: stored_name(theirs.get(name, name)))
    state = prepare(state)
    drafter = DSparkDraftModel(ours)
    drafter.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in state.items()}, strict=True)
    return drafter.float().eval()


__all__ = ["BOOKKEEPING", "QWEN3_FIELDS", "built", "dspark_config", "heads_settings", "nested_settings",
           "our_state", "qwen3_config", "setting"]
