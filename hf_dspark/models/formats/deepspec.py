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

DeepSpec's Gemma 4 drafters (`Gemma4DSparkModel`, `Gemma4Eagle3Model`) have the same names plus Gemma 4's layer
tensors and config fields, read as `deepspec_gemma4` describes into the same classes (`layer_style="gemma4"`).

The forward math was checked against DeepSpec's own code run on random drafters (tests/data/deepspec_golden/, made
by benchmarks/interop/make_deepspec_goldens.py): the same per-slot logits within 1e-5 in float32.

The weights keep the checkpoint's floating dtype when all of them share one (DeepSpec saves bfloat16, and its own
evaluator runs in it), as `from_pretrained`'s default `dtype="auto"` does; mixed dtypes load as float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import DrafterLoadError, DrafterTargetMismatchError
from ..configuration_dspark import DSparkDraftConfig
from ..modeling_dspark import DSparkDraftModel
from ..modeling_eagle3 import Eagle3DraftModel
from ..weight_files import check_fits_before_building, read_checkpoint_tensors
from .deepspec_gemma4 import normalized as gemma4_normalized
from .deepspec_config import (ARCHITECTURES, DSPARK_ARCHITECTURE, EAGLE3_ARCHITECTURE,  # noqa: F401
                              EAGLE3_ARCHITECTURES, GEMMA4_ARCHITECTURES, MARKOV_TYPES, _architecture, _flag,
                              check_fields_of, dspark_config, eagle3_config)

FORMAT = "deepspec"
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
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
STORED_HEADS = ("embed_tokens.weight", "lm_head.weight")
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # recomputed from rope_parameters (older transformers saved it)
FIX = ("Fix config.json to the checkpoint it was saved with (markov_rank, markov_head_type, enable_confidence_head, "
       "num_hidden_layers; Gemma 4: global_head_dim, attention_k_eq_v; fc fuses len(target_layer_ids) target layers).")


def matches(config: dict) -> bool:
    """A DeepSpec drafter config: one of DeepSpec's drafter architectures on a copied target config."""
    architectures = config.get("architectures") or []
    return (isinstance(architectures, list) and any(name in ARCHITECTURES for name in architectures)
            and "speculators_model_type" not in config)


def load(folder: Path, config: dict) -> DSparkDraftModel | Eagle3DraftModel:
    """The drafter in `folder` (config.json already read into `config`), converted strictly: every tensor of ours
    filled from the checkpoint, every stored tensor used, every config field accounted for. Stored copies of the
    target's embedding and LM head are attached with `attach_stored_heads`, so no target is needed to run it.
    Every field is checked before a tensor is read, and every shape before the drafter is built."""
    folder = Path(folder)
    source = str(folder / "config.json")
    architecture = _architecture(config, source)
    config = gemma4_normalized(config) if architecture in GEMMA4_ARCHITECTURES else config
    check_fields_of(config, source, architecture)
    weights = read_checkpoint_tensors(folder, "DeepSpec drafter", "save the drafter with DeepSpec's save_pretrained")
    if architecture in EAGLE3_ARCHITECTURES:
        model_class, ours = Eagle3DraftModel, eagle3_config(config, source)
    else:
        zero_head = _is_zero_vanilla_head(config, weights)
        model_class, ours = DSparkDraftModel, dspark_config(config, source, zero_markov_head=zero_head)
        ours.markov_w1_full_vocab = ours.markov_head is not None and _rows_differ_outside(weights, config)
        weights = _dspark_weights(config, weights, ours, source, zero_head)
    heads = {name: weights.pop(name) for name in STORED_HEADS if name in weights}
    state = _our_state(weights, ours, source)
    theirs = {ours_name: their_name for their_name, ours_name in HEAD_NAMES.items()}
    check_fits_before_building(model_class, ours, state, folder, "DeepSpec drafter", FIX,
                               stored_name=lambda name: theirs.get(name, name), heads=heads)
    drafter = model_class(ours)
    drafter.load_state_dict(state, strict=True)
    dtype = _kept_dtype([*state.values(), *heads.values()])
    drafter.to(dtype)
    # Gemma targets scale their embedding by sqrt(hidden_size) inside the embedding module, so a plain lookup of
    # the stored copy would be wrong: Qwen3-layout drafters exported for them wait for their target. DeepSpec's
    # Gemma 4 drafters embed with that scale themselves (Gemma4TextScaledWordEmbedding), and so do their stored heads.
    if heads and architecture in GEMMA4_ARCHITECTURES:
        _attach_heads(drafter, heads, dtype, source, embed_scale=drafter.config.hidden_size ** 0.5)
    elif heads and not str(config.get("model_type", "qwen3")).startswith("gemma"):
        _attach_heads(drafter, heads, dtype, source)
    return drafter.eval()


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
    elif (proj is not None and ours.markov_head is not None and W1 in weights and weights[W1].dim() == 2
          and not _flag(config, "confidence_head_with_markov", source)):
        # DeepSpec's confidence head may read h_k alone; ours reads [h_k ; W1[x_{k-1}]] whenever there is a Markov
        # head. Zero columns for W1[x] give exactly the same logit (as many as the stored W1 has: a rank that
        # config.json gets wrong is refused by the shape check, never allocated).
        weights["confidence_head.proj.weight"] = torch.cat(
            [proj, proj.new_zeros(proj.shape[0], weights[W1].shape[1])], dim=1)
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
        if tuple(mask.shape) != (config.vocab_size,):  # before a vocab_size-long mask is made to compare it with
            raise DrafterLoadError(f"{source}: t2d has shape {tuple(mask.shape)}, not (vocab_size,) = "
                                   f"({config.vocab_size},); config.json's vocab_size or the weights are wrong.")
        expected = torch.zeros(config.vocab_size, dtype=torch.bool)
        expected[ids] = True
        if not torch.equal(mask.bool(), expected):
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


def _kept_dtype(tensors) -> torch.dtype:
    dtypes = {tensor.dtype for tensor in tensors if tensor.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _attach_heads(drafter, heads: dict, dtype: torch.dtype, source: str, embed_scale: float | None = None) -> None:
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
    drafter.attach_stored_heads(embedding, lm_head, embed_scale=embed_scale)


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
