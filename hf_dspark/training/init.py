"""Initialise drafter layers from target decoder layers (same width and heads, so the shapes line up)."""

from __future__ import annotations

import torch

from ..models.drafter_base import DraftPreTrainedModel

_COPIED = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
    "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
    "post_attention_layernorm",
)


# The drafter's (Qwen3-style) names of LFM2's decoder-layer tensors.
_LFM2_NAMES = {"self_attn.out_proj": "self_attn.o_proj", "self_attn.q_layernorm": "self_attn.q_norm",
               "self_attn.k_layernorm": "self_attn.k_norm", "feed_forward.w1": "mlp.gate_proj",
               "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
               "operator_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _layer_parameters(layer) -> dict[str, torch.Tensor]:
    """A target decoder layer's parameters under the drafter's names."""
    found = {}
    for name, param in layer.named_parameters():
        module_name, leaf = name.rsplit(".", 1)
        found[f"{_LFM2_NAMES.get(module_name, module_name)}.{leaf}"] = param
    return found


def _input_norm(layer):
    return layer.input_layernorm if hasattr(layer, "input_layernorm") else layer.operator_norm


def _stores_offset(norm) -> bool:
    """Whether an RMSNorm scales by (1 + w) (Gemma, Qwen3-Next, Qwen3.5: its weight starts at zero) rather than w."""
    try:
        fresh = type(norm)(norm.weight.shape[0])
    except TypeError:
        return False
    return bool((fresh.weight == 0).all())


@torch.no_grad()
def init_layers_from_target(drafter: DraftPreTrainedModel, target, target_layer_indices: list[int]) -> list[str]:
    """Copy every matching tensor of target layer `target_layer_indices[i]` into drafter layer i; returns the
    names copied. Norms stored as w - 1 (Gemma, Qwen3-Next, Qwen3.5) are converted to plain RMSNorm weights; LFM2's
    names are read as the drafter's. A hybrid target's recurrent and convolution layers have no attention tensors
    to copy: choose attention layers for the attention part."""
    target_layers = target.get_decoder().layers
    copied = []
    for draft_index, target_index in enumerate(target_layer_indices):
        source = _layer_parameters(target_layers[target_index])
        offset_norms = _stores_offset(_input_norm(target_layers[target_index]))
        for name, param in drafter.layers[draft_index].named_parameters():
            module_name = name.rsplit(".", 1)[0]
            if module_name not in _COPIED or name not in source or source[name].shape != param.shape:
                continue
            value = source[name].to(param.dtype)
            if offset_norms and name.endswith("norm.weight"):
                value = value + 1.0
            param.copy_(value)
            copied.append(f"layers.{draft_index}.{name}")
    return copied


@torch.no_grad()
def init_context_from_target(drafter: DraftPreTrainedModel, target, first_copied_layer: int) -> int:
    """Make the fused context start as the output of target layer `first_copied_layer - 1`, normed as target layer
    `first_copied_layer` norms its input: drafter layer 0, copied from that target layer, then sees exactly the
    keys and values the target computed for the context. Needs that layer among `config.target_layer_ids`;
    returns its index in the fused features."""
    source = first_copied_layer - 1
    layer_ids = list(drafter.config.target_layer_ids)
    if source not in layer_ids:
        raise ValueError(f"target layer {source} is not fused by this drafter (target_layer_ids {layer_ids}); "
                         "add it, or copy other target layers")
    width = drafter.config.hidden_size
    slot = layer_ids.index(source)
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, slot * width : (slot + 1) * width] = torch.eye(width, dtype=drafter.fc.weight.dtype)
    target_norm = _input_norm(target.get_decoder().layers[first_copied_layer])
    norm = target_norm.weight.to(drafter.hidden_norm.weight.dtype)
    if _stores_offset(target_norm):
        norm = norm + 1.0
    drafter.hidden_norm.weight.copy_(norm)
    return slot


@torch.no_grad()
def init_markov_head_from_bigrams(drafter, dataset, smoothing: float = 1.0) -> float:
    """Start the sequential head's low-rank bigram `W2(W1[x])` at the bigram statistics of the training answers.

    Counts next-token pairs over the answer tokens of `dataset` (examples with `input_ids` and `loss_mask`), forms
    backed-off log-probabilities `log((c[x, y] + a p(y)) / (n[x] + a))` over the drafter's rows (draft vocabulary
    plus the shared out-of-vocabulary row) and outputs, removes each row's mean (softmax ignores it) and keeps the
    best rank-r approximation (truncated SVD) as `W1 = U S^1/2`, `W2 = V S^1/2`. Returns the share of the matrix's
    energy the rank-r factorisation keeps. The head's job is exactly this bias, so it no longer has to be learned
    from scratch; training refines it.
    """
    head = drafter.sequential_head
    if head is None:
        raise ValueError("this drafter has no sequential head (a DFlash drafter)")
    rows, outputs = head.token_embedding.num_embeddings, head.output.out_features
    counts = torch.zeros(rows, outputs, dtype=torch.float64)
    for index in range(len(dataset)):
        example = dataset[index]
        ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(example["loss_mask"]) > 0
        pairs = mask[1:].clone()
        previous, following = drafter.head_rows(ids[:-1][pairs]), ids[1:][pairs]
        if drafter.draft_to_target is not None:
            column = drafter.head_rows(following)
            keep = column < outputs  # a next token outside the draft vocabulary is never drafted
            previous, column = previous[keep], column[keep]
        else:
            column = following
        counts.index_put_((previous, column), torch.ones_like(previous, dtype=torch.float64), accumulate=True)
    unigram = (counts.sum(0) + 1.0) / (counts.sum() + outputs)
    log_probs = torch.log((counts + smoothing * unigram) / (counts.sum(1, keepdim=True) + smoothing))
    log_probs -= log_probs.mean(dim=1, keepdim=True)
    u, s, v = torch.svd_lowrank(log_probs.float(), q=head.rank, niter=4)
    scale = s.sqrt()
    head.token_embedding.weight.copy_((u * scale).to(head.token_embedding.weight.dtype))
    head.output.weight.copy_((v * scale).to(head.output.weight.dtype))
    return float((s**2).sum() / (log_probs.float() ** 2).sum())
