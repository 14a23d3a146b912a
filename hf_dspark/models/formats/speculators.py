"""`vllm-project/speculators` drafters (PyPI `speculators`, 0.9.0; the layout vLLM serves natively) read into
hf_dspark drafters in memory (`hf_dspark.hub.export_speculators` writes ours out in that layout).

speculators saves a `SpeculatorModelConfig` (`speculators_model_type` `dspark`, `dflash`, `dflash2` or `eagle3`, no
usable `model_type`) whose nested `transformer_layer_config` is a copy of the verifier's config with the draft depth,
and weights under these names (ours on the right; every other name is the same on both sides):

    markov_head.markov_w1.weight      sequential_head.token_embedding.weight  (theirs: a row per target token)
    markov_head.markov_w2.weight      sequential_head.output.weight
    markov_head.gate_proj.*           sequential_head.gate.*                  (markov_head_type "gated")
    markov_head.joint_proj.*          sequential_head.cell.*                  (markov_head_type "rnn")
    confidence_head.proj.*            confidence_proj.*
    candidate_selector.predecessor_codebook / .successor_codebook   the same names + `.weight` (DFlash 2; theirs are
                                      bare parameters, ours embeddings)
    d2t (offsets), t2d (bool mask)    draft_to_target = arange(draft_vocab_size) + d2t
    embed_tokens / lm_head            the target's, shared: attach_stored_heads when both are stored (Eagle3)

Config: `aux_hidden_state_layer_ids` / `eagle_aux_hidden_state_layer_ids` index HF `hidden_states` (0 is the
embedding output), ours index decoder layers: ours = theirs - 1. `sample_from_anchor` is the same field on both
sides (speculators' default: False for dflash, True for dspark). `markov_head_type` vanilla/gated/rnn is our
`markov_head` markov/gated/rnn with the same formulas, and the confidence head reads [h_k ; W1[x_{k-1}]] on both
sides; with a draft vocabulary our W1 keeps one row for all the tokens outside it. `dflash2` is hf_dspark's
`DFlash2DraftModel` (z-lab's DFlash 2, which speculators adapted: the same convolutions and selector, over the full
vocabulary only, as speculators requires). speculators' block layers are always Qwen3-style (per-head q/k norms);
its Eagle3 layers are Llama (no q/k norms) or Qwen3 ones, picked by `transformer_layer_config.model_type`. Its Eagle3
rows sit at position t + 1 where ours default to t: the same attention (rotary angles only enter as differences).

What hf_dspark's drafters do not compute is refused with one error naming the field and what supporting it would
take, never loaded approximately. Weights load as float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PreTrainedConfig

from ..config_checks import BLOCK, BOOLEAN, FROM_WEIGHTS, MAX_BLOCK_SIZE, check_config_fields, flag, integer, refusal
from ..errors import DrafterLoadError
from ..configuration_dflash2 import DFlash2DraftConfig
from ..configuration_dspark import DSparkDraftConfig
from ..configuration_eagle3 import Eagle3DraftConfig
from ..modeling_dflash2 import DFlash2DraftModel
from ..modeling_dspark import DSparkDraftModel
from ..modeling_eagle3 import Eagle3DraftModel
from ..weight_files import check_fits_before_building, read_checkpoint_tensors

FORMAT = "speculators"
WRITTEN_VERSION = "0.9.0"
_KINDS = ("dspark", "dflash", "dflash2", "eagle3")
_HEAD_TYPES = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}
_CLASS_NAMES = {"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel",
                "eagle3": "Eagle3DraftModel"}

# speculators 0.9.0's pydantic defaults, applied as its own from_pretrained applies them to a field left out.
_DEFAULTS = {"dflash": {"draft_vocab_size": 32000, "block_size": 8, "target_hidden_size": None, "mask_token_id": None,
                        "aux_hidden_state_layer_ids": None, "sliding_window_non_causal": False,
                        "sample_from_anchor": False},
             "eagle3": {"draft_vocab_size": 32000, "norm_before_residual": False, "target_hidden_size": None,
                        "eagle_aux_hidden_state_layer_ids": None, "norm_before_fc": False, "fc_norm": False,
                        "norm_output": False, "embed_requires_grad": False}}
_DEFAULTS["dflash2"] = {**_DEFAULTS["dflash"], "sliding_window_non_causal": True, "conv_kernel_size": 2,
                        "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
_DEFAULTS["dspark"] = {**_DEFAULTS["dflash"], "sample_from_anchor": True, "markov_rank": 256,
                       "markov_head_type": "vanilla", "enable_confidence_head": True,
                       "confidence_head_with_markov": True}
_BOOKKEEPING = {
    # speculators' own (versions, the verifier it names, its proposal settings: hf_dspark drafts num_draft_slots
    # tokens per round and verifies them itself) and transformers' save_pretrained bookkeeping of 4.x and 5.x.
    "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
    "model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype",
    "tie_word_embeddings", "_name_or_path", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
} | set(PreTrainedConfig().to_dict())
_LAYER_LEGACY = {"rope_theta", "rope_scaling", "torch_dtype", "_name_or_path", "use_cache"}
_VERIFIER_ONLY = {"verifier_lm_head.weight", "verifier_norm.weight"}  # training targets; never saved by speculators
_STORED_HEADS = ("embed_tokens.weight", "lm_head.weight")
_RENAMED = {f"{theirs}.{param}": f"{ours}.{param}" for theirs, ours, params in (
    ("markov_head.markov_w1", "sequential_head.token_embedding", ["weight"]),
    ("markov_head.markov_w2", "sequential_head.output", ["weight"]), ("markov_head.gate_proj", "sequential_head.gate",
    ["weight", "bias"]), ("markov_head.joint_proj", "sequential_head.cell", ["weight", "bias"]),
    ("confidence_head.proj", "confidence_proj", ["weight", "bias"])) for param in params}
_RENAMED.update({f"candidate_selector.{name}": f"candidate_selector.{name}.weight"
                 for name in ("predecessor_codebook", "successor_codebook")})
_OURS_TO_THEIRS = {ours: theirs for theirs, ours in _RENAMED.items()}
_W1 = "sequential_head.token_embedding.weight"
_W2 = "sequential_head.output.weight"
_RULES = {  # speculators' own top-level fields (the shared ones, block_size, dtype, ..., are config_checks')
    "markov_rank": (integer(0), FROM_WEIGHTS), "mask_token_id": (integer(0, optional=True), FROM_WEIGHTS),
    "target_hidden_size": (integer(1, optional=True), "write the verifier's hidden_size, or null"),
    **{name: (flag(), BOOLEAN) for name in ("enable_confidence_head", "confidence_head_with_markov",
                                             "sliding_window_non_causal", "norm_before_residual", "norm_before_fc",
                                             "fc_norm", "norm_output", "embed_requires_grad")},
}
_LAYER_FIX = ("Re-save it with speculators' save_pretrained, or fix config.json (transformer_layer_config, "
              "draft_vocab_size, aux layer ids) to match the weights.")
def matches(config: dict) -> bool:
    """A speculators config.json: it names a `speculators_model_type` (and no model_type of its own)."""
    return (isinstance(config, dict) and isinstance(config.get("speculators_model_type"), str)
            and config.get("model_type") in (None, "speculator_model"))


def _refuse(source, field: str, problem: str) -> DrafterLoadError:
    return DrafterLoadError(f"{source}: {field} {problem}")


def load(folder: str | Path, config: dict) -> DSparkDraftModel | Eagle3DraftModel:
    """The drafter in `folder` (config.json already read into `config`), converted in memory, float32, eval mode."""
    folder = Path(folder)
    source = folder / "config.json"
    kind = config.get("speculators_model_type")
    if kind not in _KINDS:
        raise _refuse(source, "speculators_model_type", f"is {kind!r}; hf_dspark reads speculators' "
                      f"{', '.join(_KINDS)} drafters. Serve this one with vLLM, which reads every speculators type.")
    settings = {**_DEFAULTS[kind], **config}
    unknown = sorted(set(config) - set(_DEFAULTS[kind]) - _BOOKKEEPING)
    if unknown:
        raise _refuse(source, f"field(s) {unknown}", f"are not part of speculators 0.9.0's {kind} layout and "
                      "hf_dspark does not know what they change; remove them if they are bookkeeping, else the "
                      "checkpoint needs a newer hf_dspark.")
    check_config_fields(config, source, skip=("transformer_layer_config", "speculators_config"), rules=_RULES)
    layer = _layer_config(config, kind, source)
    shapes = _shape_fields(layer, kind, settings, source)
    weights = read_checkpoint_tensors(folder, "speculators drafter",
                                      "save the drafter with speculators' save_pretrained")
    build = _eagle3_drafter if kind == "eagle3" else _block_drafter
    model_class, ours, state, heads = build(settings, shapes, weights, source)
    check_fits_before_building(model_class, ours, state, source.parent, "speculators drafter", _LAYER_FIX,
                               stored_name=lambda name: _OURS_TO_THEIRS.get(name, name), heads=heads)
    drafter = model_class(ours)
    drafter.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t for n, t in state.items()})
    _attach_stored_heads(drafter, heads, source)
    return drafter.eval()


def _layer_config(config: dict, kind: str, source) -> PreTrainedConfig:
    """`transformer_layer_config` as the transformers config class speculators instantiates for it."""
    raw = config.get("transformer_layer_config")
    if not isinstance(raw, dict):
        raise _refuse(source, "transformer_layer_config", "is missing: it holds the drafter's layer sizes (a "
                      "speculators checkpoint always writes it).")
    model_type = raw.get("model_type", "qwen3")  # speculators' default layer config class is Qwen3Config
    if not isinstance(model_type, str):
        raise _refuse(source, "transformer_layer_config.model_type", f"is {model_type!r}, not a string naming the "
                      "transformers model type of the drafter's layers (e.g. 'qwen3').")
    if kind == "eagle3" and model_type not in ("llama", "qwen3"):
        raise _refuse(source, "transformer_layer_config.model_type", f"is {model_type!r}; speculators builds Eagle3 "
                      "layers only for 'llama' and 'qwen3', so this checkpoint is not one it writes.")
    try:
        config_class = type(AutoConfig.for_model(model_type))
    except ValueError:
        raise _refuse(source, "transformer_layer_config.model_type", f"is {model_type!r}, which transformers does "
                      "not know.") from None
    unknown = sorted(set(raw) - set(config_class().to_dict()) - _LAYER_LEGACY)
    if unknown:
        raise _refuse(source, f"transformer_layer_config field(s) {unknown}", f"are unknown to transformers' "
                      f"{config_class.__name__}; hf_dspark does not know what they change.")
    check_config_fields(raw, source, prefix="transformer_layer_config.")
    try:
        return config_class(**{k: v for k, v in raw.items() if k != "model_type"})
    except (TypeError, ValueError, StrictDataclassError) as error:
        raise _refuse(source, "transformer_layer_config", f"is not a valid {config_class.__name__} ({error}).") \
            from None


def _shape_fields(layer, kind: str, settings: dict, source) -> dict:
    """Our config's fields from the layer config and the top-level settings; refuses what we do not compute."""
    heads = layer.num_attention_heads
    rope = dict(getattr(layer, "rope_parameters", None) or {})
    if isinstance(rope.get("sliding_attention"), dict):  # speculators' flatten_rope_parameters takes this entry
        rope = dict(rope["sliding_attention"])
    if float(rope.get("partial_rotary_factor", getattr(layer, "partial_rotary_factor", 1.0) or 1.0)) != 1.0:
        raise _refuse(source, "transformer_layer_config.partial_rotary_factor", "is not 1: hf_dspark's drafters rotate "
                      "every channel of each head; supporting it would take a partial rotary embedding there.")
    types = [t for t in getattr(layer, "layer_types", None) or [] if t != "full_attention"]
    if types:
        raise _refuse(source, "transformer_layer_config.layer_types", f"has {sorted(set(types))} layers; hf_dspark's "
                      "drafter layers attend over the whole context, and supporting sliding-window drafter layers "
                      "would take a per-layer window in their attention mask and in the drafting core.")
    if kind == "eagle3" and getattr(layer, "mlp_bias", False):
        raise _refuse(source, "transformer_layer_config.mlp_bias", "is true; hf_dspark's drafter MLP has no biases.")
    if settings["target_hidden_size"] not in (None, layer.hidden_size):
        raise _refuse(source, "target_hidden_size", f"({settings['target_hidden_size']}) differs from the drafter's "
                      f"hidden_size ({layer.hidden_size}); hf_dspark drafters share their target's width.")
    vocab, draft_vocab = layer.vocab_size, settings["draft_vocab_size"]
    if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= vocab:
        raise _refuse(source, "draft_vocab_size", f"({draft_vocab!r}) must be from 1 to the target's vocab_size "
                      f"({vocab}).")
    ids_field = "eagle_aux_hidden_state_layer_ids" if kind == "eagle3" else "aux_hidden_state_layer_ids"
    ids = settings[ids_field]
    if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                   for i in ids):
        raise _refuse(source, ids_field, f"is {ids!r}; it must list the verifier's hidden_states indices the drafter "
                      "reads (speculators' own default comes from the verifier's depth, unknown here: write them).")
    if ids != sorted(set(ids)):
        raise _refuse(source, ids_field, f"is {ids}: vLLM concatenates the verifier's hidden states in layer order, "
                      "so distinct ascending ids are the only unambiguous ones; sort them (and fc's column blocks).")
    return {
        "vocab_size": vocab, "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": layer.num_hidden_layers, "num_attention_heads": heads,
        "num_key_value_heads": getattr(layer, "num_key_value_heads", None) or heads,
        "head_dim": getattr(layer, "head_dim", None) or layer.hidden_size // heads, "hidden_act": layer.hidden_act,
        "rms_norm_eps": layer.rms_norm_eps,
        "max_position_embeddings": getattr(layer, "max_position_embeddings", None) or 32768,
        "rope_parameters": rope, "attention_bias": bool(getattr(layer, "attention_bias", False)),
        "qk_norm": kind != "eagle3" or layer.model_type == "qwen3",
        "target_layer_ids": [i - 1 for i in ids], "draft_vocab_size": draft_vocab if draft_vocab < vocab else None,
    }


def _our_config(config_class, fields: dict, source):
    try:
        return config_class(**fields)
    except (TypeError, ValueError, StrictDataclassError) as error:
        raise DrafterLoadError(f"{source} describes no valid {config_class.__name__}: {error}") from None


def _block_drafter(settings: dict, shapes: dict, weights: dict, source):
    """A speculators dspark / dflash checkpoint as a DSparkDraftModel (dflash2: a DFlash2DraftModel), its weights
    under our names."""
    kind = settings["speculators_model_type"]
    is_dspark = kind == "dspark"
    rank = int(settings["markov_rank"]) if is_dspark else 0
    head_type = settings["markov_head_type"] if is_dspark else None
    confidence = bool(settings["enable_confidence_head"]) if is_dspark else False
    if rank and (not isinstance(head_type, str) or head_type not in _HEAD_TYPES):
        raise _refuse(source, "markov_head_type", f"is {head_type!r}; speculators' heads are {list(_HEAD_TYPES)}.")
    if confidence and settings["confidence_head_with_markov"] and not rank:
        raise _refuse(source, "confidence_head_with_markov", "is true with markov_rank 0, which speculators refuses.")
    if rank and head_type == "rnn" and not settings["sample_from_anchor"]:
        raise _refuse(source, "markov_head_type 'rnn' with sample_from_anchor false", "is not computed the same way: "
                      "speculators carries the recurrent state through the unused slot 0, hf_dspark starts it at "
                      "slot 1. Supporting it would take a DSpark option that starts the state at slot 0.")
    if settings["mask_token_id"] is None:
        raise _refuse(source, "mask_token_id", "is missing; write the id the drafter was trained with.")
    fields = {**shapes, "block_size": settings["block_size"], "mask_token_id": settings["mask_token_id"],
              "sample_from_anchor": bool(settings["sample_from_anchor"]), "confidence_head": confidence,
              "markov_head": _HEAD_TYPES[head_type] if rank else None, "markov_rank": rank}
    if kind == "dflash2":
        if shapes["draft_vocab_size"] is not None:
            raise _refuse(source, "draft_vocab_size", f"({shapes['draft_vocab_size']}) is below the verifier's "
                          f"vocabulary ({shapes['vocab_size']}), which speculators' DFlash2DraftModel refuses (its "
                          "selector's codebooks cover the full vocabulary); restore it as speculators saved it.")
        config = _our_config(DFlash2DraftConfig, {**fields, **{name: settings[name] for name in _DFLASH2_FIELDS}},
                             source)
        return DFlash2DraftModel, config, *_renamed(weights, config, source)
    config = _our_config(DSparkDraftConfig, fields, source)
    state, heads = _renamed(weights, config, source)
    if _W1 in state and config.draft_vocab_size:
        compressed = _shared_outside_rows(state[_W1], state["draft_to_target"])
        if compressed is None:  # rows differ outside the draft vocabulary: keep one per target token, as theirs
            config = _our_config(DSparkDraftConfig, {**config.to_dict(), "markov_w1_full_vocab": True}, source)
        else:
            state[_W1] = compressed
    proj, w1 = state.get("confidence_proj.weight"), state.get(_W1)
    if confidence and rank and not settings["confidence_head_with_markov"] and proj is not None and w1 is not None:
        # Their head reads h_k alone; ours also reads W1[x_{k-1}]: zero columns for it give the same logit (as many
        # as the stored W1 has: a wrong markov_rank is refused by the shape check, never allocated).
        state["confidence_proj.weight"] = torch.cat([proj, proj.new_zeros(proj.shape[0], w1.shape[-1])], dim=1)
    return DSparkDraftModel, config, state, heads


_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _eagle3_drafter(settings: dict, shapes: dict, weights: dict, source):
    """A speculators eagle3 checkpoint as an Eagle3DraftModel."""
    what_it_takes = {
        "norm_before_residual": "keeping the normed target feature as the first layer's residual",
        "norm_before_fc": "an RMSNorm over the concatenated target features before fc",
        "fc_norm": "an RMSNorm on each target feature before fc",
        "norm_output": "feeding the normed output state back to the next drafted position",
        "embed_requires_grad": "a trained input embedding of the drafter's own (hf_dspark shares the target's)",
    }
    for field, support in what_it_takes.items():
        if settings[field]:
            raise _refuse(source, field, f"is true; hf_dspark's Eagle3DraftModel does not compute it. Supporting it "
                          f"would take {support} in Eagle3DraftModel.")
    config = _our_config(Eagle3DraftConfig, {**shapes, "block_size": _speculative_tokens(settings, source)}, source)
    state, heads = _renamed(weights, config, source)
    return Eagle3DraftModel, config, state, heads


def _speculative_tokens(settings: dict, source) -> int:
    """`speculative_tokens` of the checkpoint's default proposal method (speculators' default: 5)."""
    proposals = settings.get("speculators_config") or {}
    if not isinstance(proposals, dict) or not isinstance(proposals.get("proposal_methods") or [], list):
        raise _refuse(source, "speculators_config", "is not speculators' object of proposal methods; restore it.")
    wanted = proposals.get("default_proposal_method")
    for method in proposals.get("proposal_methods") or []:
        if isinstance(method, dict) and method.get("proposal_type") == wanted and "speculative_tokens" in method:
            tokens = method["speculative_tokens"]
            problem = integer(1, MAX_BLOCK_SIZE)(tokens)
            if problem:
                raise refusal(str(source), "speculators_config.proposal_methods[].speculative_tokens", tokens,
                              problem, BLOCK)
            return tokens
    return 5


def _renamed(weights: dict, config, source) -> tuple[dict, dict]:
    """(state dict under our names with draft_to_target, the stored copies of the target's embedding / LM head)."""
    state, heads = {}, {}
    for name, tensor in weights.items():
        if name in _STORED_HEADS:
            heads[name] = tensor
        elif name not in _VERIFIER_ONLY and name not in ("d2t", "t2d"):
            state[_RENAMED.get(name, name)] = tensor
    vocabulary = _draft_vocabulary(weights, config, source)
    if vocabulary is not None:
        state["draft_to_target"] = vocabulary
    return state, heads


def _draft_vocabulary(weights: dict, config, source) -> torch.Tensor | None:
    """draft_to_target from speculators' d2t offsets (target id = draft index + d2t), checked against t2d."""
    vocab, size = config.vocab_size, config.draft_vocab_size
    offsets, mask = weights.get("d2t"), weights.get("t2d")
    if size is None:
        if (offsets is not None and bool(offsets.any())) or (mask is not None and not bool(mask.all())):
            raise _refuse(source, "d2t / t2d", "map a draft vocabulary, but draft_vocab_size equals the vocabulary.")
        return None
    if offsets is None:
        raise _refuse(source, "d2t", f"is not in the weights, but draft_vocab_size is {size}: the draft-to-target "
                      "offsets are needed (speculators takes them as from_pretrained(d2t=, t2d=)); save them with "
                      "the checkpoint (model.load_vocab_mappings(t2d, d2t) before save_pretrained).")
    if offsets.is_floating_point() or tuple(offsets.shape) != (size,):
        raise _refuse(source, "d2t", f"must be {size} integer offsets, got {offsets.dtype} {tuple(offsets.shape)}.")
    ids = torch.arange(size) + offsets.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != size:
        raise _refuse(source, "d2t", f"maps draft tokens to ids outside 0..{vocab - 1} or to one id twice.")
    if mask is not None:
        if tuple(mask.shape) != (vocab,):  # before a vocab-long mask is made to compare it with
            raise _refuse(source, "t2d", f"has shape {tuple(mask.shape)}, not (vocab_size,) = ({vocab},).")
        expected = torch.zeros(vocab, dtype=torch.bool)
        expected[ids] = True
        if not torch.equal(mask.bool(), expected):
            raise _refuse(source, "t2d", "does not mark exactly the target ids d2t maps to.")
    return ids


def _shared_outside_rows(w1_full: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor | None:
    """Their W1 (one row per target token) -> our compact one: the draft vocabulary's rows plus the one row every
    other token shares. None when those rows differ (then W1 stays full: `markov_w1_full_vocab`)."""
    outside = torch.ones(w1_full.shape[0], dtype=torch.bool)
    outside[draft_to_target] = False
    others = w1_full[outside]
    if len(others) and not torch.equal(others, others[:1].expand_as(others)):
        return None
    shared = others[:1] if len(others) else w1_full.new_zeros(1, w1_full.shape[1])
    return torch.cat([w1_full[draft_to_target], shared])


def _attach_stored_heads(drafter, heads: dict, source) -> None:
    """speculators' Eagle3 stores the verifier's embedding and its LM head rows of the draft vocabulary (frozen
    copies): use them until a target is attached. A block drafter stores at most the LM-head rows, which the target
    gives again once attached (no embedding: nothing runs without a target then)."""
    if set(heads) != set(_STORED_HEADS):
        return
    embed, head = heads["embed_tokens.weight"].float(), heads["lm_head.weight"].float()
    rows = drafter.draft_to_target
    if rows is not None:
        if head.shape[0] != rows.numel():
            raise _refuse(source, "lm_head.weight", f"has {head.shape[0]} rows for {rows.numel()} draft tokens.")
        full = head.new_zeros(drafter.config.vocab_size, head.shape[1])
        full[rows] = head  # only these rows are ever read (compute_logits slices the draft vocabulary)
        head = full
    drafter.attach_stored_heads(embed, head)


__all__ = ["FORMAT", "load", "matches"]
