"""hf_dspark's DFlash and DFlash 2 drafters written out in z-lab's layout (the `dflash` package, 0.1.0: what its
`DFlashDraftModel` / `DFlash2DraftModel.from_pretrained` read); `hf_dspark.models.formats.zlab_dflash` reads it
back. The tensors keep their names (z-lab's are ours); the config is a Qwen3Config with the draft settings in its
`dflash_config`. What z-lab's classes cannot compute exactly is refused, never approximated."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from ..models.errors import UserInputError
from ..models.formats.zlab_dflash import DFLASH2_CLASS, DFLASH_CLASS
from ..models.identity import drafter_kind

_DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def export_zlab(drafter, folder: str | Path) -> Path:
    """Write `drafter` (a DFlash or DFlash 2 drafter whose slot j predicts anchor + j) into `folder` as z-lab's
    save_pretrained writes it: config.json + model.safetensors, in the drafter's dtype."""
    kind = drafter_kind(drafter.config)
    config = drafter.config
    _check_exportable(config, kind)
    settings = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                "block_size": config.block_size}
    if config.final_logit_softcapping is not None:
        settings["final_logit_softcapping"] = config.final_logit_softcapping
    if config.input_embedding_scale is not None:
        settings["input_embedding_scale"] = config.input_embedding_scale
    if kind == "dflash2":
        settings.update({name: getattr(config, name) for name in _DFLASH2_SETTINGS})
    document = {**_qwen3_fields(config), "dflash_config": settings,
                "architectures": [DFLASH2_CLASS if kind == "dflash2" else DFLASH_CLASS],
                "dtype": str(drafter.dtype).removeprefix("torch.")}
    if config.target_num_hidden_layers is not None:
        document["num_target_layers"] = config.target_num_hidden_layers
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in drafter.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def _check_exportable(config, kind: str | None) -> None:
    """Everything z-lab's DFlashDraftModel / DFlash2DraftModel (Qwen3 layers, the target's full vocabulary, slot j
    predicting anchor + j) cannot hold, in one refusal."""
    if kind not in ("dflash", "dflash2"):
        raise UserInputError(f"z-lab's layout holds DFlash and DFlash 2 drafters, not a {kind or 'non-drafter'} one "
                             "(DSpark's heads and Eagle3 have no z-lab class); write it in DeepSpec's or "
                             "speculators' layout.")
    reasons = []
    if config.sample_from_anchor:
        reasons.append("sample_from_anchor is true (slot k predicts anchor + k + 1), but z-lab's slot j predicts "
                       "anchor + j and never reads slot 0; the same weights read that way draft other tokens, so "
                       "train the drafter with sample_from_anchor=False to export it there")
    if config.draft_vocab_size is not None:
        reasons.append(f"a draft vocabulary of {config.draft_vocab_size} tokens, which z-lab's drafters (over the "
                       "target's whole LM head) do not have")
    if not config.qk_norm:
        reasons.append("qk_norm is false, but z-lab's layers always normalise queries and keys")
    if config.layer_style != "llama" or config.attention_k_eq_v:
        reasons.append(f"layer_style={config.layer_style!r} / attention_k_eq_v={config.attention_k_eq_v}: z-lab's "
                       "layers are Qwen3's")
    causal = [causal for causal, _ in config.layer_attention]
    sliding = [window is not None for _, window in config.layer_attention]
    # z-lab makes a layer block-causal when `is_causal` says so, else when it is a sliding layer.
    if len(set(causal)) > 1 and causal != sliding:
        reasons.append(f"block_causal={config.block_causal} with layer_types={config.layer_types}: z-lab's "
                       "is_causal makes every layer causal or none, or (unset) exactly its sliding layers")
    if reasons:
        raise UserInputError(f"this drafter cannot be written exactly in z-lab's layout: {'; '.join(reasons)}.")


def _qwen3_fields(config) -> dict:
    """The Qwen3Config fields z-lab's classes build the layers from, and the attention of each layer (`is_causal`,
    `layer_types`, `sliding_window`) as z-lab's rule reads them back."""
    from transformers import Qwen3Config

    causal = [causal for causal, _ in config.layer_attention]
    window = config.sliding_window
    fields = {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
              "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
              "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
              "max_position_embeddings": config.max_position_embeddings,
              "rope_parameters": dict(config.rope_parameters), "attention_bias": config.attention_bias,
              "initializer_range": config.initializer_range, "tie_word_embeddings": False,
              "layer_types": list(config.layer_types or ["full_attention"] * config.num_hidden_layers),
              "use_sliding_window": window is not None, "sliding_window": window}
    sliding = [window is not None for _, window in config.layer_attention]
    if causal != sliding:  # the default rule would not give these layers' attention: say it
        fields["is_causal"] = causal[0]
    return Qwen3Config(**fields).to_dict()  # as transformers writes it for z-lab's save_pretrained


__all__ = ["export_zlab"]
