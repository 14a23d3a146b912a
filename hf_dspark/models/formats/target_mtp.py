"""DSpark drafter modules shipped inside a target model's own checkpoint, found by
`hf_dspark.AutoDrafter.from_pretrained(target_folder_or_repo)`: DeepSeek-V4 (`mtp.<stage>.*`) and Mistral Large 4
(`mtp_dspark.*`). Only the target's config.json and its `model.safetensors.index.json` are read (from the Hub: only
those two files are fetched): the index names the module's tensors and their shards, and no shard is opened (a
target without an index: the header of its one `model.safetensors`). Neither module is built by hf_dspark's
drafter layers, so both are refused before any module exists, with what supporting them would take.

DeepSeek-V4-Flash-0731 / V4-Pro-0813 (and the -DSpark releases). Sources (read, not copied): the 0731 index and
config as kvcache-ai/ktransformers#2118 and vllm-project/vllm#41834 quote them (`mtp.0`, `mtp.1`, `mtp.2`,
4705 tensors, `mtp.2.markov_head.markov_w1/w2`, `mtp.2.confidence_head.proj`, no `enorm` / `hnorm`;
`dspark_block_size` 5, `dspark_noise_token_id`, `dspark_target_layer_ids` [40, 41, 42], `dspark_markov_rank`);
sgl-project/sglang `python/sglang/srt/speculative/dspark_components/dspark_config.py` (01f4762:
`checkpoint_bundles_dspark_draft`, the `dspark_` fields and `dspark_markov_head_type`); lightseekorg/tokenspeed
(f4d8ec6) `python/tokenspeed/runtime/models/deepseek_v4_dspark.py` (`dspark_num_stages`, `dspark_window_size`
(128 by default); per stage a DeepSeek-V4 block: `attn.{wq_a, wq_b, wkv, q_norm, kv_norm, wo_a, wo_b, attn_sink}`,
`ffn.{gate, experts.*, shared_experts.*}`, `hc_attn_*` / `hc_ffn_*`, `attn_norm`, `ffn_norm`, FP8 `*.scale`; stage
0 `main_proj` + `main_norm` fusing the target layers, the last stage `norm`, `hc_head_*` and the heads); transformers
5.25 `models/deepseek_v4/modeling_deepseek_v4.py` (`DeepseekV4DecoderLayer`, `DeepseekV4HyperConnection`,
`DeepseekV4SparseMoeBlock`; `_keys_to_ignore_on_load_unexpected = [r"(^|\\.)mtp\\..*"]`).

Mistral Large 4. Source: transformers 5.25 `models/mistral_large4/modeling_mistral_large4.py`
(`_keys_to_ignore_on_load_unexpected = [r"mtp_dspark\\..*"]`, "a multi-token-prediction draft head that this model
does not implement yet # TODO") and `configuration_mistral_large4.py` (MLA `kv_lora_rank`, MoE `n_routed_experts`,
the DSA indexer `index_topk`); no publisher config field or converter names the module's settings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..config_checks import MAX_BLOCK_SIZE, choice, integer, list_of, refusal
from ..errors import DrafterLoadError
from ..folder_files import checked_file
from ..weight_files import SAFE_WEIGHTS_NAME, indexed_weight_map, stored_tensor_headers

FORMAT = "target_mtp"
SNAPSHOT_PATTERNS = ("config.json", "model.safetensors.index.json")
DEEPSEEK_V4_TYPES = ("deepseek_v4",)
MISTRAL_LARGE4_TYPES = ("mistral_large4", "mistral_large4_text")
DSPARK_FIELDS = {  # the target config's DSpark fields -> (rule, fix)
    "dspark_block_size": (integer(1, MAX_BLOCK_SIZE), "write the module's block size (5 for DeepSeek-V4)"),
    "dspark_noise_token_id": (integer(0), "write the token id that fills the block's mask slots"),
    "dspark_target_layer_ids": (list_of(integer(0), "target layer indices"), "list the target layers it reads"),
    "dspark_markov_rank": (integer(0), "write the Markov head's rank"),
    "dspark_markov_head_type": (choice(("vanilla", "gated", "rnn"), optional=True), "write the head type"),
    "dspark_window_size": (integer(1, optional=True), "write the module's attention window"),
    "dspark_num_stages": (integer(1, optional=True), "write the number of mtp stages"),
}
DSPARK_REQUIRED = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids")
_STAGE = re.compile(r"^mtp\.(\d+)\.")
_V4_FEATURES = (  # (a tensor-name fragment, what it is, what supporting it takes)
    (".ffn.experts.", "routed mixture-of-experts feed-forward (`ffn.gate`, `ffn.experts.*`, `ffn.shared_experts.*`)",
     "the routed and shared experts (transformers' DeepseekV4SparseMoeBlock) instead of the drafter's dense MLP"),
    (".hc_attn_fn", "manifold hyper-connections (`hc_attn_*`, `hc_ffn_*`, `hc_head_*`: hc_mult residual streams)",
     "the hc_mult residual streams around every stage and the hyper-connection head (DeepseekV4HyperConnection)"),
    (".attn.wo_a", "DeepSeek-V4 attention (low-rank queries `wq_a`/`wq_b`, one shared key/value `wkv`, grouped "
     "low-rank output `wo_a`/`wo_b`, an attention sink, a sliding window of dspark_window_size)",
     "DeepseekV4Attention extended with the target context's keys/values from `main_proj` (hf_dspark's attention "
     "is grouped-query attention with per-head q/k norms)"),
    (".scale", "FP8 block-scaled weights (`*.scale`)", "dequantising the FP8 blocks on load"),
)


def matches(config: dict) -> bool:
    """A DeepSeek-V4 config with `dspark_*` fields, or a Mistral Large 4 config (its module is found in the index)."""
    model_type = config.get("model_type")
    if model_type in DEEPSEEK_V4_TYPES:
        return any(str(name).startswith("dspark_") for name in config)
    return model_type in MISTRAL_LARGE4_TYPES


def load(folder: Path, config: dict):
    folder = Path(folder)
    source = str(folder / "config.json")
    if config.get("model_type") in MISTRAL_LARGE4_TYPES:
        _refuse_mistral_large4(folder, source)
    _refuse_deepseek_v4(folder, config, source)


def module_tensors(folder: Path, prefix: str, what: str) -> tuple[list[str], list[str], int]:
    """(the names of the tensors starting with `prefix`, the shards holding them, the checkpoint's shard count),
    from the index alone (no shard is opened; from the Hub, no shard is fetched), or from the one
    `model.safetensors`'s header when there is no index."""
    weight_map = indexed_weight_map(folder, what)
    if weight_map is None:
        single = folder / SAFE_WEIGHTS_NAME
        if not os.path.lexists(single):
            raise DrafterLoadError(f"{folder} has neither model.safetensors.index.json nor model.safetensors; "
                                   "hf_dspark reads a target's drafter module from safetensors only.")
        checked_file(single, folder, DrafterLoadError)  # a link out of the folder is never opened
        weight_map = {name: single for name in stored_tensor_headers([str(single)])}
    names = sorted(name for name in weight_map if name.startswith(prefix))
    shards = sorted({weight_map[name].name for name in names})
    return names, shards, len({str(path) for path in weight_map.values()})


def _refuse_deepseek_v4(folder: Path, config: dict, source: str) -> None:
    unknown = sorted(name for name in config if name.startswith("dspark_") and name not in DSPARK_FIELDS)
    if unknown:
        raise DrafterLoadError(f"{source} has DSpark field(s) {unknown} that hf_dspark does not know; it reads "
                               f"{sorted(DSPARK_FIELDS)}.")
    missing = [name for name in DSPARK_REQUIRED if name not in config]
    if missing:
        raise DrafterLoadError(f"{source} has DSpark fields but lacks {missing}, which a DeepSeek-V4 DSpark module "
                               "needs (SGLang and tokenspeed read them); restore the release's config.json.")
    for name in sorted(set(config) & set(DSPARK_FIELDS)):
        rule, fix = DSPARK_FIELDS[name]
        problem = rule(config[name])
        if problem:
            raise refusal(source, name, config[name], problem, fix)
    names, shards, total = module_tensors(folder, "mtp.", "DeepSeek-V4 target")
    if not names:
        raise DrafterLoadError(f"{source} has dspark_* fields but the checkpoint holds no `mtp.*` tensors: this copy "
                               "of the target lacks its DSpark module (download the release that ships it).")
    stages = sorted({int(found.group(1)) for name in names if (found := _STAGE.match(name))})
    last = f"mtp.{stages[-1]}." if stages else "mtp."
    heads = [name for name in (f"{last}markov_head.markov_w1.weight", f"{last}confidence_head.proj.weight")
             if name in names]
    found = [(what, takes) for fragment, what, takes in _V4_FEATURES if any(fragment in name for name in names)]
    settings = {name: config[name] for name in ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank")
                if name in config}
    raise DrafterLoadError(
        f"{folder} is a DeepSeek-V4 target whose checkpoint carries a DSpark module ({len(names)} `mtp.*` tensors "
        f"in {len(shards)} of its {total} shard(s), stages {stages}, heads {heads}, {settings}; no shard was read). "
        "Its stages are DeepSeek-V4 blocks, which hf_dspark's drafter layers (grouped-query attention and a dense "
        "SwiGLU MLP, with the target context injected as keys and values) do not compute: "
        f"{'; '.join(what for what, _ in found) or 'DeepSeek-V4 blocks'}. transformers 5.25's DeepseekV4DecoderLayer "
        "computes such a block but takes no injected context keys/values, and DeepseekV4ForCausalLM drops `mtp.*` "
        "when it loads the target. Supporting it would take a drafter layer built on DeepseekV4DecoderLayer with "
        f"{'; '.join(takes for _, takes in found) or 'context keys/values'}; until then serve it with SGLang "
        "(--speculative-algorithm DSPARK), vLLM or llama.cpp.")


def _refuse_mistral_large4(folder: Path, source: str) -> None:
    names, shards, total = module_tensors(folder, "mtp_dspark.", "Mistral Large 4 target")
    if not names:
        raise DrafterLoadError(f"{folder} is a Mistral Large 4 target without a DSpark module (no `mtp_dspark.*` "
                               "tensors in its checkpoint), so it holds no drafter; pass it as the target.")
    sample = names[:4]
    raise DrafterLoadError(
        f"{folder} is a Mistral Large 4 target whose checkpoint carries a DSpark module ({len(names)} "
        f"`mtp_dspark.*` tensors in {len(shards)} of its {total} shard(s), e.g. {sample}; no shard was read). "
        "No published config field or converter describes that module (its block size, mask token, target "
        "layers, Markov rank), and transformers 5.25 drops `mtp_dspark.*` when it loads the target (a TODO in "
        "modeling_mistral_large4), so hf_dspark cannot tell what it computes and refuses it. Mistral Large 4's "
        "blocks are multi-head latent attention (kv_lora_rank) with a DSA indexer and routed experts, which "
        "hf_dspark's drafter layers do not compute; supporting the module would take its published settings and a "
        "drafter layer built on transformers' MistralLarge4 text decoder layer with context keys/values injected.")


__all__ = ["FORMAT", "SNAPSHOT_PATTERNS", "load", "matches", "module_tensors"]
