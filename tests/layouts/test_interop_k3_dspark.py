"""Kimi K3's DSpark drafter (`model_type: k3_dspark`), read by `hf_dspark.AutoDrafter`
(`hf_dspark/models/formats/k3_dspark.py`) into MLA layers built on transformers' `DeepseekV3Attention`
(`hf_dspark/models/modeling_dspark_mla.py`): a checkpoint written with the published config fields and tensor names
(tiny sizes, YaRN rotary) loads strictly; each layer's attention over [context ; block] equals transformers' own
`DeepseekV3Attention.forward` on those rows; decoding is exact; exports and unsupported fields are refused."""

import logging

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

import hf_dspark
from hf_dspark.hub.convert import convert_drafter
from hf_dspark.models.errors import DrafterLoadError, UserInputError
from layout_fixtures import (agreeing_markov_head, assert_batch_greedy_identical, assert_cache_context_matches_forward,
                             assert_greedy_identical, bigram_target, random_tensors, write_checkpoint)

VOCAB, HIDDEN, HEADS, FFN, LAYERS, RANK, MASK = 128, 64, 4, 96, 2, 16, 5
Q_LORA, KV_LORA, NOPE, ROPE, V = 32, 16, 16, 8, 16
TAPS, TARGET_DEPTH = [0, 2, 4], 6


def published_config(**overrides) -> dict:
    """The fields of Inferact/Kimi-K3-DSpark's config.json (tokenspeed's `INFERACT_CONFIG`), tiny: no
    architectures, no block_size."""
    config = {
        "model_type": "k3_dspark", "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V, "mla_use_nope": False,
        "mla_use_output_gate": False, "vocab_size": VOCAB, "draft_vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "rope_theta": 50000.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                            "rope_theta": 50000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 1.0},
        "num_target_layers": len(TAPS), "target_hidden_size": HIDDEN, "target_num_hidden_layers": TARGET_DEPTH,
        "target_layer_ids": TAPS, "mask_token_id": MASK, "markov_rank": RANK, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
    }
    config.update(overrides)
    return config


def published_tensors(seed: int = 4, rank: int = RANK) -> dict:
    """The published checkpoint's 68 tensor names (5 layers there), tiny shapes."""
    shapes = {"context_proj.weight": (HIDDEN, len(TAPS) * HIDDEN), "context_norm.weight": (HIDDEN,),
              "final_norm.weight": (HIDDEN,), "embed_tokens.weight": (VOCAB, HIDDEN),
              "markov_head.markov_w1.weight": (VOCAB, rank), "markov_head.markov_w2.weight": (VOCAB, rank),
              "confidence_head.proj.weight": (1, HIDDEN + rank), "confidence_head.proj.bias": (1,)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN), p + "self_attn.q_a_proj.weight": (Q_LORA, HIDDEN),
            p + "self_attn.q_a_layernorm.weight": (Q_LORA,),
            p + "self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
            p + "self_attn.kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, HIDDEN),
            p + "self_attn.kv_a_layernorm.weight": (KV_LORA,),
            p + "self_attn.kv_b_proj.weight": (HEADS * (NOPE + V), KV_LORA),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * V)})
    return random_tensors(shapes, seed)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("k3"), published_config(), published_tensors())


def test_loads_strictly_and_names_the_layout(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dspark.models.formats"):
        drafter = hf_dspark.AutoDrafter.from_pretrained(folder)
    assert sum("k3_dspark (drafter)" in r.getMessage() for r in caplog.records) == 1
    config = drafter.config
    assert type(drafter).__name__ == "DSparkMLADraftModel" and isinstance(drafter, hf_dspark.DSparkDraftModel)
    assert (config.block_size, config.sample_from_anchor, config.target_layer_ids, config.markov_head) == (
        7, True, TAPS, "markov")
    attention = drafter.layers[0].self_attn
    assert isinstance(attention, DeepseekV3Attention) and attention.kv_a_layernorm.variance_epsilon == 1e-5
    stored = published_tensors()
    renamed = {"context_proj.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight",
               "final_norm.weight": "norm.weight", "markov_head.markov_w1.weight": "sequential_head.token_embedding"
               ".weight", "markov_head.markov_w2.weight": "sequential_head.output.weight",
               "confidence_head.proj.weight": "confidence_proj.weight",
               "confidence_head.proj.bias": "confidence_proj.bias"}
    state = drafter.state_dict()
    for name, tensor in stored.items():
        if name != "embed_tokens.weight":  # the target embedding's copy: the target's own is used
            assert torch.equal(state[renamed.get(name, name)], tensor), name


def test_attention_is_transformers_deepseek_v3_attention_over_context_and_block(folder):
    """Each layer's output equals the one built with transformers' `DeepseekV3Attention.forward` run on the rows
    [fused context ; normed block] at positions 0..C+B-1 (block rows seeing every row), its context rows dropped."""
    drafter = hf_dspark.AutoDrafter.from_pretrained(folder)
    generator = torch.Generator().manual_seed(3)
    embed, lm_head = torch.randn(VOCAB, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator)
    drafter.attach_stored_heads(embed, lm_head)
    features = torch.randn(1, 9, len(TAPS) * HIDDEN, generator=generator)
    block = torch.tensor([[17] + [MASK] * 6])
    with torch.no_grad():
        out = drafter(input_ids=block, target_hidden_states=features)
        context, hidden = drafter.fuse_context(features), embed[block]
        rows = context.shape[1] + block.shape[1]
        rotary = DeepseekV3RotaryEmbedding(drafter.config.deepseek_v3_config())
        cos_sin = rotary(hidden, torch.arange(rows)[None])
        visible = torch.zeros(1, 1, rows, rows)
        for layer in drafter.layers:
            both = torch.cat([context, layer.input_layernorm(hidden)], dim=1)
            attention = DeepseekV3Attention.forward(layer.self_attn, both, cos_sin, visible)[0][:, context.shape[1]:]
            hidden = layer.add_attention_and_mlp(hidden, attention)
        hidden = drafter.norm(hidden)
    torch.testing.assert_close(out.last_hidden_state, hidden, atol=1e-5, rtol=0)
    assert out.logits.shape == (1, 7, VOCAB)


def test_cache_context_appends_what_a_drafting_pass_appends(folder):
    drafter = hf_dspark.AutoDrafter.from_pretrained(folder)
    generator = torch.Generator().manual_seed(4)
    drafter.attach_stored_heads(torch.randn(VOCAB, HIDDEN, generator=generator),
                                torch.randn(VOCAB, HIDDEN, generator=generator))
    assert_cache_context_matches_forward(drafter, torch.randn(2, 6, len(TAPS) * HIDDEN, generator=generator))


def test_refusals_name_the_field(tmp_path):
    tensors = published_tensors()
    refused = {
        "nope": (published_config(mla_use_nope=True), "mla_use_nope"),
        "gate": (published_config(mla_use_output_gate=True), "mla_use_output_gate"),
        "unknown": (published_config(index_topk=64), r"\['index_topk'\]"),
        "kv": (published_config(num_key_value_heads=2), "num_key_value_heads"),
        "taps": (published_config(target_layer_ids=[4, 2, 0]), "target_layer_ids"),
        "count": (published_config(num_target_layers=5), "num_target_layers"),
        "arch": (published_config(architectures=["DeepseekV3ForCausalLM"]), "architectures"),
        "theta": (published_config(rope_theta=10000.0), "rope_theta"),
        "missing": ({k: v for k, v in published_config().items() if k != "kv_lora_rank"}, "kv_lora_rank"),
    }
    for name, (config, problem) in refused.items():
        with pytest.raises(DrafterLoadError, match=problem):
            hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / name, config, tensors))
    for name, changed, problem in [
        ("embed", {**tensors, "embed_tokens.weight": torch.zeros(VOCAB, 8)}, "embed_tokens"),
        ("gone", {k: v for k, v in tensors.items() if k != "layers.1.self_attn.kv_b_proj.weight"}, "kv_b_proj"),
        ("extra", {**tensors, "lm_head.weight": torch.zeros(VOCAB, HIDDEN)}, "lm_head"),
    ]:
        with pytest.raises(DrafterLoadError, match=problem):
            hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / f"w_{name}", published_config(), changed))


def test_exports_are_refused_naming_why(folder, tmp_path):
    for layout in ("hf_dspark", "deepspec", "speculators"):
        with pytest.raises(UserInputError, match="multi-head latent attention"):
            convert_drafter(folder, tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()
    with pytest.raises(UserInputError, match="multi-head latent attention"):
        hf_dspark.AutoDrafter.from_pretrained(folder).save_pretrained(tmp_path / "saved")


def test_decodes_exactly(tmp_path):
    target = bigram_target(VOCAB, HIDDEN, TARGET_DEPTH)
    w1, w2 = agreeing_markov_head(target)
    tensors = {**published_tensors(rank=VOCAB), "markov_head.markov_w1.weight": w1,
               "markov_head.markov_w2.weight": w2}
    drafter = hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / "agree", published_config(
        markov_rank=VOCAB), tensors))
    prompts = [torch.randint(6, VOCAB, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    assert assert_greedy_identical(target, drafter, prompts) > 0
    assert_batch_greedy_identical(target, drafter, VOCAB)  # the engine: keys and values of different widths
