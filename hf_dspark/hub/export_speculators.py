"""hf_dspark drafters written out in `vllm-project/speculators`' layout (0.9.0: what its `from_pretrained` reads
and vLLM serves natively); `hf_dspark.models.formats.speculators` reads it back. Names and fields are mapped as
that module describes; what speculators cannot hold exactly is refused, never approximated."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.errors import UserInputError
from ..models.configuration_dspark import DSparkDraftConfig
from ..models.formats.speculators import (
    _CLASS_NAMES, _DFLASH2_FIELDS, _HEAD_TYPES, _OURS_TO_THEIRS, _W1, _W2, WRITTEN_VERSION,
)
from ..models.identity import drafter_kind
from ..models.modeling_dspark import DSparkDraftModel
from ..models.modeling_eagle3 import Eagle3DraftModel


def export_speculators(drafter, folder: str | Path, target=None) -> Path:
    """Write `drafter` into `folder` as speculators 0.9.0 saves it (config.json + model.safetensors), what its
    `SpeculatorModel.from_pretrained` and vLLM load. `target` (or the heads the drafter has attached) gives the LM
    head rows a draft vocabulary needs and Eagle3's embedding / LM head, and is named as the verifier."""
    if isinstance(drafter, Eagle3DraftModel):
        kind = "eagle3"
    elif drafter_kind(drafter.config) == "dflash2":
        kind = "dflash2"
    elif isinstance(drafter, DSparkDraftModel):
        kind = "dflash" if drafter.config.is_dflash else "dspark"
    else:
        raise UserInputError(f"export to speculators takes a DSparkDraftModel or Eagle3DraftModel, got "
                             f"{type(drafter).__name__}.")
    config = drafter.config
    _check_layers_exportable(config, kind)
    if kind != "eagle3":
        _check_block_exportable(config)
    if kind == "dflash2" and config.draft_vocab_size is not None:
        raise UserInputError(f"this DFlash 2 drafter drafts over a draft vocabulary of {config.draft_vocab_size} "
                             "tokens, which speculators' DFlash2DraftModel refuses (its selector covers the full "
                             "vocabulary); keep it in hf_dspark's layout (save_pretrained).")
    ids = list(config.target_layer_ids)
    if len(set(ids)) != len(ids):
        raise UserInputError(f"target_layer_ids {ids} repeat a layer, which speculators refuses.")
    if target is not None:
        drafter.check_compatible(target.config)
    heads = _export_heads(drafter, target)
    needs_heads = kind == "eagle3" or config.draft_vocab_size is not None
    if needs_heads and heads is None:
        stored = "embedding and LM head" if kind == "eagle3" else "LM-head rows of the draft vocabulary"
        raise UserInputError(f"a speculators {kind} checkpoint stores its target's {stored}: pass target= (the model "
                             "the drafter was trained for) or attach the drafter to it first.")
    tensors = _export_tensors(drafter, heads if needs_heads else None, kind)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    layer_type = "llama" if kind == "eagle3" and not config.qk_norm else "qwen3"
    document = {**_export_settings(config, kind, sorted(ids)), "speculators_model_type": kind,
                "transformer_layer_config": _layer_fields(config, layer_type),
                "speculators_version": WRITTEN_VERSION,
                "architectures": [_CLASS_NAMES[kind]], "dtype": str(drafter.dtype).removeprefix("torch."),
                "tie_word_embeddings": False, "speculators_config": _proposal(config, kind, target)}
    (folder / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def _check_layers_exportable(config, kind: str) -> None:
    """speculators 0.9.0 builds every drafter layer from transformers' LlamaDecoderLayer / Qwen3DecoderLayer
    (`models/base_components.py`; DFlash / DSpark: `Qwen3DFlashDecoderLayer`) and never soft-caps logits."""
    gemma4 = getattr(config, "layer_style", "llama") == "gemma4"
    if gemma4 or getattr(config, "attention_k_eq_v", False) or \
            (kind == "eagle3" and config.final_logit_softcapping is not None):
        raise UserInputError(
            f"this {kind} drafter cannot be written exactly in speculators' layout: speculators 0.9.0 builds its "
            "layers from transformers' Llama / Qwen3 decoder layers and has no field for what this drafter's do "
            f"(layer_style={config.layer_style!r}, attention_k_eq_v={config.attention_k_eq_v}, "
            f"final_logit_softcapping={getattr(config, 'final_logit_softcapping', None)}): Gemma 4's sandwich norms "
            "and layer_scalar, an RMSNorm on the values, softmax scale 1, no v_proj, soft-capped logits. Export it "
            "to DeepSpec's layout (hf-dspark convert --to deepspec: Gemma4DSparkModel / Gemma4Eagle3Model) or keep "
            "it in hf_dspark's (save_pretrained).")


def _check_block_exportable(config: DSparkDraftConfig) -> None:
    reasons = []
    if not config.qk_norm:
        reasons.append("qk_norm is false, but speculators' DSpark/DFlash layers always normalise queries and keys")
    if config.confidence_temperatures is not None:
        reasons.append("confidence_temperatures (Sequential Temperature Scaling) has no speculators field; set it "
                       "to None to export the uncalibrated confidence head")
    if config.markov_head == "rnn" and not config.sample_from_anchor:
        reasons.append("an rnn head with sample_from_anchor false: speculators runs its state from the unused slot 0")
    if config.drafting_options:
        # speculators 0.9.0 has no logit soft-capping or input embedding scale; its sliding windows are measured from
        # the anchor (the same for every slot of a block) and its full-attention layers are never block-causal.
        reasons.append(f"{config.drafting_options} have no speculators equivalent (no soft-capping or embedding scale; "
                       "its sliding windows count from the block's anchor and its full-attention layers are always "
                       "bidirectional); keep the drafter in hf_dspark's layout (save_pretrained)")
    if reasons:
        raise UserInputError(f"this drafter cannot be written exactly in speculators' layout: {'; '.join(reasons)}.")


def _export_heads(drafter, target):
    if target is not None:
        return target.get_input_embeddings().weight, target.get_output_embeddings().weight
    attached = drafter._target_heads
    return None if attached is None else (attached.embed_tokens.weight, attached.lm_head.weight)


def _export_tensors(drafter, heads, kind: str) -> dict:
    """Our state dict under speculators' names, draft vocabulary ascending (as speculators builds it) and fc's
    column blocks in ascending target-layer order (as vLLM concatenates the features)."""
    config = drafter.config
    state = {name: tensor.detach().cpu() for name, tensor in drafter.state_dict().items()}
    ids = list(config.target_layer_ids)
    order = sorted(range(len(ids)), key=ids.__getitem__)
    fc = state["fc.weight"]
    state["fc.weight"] = fc.view(fc.shape[0], len(ids), -1)[:, order].reshape(fc.shape)
    vocabulary = state.pop("draft_to_target", None)
    out = {}
    if vocabulary is not None:
        vocabulary, sorting = vocabulary.sort()
        if _W2 in state:
            state[_W2] = state[_W2][sorting]
        if _W1 in state and not config.markov_w1_full_vocab:  # ours: draft rows + one shared row; theirs: per token
            w1 = state[_W1]
            full = w1[-1:].expand(config.vocab_size, -1).clone()
            full[drafter.draft_to_target.cpu()] = w1[:-1]
            state[_W1] = full
        out["d2t"] = vocabulary - torch.arange(vocabulary.numel())
        out["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, vocabulary, True)
    if heads is not None:
        embed, head = (h.detach().to("cpu") for h in heads)  # the target's own dtype, as hf_dspark drafts with it
        out["lm_head.weight"] = head if vocabulary is None else head[vocabulary]
        if kind == "eagle3":
            out["embed_tokens.weight"] = embed
    out.update({_OURS_TO_THEIRS.get(name, name): tensor for name, tensor in state.items()})
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _export_settings(config, kind: str, ids: list[int]) -> dict:
    aux = [i + 1 for i in ids]
    draft_vocab = config.draft_vocab_size or config.vocab_size
    if kind == "eagle3":
        return {"draft_vocab_size": draft_vocab, "eagle_aux_hidden_state_layer_ids": aux, "target_hidden_size": None,
                "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
                "embed_requires_grad": False}
    settings = {"draft_vocab_size": draft_vocab, "aux_hidden_state_layer_ids": aux, "block_size": config.block_size,
                "mask_token_id": config.mask_token_id, "sample_from_anchor": config.sample_from_anchor,
                "target_hidden_size": None, "sliding_window_non_causal": kind == "dflash2"}  # speculators' defaults
    if kind == "dspark":
        head = config.markov_head
        settings.update({"markov_rank": config.markov_rank if head else 0,
                         "markov_head_type": {v: k for k, v in _HEAD_TYPES.items()}.get(head, "vanilla"),
                         "enable_confidence_head": config.confidence_head,
                         "confidence_head_with_markov": bool(config.confidence_head and head)})
    if kind == "dflash2":
        settings.update({name: getattr(config, name) for name in _DFLASH2_FIELDS})
    return settings


def _layer_fields(config, model_type: str) -> dict:
    """The `transformer_layer_config` speculators builds the drafter's layers from (the draft depth and sizes)."""
    fields = {"model_type": model_type, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
              "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
              "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
              "max_position_embeddings": config.max_position_embeddings,
              "rope_parameters": dict(config.rope_parameters), "attention_bias": config.attention_bias,
              "tie_word_embeddings": False}
    if model_type == "qwen3":
        fields.update({"use_sliding_window": False, "sliding_window": None,
                       "layer_types": ["full_attention"] * config.num_hidden_layers})
    else:
        fields["mlp_bias"] = False
    return fields


def _proposal(config, kind: str, target) -> dict:
    """speculators_config: greedy proposals of the drafter's tokens per round; the verifier is `target`."""
    name = (getattr(target, "name_or_path", None) or None) if target is not None else None
    architectures = list(getattr(target.config, "architectures", None) or []) if target is not None else []
    return {"algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.num_draft_slots,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": name, "architectures": architectures}}


__all__ = ["export_speculators"]
