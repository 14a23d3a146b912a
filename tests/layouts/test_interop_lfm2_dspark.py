"""LiquidAI's LFM2.5 DSpark drafters (`Lfm2DSparkDraftModel`), read by `hf_dspark.AutoDrafter`
(`hf_dspark/models/formats/lfm2_dspark.py`): a checkpoint written with the published config fields and tensor names
(tiny sizes) gives the per-slot logits of an independent reference forward with interleaved rotary
(`rope_is_neox_style: false`, rotating channel pairs (2i, 2i+1) through complex multiplication) and with split-half
rotary; it loads strictly; it runs on an LFM2 target's features; and it decodes exactly against a full-attention
target of the same width (LFM2 targets themselves are hybrid: their decoding is generation/'s concern)."""

import logging
import math

import pytest
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM

import hf_dspark
from hf_dspark.transformers_internals.recurrent_states import keeps_states_per_position
from hf_dspark.models.errors import DrafterLoadError
from layout_fixtures import (agreeing_markov_head, assert_greedy_identical, bigram_target, random_tensors,
                             write_checkpoint)

VOCAB, HIDDEN, HEADS, KV, HEAD_DIM, FFN, LAYERS, RANK, BLOCK, MASK = 128, 64, 4, 2, 16, 96, 2, 16, 4, 5
TAPS, TARGET_DEPTH, EPS, THETA = [0, 2, 4], 6, 1e-5, 1000000.0


def published_config(**overrides) -> dict:
    """The fields of LiquidAI's published config.json (as mlx-vlm's test pins it), tiny."""
    config = {
        "architectures": ["Lfm2DSparkDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM,
        "intermediate_size": FFN, "hidden_act": "silu", "rms_norm_eps": EPS, "vocab_size": VOCAB,
        "rope_theta": THETA, "max_position_embeddings": 512, "layer_types": ["full_attention"] * LAYERS,
        "block_size": BLOCK, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TAPS,
                                               "num_target_layers": TARGET_DEPTH},
        "markov_rank": RANK, "rope_is_neox_style": False, "enable_confidence_head": True,
        "markov_head_type": "vanilla", "tie_word_embeddings": True, "dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def published_tensors(seed: int = 3, rank: int = RANK) -> dict:
    """The published checkpoint's tensor names and shapes (LFM2.5-1.2B-Instruct-DSpark's manifest), tiny."""
    shapes = {"fc.weight": (HIDDEN, len(TAPS) * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,),
              "markov_head.markov_w1.weight": (VOCAB, rank), "markov_head.markov_w2.weight": (VOCAB, rank),
              "confidence_head.proj.weight": (1, HIDDEN + rank), "confidence_head.proj.bias": (1,)}
    for i in range(LAYERS):
        shapes.update({
            f"layers.{i}.input_layernorm.weight": (HIDDEN,), f"layers.{i}.post_attention_layernorm.weight": (HIDDEN,),
            f"layers.{i}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"layers.{i}.self_attn.k_proj.weight": (KV * HEAD_DIM, HIDDEN),
            f"layers.{i}.self_attn.v_proj.weight": (KV * HEAD_DIM, HIDDEN),
            f"layers.{i}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"layers.{i}.self_attn.q_norm.weight": (HEAD_DIM,), f"layers.{i}.self_attn.k_norm.weight": (HEAD_DIM,),
            f"layers.{i}.mlp.gate_proj.weight": (FFN, HIDDEN), f"layers.{i}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"layers.{i}.mlp.down_proj.weight": (HIDDEN, FFN)})
    return random_tensors(shapes, seed)


def _rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x, positions, interleaved: bool):
    """Rotary on (heads, length, d): interleaved pairs (2i, 2i+1) as complex numbers, or split halves (i, i + d/2)."""
    d = x.shape[-1]
    angles = positions[:, None].double() * THETA ** (-torch.arange(0, d, 2).double() / d)
    rotation = torch.polar(torch.ones_like(angles), angles)
    if interleaved:
        pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
        return torch.view_as_real(pairs * rotation).reshape(x.shape).to(x.dtype)
    pairs = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rotation
    return torch.cat([pairs.real, pairs.imag], dim=-1).to(x.dtype)


def reference(w: dict, features, block_embeds, previous, lm_head, interleaved: bool):
    """The drafter's math written out from the publishers' description: (logits, confidence logits) per slot."""
    context, h = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"]), block_embeds
    c, b = context.shape[0], h.shape[0]
    block_pos, all_pos = torch.arange(c, c + b), torch.arange(c + b)
    for i in range(LAYERS):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"])
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(b, HEADS, HEAD_DIM), w[p + "self_attn.q_norm.weight"])
        rows = torch.cat([context, x])
        k = _rms((rows @ w[p + "self_attn.k_proj.weight"].T).view(c + b, KV, HEAD_DIM),
                 w[p + "self_attn.k_norm.weight"])
        v = (rows @ w[p + "self_attn.v_proj.weight"].T).view(c + b, KV, HEAD_DIM)
        q = _rope(q.transpose(0, 1), block_pos, interleaved)
        k = _rope(k.transpose(0, 1), all_pos, interleaved).repeat_interleave(HEADS // KV, 0)
        v = v.transpose(0, 1).repeat_interleave(HEADS // KV, 0)
        attention = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(HEAD_DIM), dim=-1) @ v
        h = h + attention.transpose(0, 1).reshape(b, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = _rms(h, w["norm.weight"])
    w1 = w["markov_head.markov_w1.weight"][previous]
    logits = h @ lm_head.T + w1 @ w["markov_head.markov_w2.weight"].T
    confidence = torch.cat([h, w1], -1) @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"]
    return logits, confidence.squeeze(-1)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "split_half"])
def test_per_slot_logits_match_the_reference(tmp_path, interleaved, caplog):
    tensors = published_tensors()
    folder = write_checkpoint(tmp_path / "lfm2", published_config(rope_is_neox_style=not interleaved), tensors)
    with caplog.at_level(logging.WARNING, logger="hf_dspark.models.formats"):
        drafter = hf_dspark.AutoDrafter.from_pretrained(folder)
    lines = [r.getMessage() for r in caplog.records if "lfm2_dspark (Lfm2DSparkDraftModel)" in r.getMessage()]
    assert len(lines) == 1, caplog.records
    config = drafter.config
    assert (config.block_size, config.sample_from_anchor, config.markov_head, config.confidence_head) == (
        BLOCK, True, "markov", True)
    assert config.target_layer_ids == TAPS and config.target_num_hidden_layers == TARGET_DEPTH
    generator = torch.Generator().manual_seed(7)
    embed, lm_head = torch.randn(VOCAB, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator)
    drafter.attach_stored_heads(embed, lm_head)
    features = torch.randn(1, 9, len(TAPS) * HIDDEN, generator=generator)
    block = torch.tensor([[17] + [MASK] * (BLOCK - 1)])
    previous = torch.tensor([[17, 40, 41, 42]])
    with torch.no_grad():
        out = drafter(input_ids=block, target_hidden_states=features, previous_token_ids=previous)
        logits, confidence = reference(tensors, features[0], embed[block[0]], previous[0], lm_head, interleaved)
    torch.testing.assert_close(out.logits[0], logits, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.confidence_logits[0], confidence, atol=2e-5, rtol=0)


def test_strict_weights_and_fields(tmp_path):
    tensors = published_tensors()
    for name, changed, problem in [
        ("missing", {k: v for k, v in tensors.items() if k != "layers.1.mlp.up_proj.weight"}, "layers.1.mlp.up_proj"),
        ("extra", {**tensors, "embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)}, "embed_tokens"),
        ("rank", {**tensors, "markov_head.markov_w2.weight": torch.zeros(VOCAB, RANK + 1)}, "markov_w2"),
    ]:
        folder = write_checkpoint(tmp_path / name, published_config(), changed)
        with pytest.raises(DrafterLoadError, match=problem):
            hf_dspark.AutoDrafter.from_pretrained(folder)
    refused = {
        "unknown": (published_config(new_field=1), r"\['new_field'\]"),
        "nested": (published_config(dflash_config={"mask_token_id": MASK, "target_layer_ids": TAPS, "x": 1}),
                   r"dflash_config field\(s\) \['x'\]"),
        "window": (published_config(dflash_config={"mask_token_id": MASK, "target_layer_ids": TAPS,
                                                   "draft_window_size": 64}), "draft_window_size"),
        "neox": (published_config(rope_is_neox_style="no"), "rope_is_neox_style"),
        "sliding": (published_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                    "layer_types"),
        "head": (published_config(markov_head_type="lstm"), "markov_head_type"),
        "block": (published_config(dflash_config={"mask_token_id": MASK, "target_layer_ids": TAPS,
                                                  "block_size": 5}), "block_size"),
        "runtime": (published_config(runtime_block_size=1), "runtime_block_size"),
    }
    for name, (config, problem) in refused.items():
        folder = write_checkpoint(tmp_path / f"refused_{name}", config, tensors)
        with pytest.raises(DrafterLoadError, match=problem):
            hf_dspark.AutoDrafter.from_pretrained(folder)


def test_runtime_block_size_is_the_drafters_default_draft_length(tmp_path):
    tensors = published_tensors()
    nested = {"mask_token_id": MASK, "target_layer_ids": TAPS, "num_target_layers": TARGET_DEPTH,
              "runtime_block_size": 3}
    drafter = hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / "a", published_config(
        dflash_config=nested), tensors))
    assert drafter.generation_config.num_assistant_tokens == 2  # the anchor and two drafts are verified
    wide = hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / "b", published_config(
        runtime_block_size=12), tensors))
    assert wide.generation_config.num_assistant_tokens == BLOCK  # capped at the trained block
    plain = hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / "c", published_config(), tensors))
    assert plain.generation_config.num_assistant_tokens is None


def lfm2_target(quiet_layers: bool = False):
    """A tiny LFM2 target: short-convolution and attention layers (with `quiet_layers`, their outputs scaled down, so
    that its next token is nearly a function of the current one, as `bigram_target`'s)."""
    torch.manual_seed(0)
    target = Lfm2ForCausalLM(Lfm2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=TARGET_DEPTH,
        num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=512, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"])).eval()
    with torch.no_grad():
        for name, param in target.named_parameters():
            if quiet_layers and name.endswith(("out_proj.weight", "feed_forward.w2.weight")):
                param.mul_(0.02)
    return target


def test_runs_on_an_lfm2_targets_features(tmp_path):
    """An LFM2 target (short convolutions and attention layers) feeds the drafter its residual stream at the taps."""
    target = lfm2_target()
    drafter = hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / "d", published_config(),
                                                                     published_tensors()))
    drafter.attach_target(target)
    ids = torch.randint(6, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1] for i in TAPS], dim=-1)
        out = drafter(input_ids=torch.tensor([[int(ids[0, -1])] + [MASK] * (BLOCK - 1)]),
                      target_hidden_states=features, previous_token_ids=torch.tensor([[int(ids[0, -1]), 7, 8, 9]]))
    assert out.logits.shape == (1, BLOCK, VOCAB) and torch.isfinite(out.logits).all()


def test_decodes_exactly_against_a_full_attention_target_of_the_same_width(tmp_path):
    """LFM2 targets are hybrid (short convolutions), so the exactness check runs on a Qwen3 stand-in of the same
    width whose next token the drafter's Markov head predicts often: drafts are accepted, partially and fully."""
    target = bigram_target(VOCAB, HIDDEN, TARGET_DEPTH, num_attention_heads=HEADS, num_key_value_heads=KV)
    w1, w2 = agreeing_markov_head(target)
    tensors = {**published_tensors(rank=VOCAB), "markov_head.markov_w1.weight": w1,
               "markov_head.markov_w2.weight": w2}
    drafter = hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / "e", published_config(
        markov_rank=VOCAB), tensors))
    prompts = [torch.randint(6, VOCAB, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    assert assert_greedy_identical(target, drafter, prompts) > 0


@pytest.mark.skipif(not keeps_states_per_position(), reason="this transformers release keeps no per-position "
                    "states: hybrid targets are refused (tests/lossless/test_hybrid_refusal.py)")
def test_decodes_exactly_on_an_lfm2_target_where_generation_runs_hybrid_targets(tmp_path):
    """Decoding with the LFM2 target itself is generation/'s (restoring its convolution states after a partial
    acceptance). Only a transformers release that keeps no per-position states skips (the refusal is tested
    there); anywhere else a refusal fails."""
    target = lfm2_target(quiet_layers=True)
    w1, w2 = agreeing_markov_head(target)
    tensors = {**published_tensors(rank=VOCAB), "markov_head.markov_w1.weight": w1,
               "markov_head.markov_w2.weight": w2}
    drafter = hf_dspark.AutoDrafter.from_pretrained(write_checkpoint(tmp_path / "f", published_config(
        markov_rank=VOCAB), tensors))
    prompts = [torch.randint(6, VOCAB, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    assert assert_greedy_identical(target, drafter, prompts, max_new_tokens=16) > 0
