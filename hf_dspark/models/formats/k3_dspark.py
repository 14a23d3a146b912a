"""Kimi K3's DSpark drafter (`model_type: k3_dspark`, Inferact/Kimi-K3-DSpark), read into a `DSparkMLADraftModel`:
five DeepSeek-V3-style MLA layers built on transformers' `DeepseekV3Attention` (`modeling_dspark_mla`), the DFlash
fusion of five K3 target layers, a vanilla Markov head and a confidence head.

Sources of every name (read, not copied): lightseekorg/tokenspeed at f4d8ec6e039c028c7ee71317ccfb84e56ae2b45c:

* `test/runtime/test_kimi_k3_dspark_model.py`: the published config.json (`INFERACT_CONFIG`: no `architectures`,
  no `block_size`; `q_lora_rank` 1536, `kv_lora_rank` 512, `qk_nope_head_dim` 128, `qk_rope_head_dim` 64,
  `v_head_dim` 128, `mla_use_nope` / `mla_use_output_gate` false, YaRN `rope_parameters` (factor 32, mscale and
  mscale_all_dim 1), `num_target_layers` 5 = the number of taps, `target_hidden_size`, `target_num_hidden_layers`
  93, `target_layer_ids` [2, 23, 47, 71, 89], `mask_token_id`, `markov_rank` 256, `markov_head_type` vanilla,
  `enable_confidence_head`, `confidence_head_with_markov`) and its 68 tensors (`context_proj`, `context_norm`,
  `final_norm`, `embed_tokens`, `markov_head.markov_w1/w2`, `confidence_head.proj.{weight,bias}`, per layer
  `input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `self_attn.{q_a_proj, q_a_layernorm,
  q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`);
* `python/tokenspeed/runtime/configs/kimi_k3_dspark_config.py` (`KimiK3DSparkConfig` defaults, `hidden_act` silu,
  `validate_k3_dspark_config`: ascending distinct taps, vanilla head only, RoPE MLA, no output gate, a q-LoRA;
  `K3_DSPARK_SKIPPED_WEIGHT_PREFIXES`: `embed_tokens` is a copy of the frozen target embedding, which the drafter
  never uses: it embeds with the target's own); `python/tokenspeed/runtime/models/kimi_k3_dspark.py`
  (`K3DSparkModel`: `context_proj` + `context_norm` fuse the taps, DeepSeek-V3 MLA with interleaved YaRN rotary and
  the mscale softmax correction, context rows written as latent K/V, a pre-norm SwiGLU layer, `final_norm`);
  `python/tokenspeed/runtime/execution/drafter/dspark.py` and `dflash.py` (`sample_from_anchor`: slot k drafts
  anchor + k + 1; block = verify width - 1); `models/base/causal_lm.py` (tap i = the output of decoder layer i);
* lightseekorg/tokenspeed#879 and #924 (7-token blocks: `--speculative-num-draft-tokens 8`): the block size when
  config.json has no `block_size`.

Names: `context_proj` -> `fc`, `context_norm` -> `hidden_norm`, `final_norm` -> `norm`, the heads as DeepSpec's
(`deepspec.HEAD_NAMES`). NVIDIA NeMo's K3 DSpark (NoPE MLA, `mla_use_nope: true`) and an output gate are refused.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from ..config_checks import check_config_fields, list_of, integer
from ..errors import DrafterLoadError
from ..modeling_dspark_mla import DSparkMLADraftConfig, DSparkMLADraftModel
from ..weight_files import check_fits_before_building, read_checkpoint_tensors
from .qwen3_shell import BOOKKEEPING, heads_settings, our_state
from .deepspec import HEAD_NAMES

FORMAT = "k3_dspark"
MODEL_TYPE = "k3_dspark"
BLOCK_SIZE = 7  # tokenspeed#879 / #924: the published drafter drafts 7-token blocks
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
               "rms_norm_eps", "max_position_embeddings", *MLA_FIELDS, "target_layer_ids", "mask_token_id")
OWN_FIELDS = {*SIZE_FIELDS, "num_key_value_heads", "mla_use_nope", "mla_use_output_gate", "draft_vocab_size",
              "hidden_act", "rope_theta", "rope_parameters", "num_target_layers", "target_hidden_size",
              "target_num_hidden_layers", "markov_rank", "markov_head_type", "enable_confidence_head",
              "confidence_head_with_markov", "block_size", "initializer_range", "attention_bias"}
RENAMED = {"context_proj.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight",
           "final_norm.weight": "norm.weight"}
UNUSED_COPY = "embed_tokens.weight"
FIX = "Restore the folder (config.json and model.safetensors) as Inferact published it."


def matches(config: dict) -> bool:
    return config.get("model_type") == MODEL_TYPE


def load(folder: Path, config: dict) -> DSparkMLADraftModel:
    folder = Path(folder)
    source = str(folder / "config.json")
    ours = k3_config(config, source)
    weights = read_checkpoint_tensors(folder, "Kimi K3 DSpark drafter", FIX)
    embedding = weights.pop(UNUSED_COPY, None)
    if embedding is not None and tuple(embedding.shape) != (ours.vocab_size, ours.hidden_size):
        raise DrafterLoadError(f"the weights beside {source} hold {UNUSED_COPY} {tuple(embedding.shape)}, not the "
                               f"target embedding's ({ours.vocab_size}, {ours.hidden_size}). {FIX}")
    with_markov = bool(config.get("confidence_head_with_markov", True))
    state = our_state(weights, ours, with_markov, RENAMED)
    theirs = {**{ours_name: their for their, ours_name in HEAD_NAMES.items()},
              **{ours_name: their for their, ours_name in RENAMED.items()}}
    check_fits_before_building(DSparkMLADraftModel, ours, state, folder, "Kimi K3 DSpark drafter", FIX,
                               stored_name=lambda name: theirs.get(name, name))
    drafter = DSparkMLADraftModel(ours)
    drafter.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in state.items()}, strict=True)
    return drafter.float().eval()


def k3_config(config: dict, source: str) -> DSparkMLADraftConfig:
    """Our config for a k3_dspark config.json, every field known and checked before anything is built."""
    unknown = sorted(set(config) - OWN_FIELDS - BOOKKEEPING)
    if unknown:
        raise DrafterLoadError(f"{source} has field(s) {unknown} that hf_dspark's Kimi K3 DSpark reader does not "
                               "know, so it cannot tell whether they change the drafter's outputs and refuses them.")
    missing = [name for name in SIZE_FIELDS if name not in config]
    if missing:
        raise DrafterLoadError(f"{source} lacks {missing}, which the published k3_dspark config.json has. {FIX}")
    if config.get("architectures") not in (None, [], ["K3DSparkModel"]):
        raise DrafterLoadError(f"{source} lists architectures {config['architectures']}; a k3_dspark drafter names "
                               "none (tokenspeed fills in K3DSparkModel).")
    for name in MLA_FIELDS:
        problem = integer(1)(config[name])
        if problem:
            raise DrafterLoadError(f"{source} has {name}={config[name]!r}, which {problem.replace('{field}', name)}.")
    _refuse_unsupported(config, source)
    markov_head, rank, confidence = heads_settings(
        config.get("markov_rank", 256), config.get("markov_head_type", "vanilla"),
        config.get("enable_confidence_head", True), config.get("confidence_head_with_markov", True), source)
    rope = _rope_parameters(config, source)
    fields = dict(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_attention_heads"],
        head_dim=config["qk_rope_head_dim"], hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=config["rms_norm_eps"], max_position_embeddings=config["max_position_embeddings"],
        rope_parameters=rope, attention_bias=False, qk_norm=False, block_size=config.get("block_size", BLOCK_SIZE),
        sample_from_anchor=True, target_layer_ids=config["target_layer_ids"],
        target_num_hidden_layers=config.get("target_num_hidden_layers"), target_model_type=None,
        mask_token_id=config["mask_token_id"], markov_head=markov_head, markov_rank=rank, confidence_head=confidence,
        **{name: config[name] for name in MLA_FIELDS})
    try:
        return DSparkMLADraftConfig(**fields)
    except (ValueError, TypeError, StrictDataclassError) as error:
        raise DrafterLoadError(f"{source} does not describe a drafter hf_dspark can build ({error}).") from None


def _refuse_unsupported(config: dict, source: str) -> None:
    """What tokenspeed's `validate_k3_dspark_config` refuses, and what the MLA layers do not compute."""
    if config.get("mla_use_nope", False) is not False:
        raise DrafterLoadError(f"{source} has mla_use_nope={config['mla_use_nope']!r}: position-free MLA (NeMo's K3 "
                               "DSpark), while the published drafter rotates its keys (transformers' DeepSeek-V3 MLA). "
                               "Supporting it would take a rotary-free option in DSparkMLAAttention.")
    if config.get("mla_use_output_gate", False) is not False:
        raise DrafterLoadError(f"{source} has mla_use_output_gate={config['mla_use_output_gate']!r}: K3's gated "
                               "attention output (g_proj), which the published drafter does not have and "
                               "DeepseekV3Attention does not compute; supporting it would take that gate there.")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    if kv != heads:
        raise DrafterLoadError(f"{source} has num_key_value_heads={kv!r} for {heads} heads; MLA expands one latent "
                               "into a key and a value per query head.")
    if config.get("attention_bias", False) is not False:
        raise DrafterLoadError(f"{source} has attention_bias={config['attention_bias']!r}; the K3 drafter's MLA "
                               "projections have no biases.")
    vocab, draft = config["vocab_size"], config.get("draft_vocab_size")
    if draft not in (None, vocab):
        raise DrafterLoadError(f"{source} has draft_vocab_size={draft!r} below vocab_size={vocab}; the K3 drafter "
                               "drafts over its target's whole vocabulary (a draft vocabulary would need d2t).")
    width = config.get("target_hidden_size")
    if width not in (None, config["hidden_size"]):
        raise DrafterLoadError(f"{source} has target_hidden_size={width!r}, not hidden_size={config['hidden_size']}; "
                               "hf_dspark's fc fuses len(target_layer_ids) x hidden_size target features.")
    ids, taps = config["target_layer_ids"], config.get("num_target_layers")
    problem = list_of(integer(0), "target layer indices")(ids)
    if problem or ids != sorted(set(ids)) or (taps is not None and taps != len(ids)):
        raise DrafterLoadError(f"{source} has target_layer_ids={ids!r} and num_target_layers={taps!r}: the taps must "
                               "be distinct ascending layer indices, num_target_layers of them (tokenspeed's check; "
                               "fc's column blocks follow their order).")
    check_config_fields({"block_size": config.get("block_size", BLOCK_SIZE),
                         "rms_norm_eps": config["rms_norm_eps"]}, source)


def _rope_parameters(config: dict, source: str) -> dict:
    """`rope_parameters` (YaRN for the published drafter), its `rope_theta` agreeing with the top-level one."""
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 50000.0)}
    check_config_fields({"rope_parameters": rope}, source)
    theta = config.get("rope_theta")
    if theta is not None and rope.get("rope_theta", theta) != theta:
        raise DrafterLoadError(f"{source} has rope_theta={theta} but rope_parameters.rope_theta="
                               f"{rope['rope_theta']}; they disagree, so the drafter's positions are unknown.")
    return {**rope, "rope_theta": rope.get("rope_theta", theta if theta is not None else 50000.0)}


__all__ = ["FORMAT", "k3_config", "load", "matches"]
