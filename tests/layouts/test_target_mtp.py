"""DSpark modules inside a target's own checkpoint (`hf_dspark/models/formats/target_mtp.py`):
`AutoDrafter.from_pretrained(target_folder)` finds DeepSeek-V4's `mtp.*` and Mistral Large 4's `mtp_dspark.*` from
the config and the shard index alone, opens no shard (the others here are not even safetensors files), and refuses
before any module is built, naming what the module's blocks would take; from the Hub only config.json and the index
are fetched."""

import json

import pytest
import torch
from safetensors.torch import save_file

import hf_dspark
from hf_dspark.models.errors import DrafterLoadError
from hf_dspark.models.formats import layout_of, target_mtp

DSPARK_FIELDS = {"dspark_block_size": 5, "dspark_noise_token_id": 7, "dspark_target_layer_ids": [1, 2, 3],
                 "dspark_markov_rank": 8}
STAGE = ["attn.wq_a.weight", "attn.wq_a.scale", "attn.wo_a.weight", "attn.attn_sink", "attn.wkv.weight",
         "ffn.gate.weight", "ffn.experts.0.w1.weight", "ffn.shared_experts.w1.weight", "hc_attn_fn", "hc_ffn_fn",
         "attn_norm.weight", "ffn_norm.weight"]


def _target(folder, config: dict, module: dict[str, str], shards: int = 3):
    """A target folder: config.json, an index, the module's tensors in the last shard and garbage elsewhere (any
    read of another shard fails)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    weight_map = {"embed.weight": names[0], "layers.0.attn.wq_a.weight": names[1 % shards], **module}
    for name in names[:-1]:
        (folder / name).write_bytes(b"not a safetensors file")
    save_file({name: torch.zeros(2) for name, shard in weight_map.items() if shard == names[-1]},
              str(folder / names[-1]))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _v4_module(last_shard: str) -> dict[str, str]:
    names = ["mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.hc_head_fn",
             "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight",
             "mtp.2.confidence_head.proj.weight"]
    names += [f"mtp.{stage}.{name}" for stage in range(3) for name in STAGE]
    return {name: last_shard for name in names}


def _v4_config(**fields):
    return {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 4, "vocab_size": 128, "hc_mult": 4, **fields}


def test_deepseek_v4_module_is_refused_naming_what_it_would_take(tmp_path):
    folder = _target(tmp_path / "v4", _v4_config(**DSPARK_FIELDS), _v4_module("model-00003-of-00003.safetensors"))
    assert layout_of(json.loads((folder / "config.json").read_text())) is target_mtp
    with pytest.raises(DrafterLoadError) as refused:
        hf_dspark.AutoDrafter.from_pretrained(folder)
    message = str(refused.value)
    for expected in ("DeepSeek-V4", "in 1 of its 3 shard(s)", "stages [0, 1, 2]", "mtp.2.markov_head.markov_w1",
                     "mixture-of-experts", "hyper-connections", "wo_a", "FP8", "DeepseekV4DecoderLayer",
                     "no shard was read"):
        assert expected in message, (expected, message)


def test_deepseek_v4_fields_are_checked(tmp_path):
    module = _v4_module("model-00003-of-00003.safetensors")
    cases = {
        "unknown": ({**DSPARK_FIELDS, "dspark_lora_rank": 4}, "dspark_lora_rank"),
        "missing": ({"dspark_markov_rank": 8}, "dspark_block_size"),
        "bad": ({**DSPARK_FIELDS, "dspark_target_layer_ids": "40,41"}, "dspark_target_layer_ids"),
    }
    for name, (fields, problem) in cases.items():
        folder = _target(tmp_path / name, _v4_config(**fields), module)
        with pytest.raises(DrafterLoadError, match=problem):
            hf_dspark.AutoDrafter.from_pretrained(folder)
    folder = _target(tmp_path / "no_module", _v4_config(**DSPARK_FIELDS), {})
    with pytest.raises(DrafterLoadError, match="no `mtp.\\*` tensors"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


def test_a_target_without_dspark_fields_is_no_drafter(tmp_path):
    folder = _target(tmp_path / "plain", _v4_config(num_nextn_predict_layers=1), {})
    assert layout_of(json.loads((folder / "config.json").read_text())) is None
    with pytest.raises(DrafterLoadError, match="no drafter layout hf_dspark reads"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


def test_mistral_large4_module_is_refused(tmp_path):
    config = {"model_type": "mistral_large4", "architectures": ["MistralLarge4ForConditionalGeneration"],
              "text_config": {"model_type": "mistral_large4_text", "hidden_size": 64}}
    module = {f"mtp_dspark.{name}": "model-00002-of-00002.safetensors"
              for name in ("fc.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight", "markov_head.markov_w1.weight")}
    folder = _target(tmp_path / "ml4", config, module, shards=2)
    with pytest.raises(DrafterLoadError) as refused:
        hf_dspark.AutoDrafter.from_pretrained(folder)
    message = str(refused.value)
    for expected in ("Mistral Large 4", "3 `mtp_dspark.*` tensors in 1 of its 2", "TODO", "kv_lora_rank"):
        assert expected in message, (expected, message)
    plain = _target(tmp_path / "ml4_plain", config, {}, shards=2)
    with pytest.raises(DrafterLoadError, match="without a DSpark module"):
        hf_dspark.AutoDrafter.from_pretrained(plain)


def test_from_the_hub_only_the_config_and_the_index_are_fetched(tmp_path, monkeypatch):
    import huggingface_hub

    import hf_dspark.models.auto as auto

    folder = _target(tmp_path / "hub", _v4_config(**DSPARK_FIELDS), _v4_module("model-00003-of-00003.safetensors"))
    for shard in folder.glob("*.safetensors"):
        shard.unlink()  # as a snapshot restricted to SNAPSHOT_PATTERNS leaves the folder
    config = json.loads((folder / "config.json").read_text())
    fetched = []
    monkeypatch.setattr(auto, "read_config", lambda path, options: (config, None))
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, allow_patterns, **hub: fetched.append(allow_patterns) or str(folder))
    with pytest.raises(DrafterLoadError, match="DeepSeek-V4"):
        hf_dspark.AutoDrafter.from_pretrained("deepseek-ai/DeepSeek-V4-Flash-0731")
    assert fetched == [["config.json", "model.safetensors.index.json"]]
