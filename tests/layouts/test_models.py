"""Drafter configs, forward semantics, Auto-class round trips and the errors users get for bad input."""

import json
import os

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, LlamaConfig, Qwen3Config

import hf_dspark
from hf_dspark import DrafterTargetMismatchError, DSparkDraftConfig, DSparkDraftModel, Eagle3DraftConfig
from hf_dspark.generation import DraftingPlan
from factories import prompts, tiny_drafter, tiny_target
from layout_fixtures import assert_cache_context_matches_forward


def test_from_target_config_copies_shapes_for_every_family(family):
    target = tiny_target(family)
    text = target.config.get_text_config()
    for config in (
        DSparkDraftConfig.from_target_config(target.config),
        hf_dspark.build_dflash_config(target.config),
        Eagle3DraftConfig.from_target_config(target.config),
    ):
        assert config.hidden_size == text.hidden_size and config.vocab_size == text.vocab_size
        assert config.num_attention_heads == text.num_attention_heads
        assert config.num_key_value_heads == text.num_key_value_heads
        assert config.target_num_hidden_layers == text.num_hidden_layers
        assert config.rope_parameters["rope_type"] == "default"
        assert all(0 <= i <= text.num_hidden_layers - 2 for i in config.target_layer_ids)
    dflash = hf_dspark.build_dflash_config(target.config)
    assert dflash.is_dflash and dflash.markov_head is None and not dflash.confidence_head


@pytest.mark.parametrize(
    "depth,expected", [(36, [1, 9, 17, 25, 33]), (40, [1, 10, 19, 28, 37]), (30, [1, 8, 14, 20, 27])]
)
def test_default_target_layers_spread_evenly(depth, expected):
    target_config = Qwen3Config(num_hidden_layers=depth, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)
    config = DSparkDraftConfig.from_target_config(target_config)
    assert config.target_layer_ids == expected
    assert config.num_hidden_layers == 5 and config.block_size == 7 and config.markov_rank == 256
    eagle = Eagle3DraftConfig.from_target_config(target_config)
    assert eagle.target_layer_ids == [1, depth // 2 - 1, depth - 4]


def test_rope_scaling_is_carried_over():
    target_config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=100,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    drafter = DSparkDraftModel(DSparkDraftConfig.from_target_config(target_config, num_hidden_layers=1))
    assert drafter.config.rope_parameters["rope_type"] == "llama3"
    default = DSparkDraftModel(DSparkDraftConfig.from_target_config(
        target_config, num_hidden_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert not torch.allclose(drafter.rotary_emb.inv_freq, default.rotary_emb.inv_freq)


def _context(target, ids, drafter):
    out = target(ids, output_hidden_states=drafter.target_hidden_state_indices)
    return torch.cat([out.hidden_states[i] for i in drafter.target_hidden_state_indices], dim=-1)


def test_cached_context_equals_one_pass_context():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "rnn")
    drafter.attach_target(target)
    ids = prompts(1, length=10)[0]
    features = _context(target, ids, drafter)
    block = torch.tensor([[5] + [drafter.config.mask_token_id] * 3])
    with torch.no_grad():
        whole = drafter(input_ids=block, target_hidden_states=features).base_logits
        cache = hf_dspark.DraftContextCache()
        drafter(input_ids=block, target_hidden_states=features[:, :4], cache=cache)
        drafter(input_ids=block, target_hidden_states=features[:, 4:7], cache=cache)
        chunked = drafter(input_ids=block, target_hidden_states=features[:, 7:], cache=cache).base_logits
    assert cache.get_seq_length() == features.shape[1]  # block rows never enter the cache
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["markov", "dflash"])
def test_cache_context_appends_what_a_drafting_pass_appends(family, kind):
    target = tiny_target(family)
    drafter = tiny_drafter(target, kind)
    drafter.attach_target(target)
    features = torch.cat([_context(target, ids, drafter) for ids in prompts(4, length=7)[::3]], dim=0)  # 2 rows
    assert_cache_context_matches_forward(drafter, features)


def test_block_is_bidirectional_and_mask_blocks_future_context():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov")
    drafter.attach_target(target)
    features = _context(target, prompts(1, length=8)[0], drafter)
    block = torch.tensor([[7, 3, 3, 3]])
    changed = block.clone()
    changed[0, 3] = 9
    with torch.no_grad():
        a = drafter(input_ids=block, target_hidden_states=features).base_logits
        b = drafter(input_ids=changed, target_hidden_states=features).base_logits
    assert not torch.allclose(a[:, 0], b[:, 0])  # slot 0 sees the last slot: bidirectional

    # A training-style mask: the block may only see context rows before its anchor (position 4).
    keys = features.shape[1] + 4
    mask = torch.zeros(1, 1, 4, keys, dtype=torch.bool)
    mask[..., :4] = True
    mask[..., features.shape[1]:] = True
    positions = torch.arange(4, 8)[None]
    altered = features.clone()
    altered[:, 4:] = torch.randn_like(altered[:, 4:])
    with torch.no_grad():
        c = drafter(input_ids=block, target_hidden_states=features, attention_mask=mask, position_ids=positions)
        d = drafter(input_ids=block, target_hidden_states=altered, attention_mask=mask, position_ids=positions)
        e = drafter(input_ids=block, target_hidden_states=features[:, :4], position_ids=positions)
    torch.testing.assert_close(c.base_logits, d.base_logits)  # no leakage from context at/after the anchor
    torch.testing.assert_close(c.base_logits, e.base_logits, rtol=1e-5, atol=1e-5)


def test_sequential_and_confidence_heads_follow_previous_tokens():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    drafter.attach_target(target)
    features = _context(target, prompts(1)[0], drafter)
    block = torch.tensor([[7, 3, 3, 3]])
    previous = torch.tensor([[7, 11, 12, 13]])
    with torch.no_grad():
        out = drafter(input_ids=block, target_hidden_states=features, previous_token_ids=previous)
    head = drafter.sequential_head
    expected_bias = head.output(head.token_embedding(previous))
    torch.testing.assert_close(out.logits - out.base_logits, expected_bias, rtol=1e-5, atol=1e-5)
    assert out.confidence_logits.shape == (1, 4)
    selected = torch.tensor([[True, False, True, False]])
    with torch.no_grad():
        partial = drafter(input_ids=block, target_hidden_states=features, previous_token_ids=previous,
                          logits_mask=selected)
    torch.testing.assert_close(partial.logits, out.logits[selected], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["markov", "gated", "rnn", "dflash", "dflash2", "eagle3"])
def test_save_and_auto_load_round_trip(tmp_path, kind):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, kind)
    drafter.save_pretrained(tmp_path)
    # Weights in one safetensors file; the modeling code and custom_generate/ serve stock transformers (test_hub);
    # generation_config.json holds the drafting defaults.
    assert {p for p in os.listdir(tmp_path) if not p.endswith(".py")} == {"config.json", "generation_config.json",
                                                                          "model.safetensors", "custom_generate"}
    stored = load_file(tmp_path / "model.safetensors")
    assert not any("embed_tokens" in k or "lm_head" in k for k in stored)  # shared with the target, not stored
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is type(drafter.config)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(drafter)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    # Non-persistent buffers (rotary frequencies) are rebuilt, not left as uninitialised memory.
    for _ in range(3):
        again = AutoModel.from_pretrained(tmp_path)
        torch.testing.assert_close(again.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq, rtol=0, atol=0)
    ids = prompts(1)[0]
    assert torch.equal(
        target.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=8),
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=8),
    )


def test_missing_corrupt_and_non_safetensors_weights_are_refused(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov")
    drafter.save_pretrained(tmp_path)
    # Missing tensor.
    stored = load_file(tmp_path / "model.safetensors")
    from safetensors.torch import save_file

    broken = tmp_path / "missing"
    broken.mkdir()
    (broken / "config.json").write_text((tmp_path / "config.json").read_text())
    save_file({k: v for k, v in stored.items() if "fc." not in k}, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights"):
        AutoModel.from_pretrained(broken)
    # Config that does not fit the weights.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    config = json.loads((tmp_path / "config.json").read_text())
    config["markov_rank"] = 8
    (wrong / "config.json").write_text(json.dumps(config))
    (wrong / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="wrong shape"):
        AutoModel.from_pretrained(wrong)
    # Truncated file.
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((tmp_path / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:200])
    with pytest.raises(Exception, match="(?i)safetensors|header|deserializ"):
        AutoModel.from_pretrained(corrupt)
    # Pickle weights only.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tmp_path / "config.json").read_text())
    torch.save(stored, pickled / "pytorch_model.bin")
    with pytest.raises(hf_dspark.UserInputError, match=r"pickled weights \(pytorch_model.bin\) and no model.sa"):
        AutoModel.from_pretrained(pickled)
    with pytest.raises(ValueError, match="safetensors only"):
        AutoModel.from_pretrained(tmp_path, use_safetensors=False)


def test_mismatched_drafter_fails_before_any_token():
    target = tiny_target("llama")
    ids = prompts(1)[0]
    wider = tiny_target("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    cases = {
        "hidden_size": tiny_drafter(wider, "markov"),
        "vocab_size": tiny_drafter(tiny_target("llama", vocab_size=80), "markov"),
        "target layers": tiny_drafter(target, "markov", target_layer_ids=[1, 3]),
        "mask_token_id": tiny_drafter(target, "dflash", mask_token_id=500),
    }
    for needle, drafter in cases.items():
        with pytest.raises(DrafterTargetMismatchError, match=needle):
            target.generate(ids, assistant_model=drafter, max_new_tokens=4)
    eagle = tiny_drafter(target, "eagle3", target_layer_ids=[0, 7])
    with pytest.raises(DrafterTargetMismatchError, match="target layers"):
        target.generate(ids, assistant_model=eagle, max_new_tokens=4)


def test_impossible_settings_are_refused():
    target = tiny_target("llama")
    invalid_config = (ValueError, StrictDataclassClassValidationError)
    with pytest.raises(invalid_config, match="markov_head must be one of"):
        DSparkDraftConfig.from_target_config(target.config, markov_head="lstm")
    with pytest.raises(invalid_config, match="needs markov_rank > 0"):
        DSparkDraftConfig.from_target_config(target.config, markov_head="markov", markov_rank=0)
    with pytest.raises(invalid_config, match="block_size must be at least 1"):
        DSparkDraftConfig.from_target_config(target.config, block_size=0)
    drafter = tiny_drafter(target, "markov")
    with pytest.raises(RuntimeError, match="attach_target"):
        drafter(input_ids=torch.tensor([[1, 2, 3, 4]]))
    padded = prompts(1)[0]
    mask = torch.ones_like(padded)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padding"):
        target.generate(padded, attention_mask=mask, assistant_model=drafter, max_new_tokens=4)


def test_sequential_head_is_indexed_by_the_draft_vocabulary():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", draft_vocab_size=24)
    drafter.set_draft_vocab(torch.arange(40, 64))
    head = drafter.sequential_head
    assert head.token_embedding.num_embeddings == 25 and head.output.out_features == 24
    rows = drafter.head_rows(torch.tensor([40, 63, 5, 95]))
    assert rows.tolist() == [0, 23, 24, 24]  # tokens outside the draft vocabulary share the last row
    drafter.set_draft_vocab(torch.arange(0, 24))
    assert drafter.head_rows(torch.tensor([5, 40])).tolist() == [5, 24]  # the lookup follows a new vocabulary


def test_deepspec_presets_for_published_targets():
    from transformers import Qwen3Config

    qwen3_8b = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    config = hf_dspark.DSparkDraftConfig.for_target("Qwen/Qwen3-8B", target_config=qwen3_8b)
    assert (config.num_hidden_layers, config.block_size, config.markov_rank) == (5, 7, 256)
    assert config.target_layer_ids == [1, 9, 17, 25, 33] and config.mask_token_id == 151669
    assert config.confidence_head and config.markov_head == "markov" and config.hidden_size == 4096
    assert hf_dspark.DSparkDraftConfig.for_target("Qwen/Qwen3-8B", target_config=qwen3_8b,
                                                  num_hidden_layers=3).num_hidden_layers == 3
    with pytest.raises(ValueError, match="do not fit"):
        hf_dspark.DSparkDraftConfig.for_target("Qwen/Qwen3-14B", target_config=tiny_target("qwen3").config)
    with pytest.raises(ValueError, match="no DeepSpec preset"):
        hf_dspark.DSparkDraftConfig.for_target("meta-llama/Llama-3-8B", target_config=qwen3_8b)


def test_model_card_renders_valid_metadata_and_the_config():
    import yaml

    from hf_dspark.hub.model_card import render_model_card

    drafter = tiny_drafter(tiny_target("llama"), "markov", draft_vocab_size=24)
    card = render_model_card(kind="dspark", base_model="HuggingFaceTB/SmolLM2-135M-Instruct", title="T",
                             summary="S", config=drafter.config, commands=["hf-dspark train --kind dspark"],
                             training="trained", measured="| tau |", datasets=["some/dataset"])
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["library_name"] == "transformers"
    assert "dspark" in front["tags"] and front["datasets"] == ["some/dataset"]
    assert "hf-dspark train --kind dspark" in card and "draft vocabulary of the 24" in card


# ---------------------------------------------------------------------------------------------------------
# Loading refuses what would change the drafter's outputs, naming the file and the field
# ---------------------------------------------------------------------------------------------------------


def saved_copy(source, folder, edit=None, weights: bytes | None = None):
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    if edit is not None:
        edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(weights if weights is not None else
                                               (source / "model.safetensors").read_bytes())
    return folder


def test_a_truncated_safetensors_file_is_named(tmp_path):
    target = tiny_target("llama")
    tiny_drafter(target, "markov").save_pretrained(tmp_path / "good")
    half = (tmp_path / "good" / "model.safetensors").read_bytes()
    corrupt = saved_copy(tmp_path / "good", tmp_path / "corrupt", weights=half[: len(half) // 2])
    for load in (AutoModel.from_pretrained, DSparkDraftModel.from_pretrained):
        with pytest.raises(hf_dspark.DrafterLoadError, match=f"{corrupt / 'model.safetensors'}.*truncated"):
            load(corrupt)


def test_a_drafter_folder_of_another_architecture_is_refused(tmp_path):
    target = tiny_target("llama")
    tiny_drafter(target, "markov").save_pretrained(tmp_path / "good")
    llama = saved_copy(tmp_path / "good", tmp_path / "llama", lambda c: c.update(model_type="llama"))
    with pytest.raises(hf_dspark.DrafterLoadError, match=r"config.json has model_type 'llama'.*not a drafter layout hf_dspark reads.*AutoDrafter"):
        DSparkDraftModel.from_pretrained(llama)
    tiny_drafter(target, "eagle3").save_pretrained(tmp_path / "eagle3")
    with pytest.raises(hf_dspark.DrafterLoadError, match="'eagle3_draft', but DSparkDraftModel is 'dspark'"):
        DSparkDraftModel.from_pretrained(tmp_path / "eagle3")

    from hf_dspark.models.loading import load_drafter

    with pytest.raises(hf_dspark.UserInputError, match="model_type 'llama' and architectures .* is no drafter layout hf_dspark reads"):
        load_drafter(llama, torch.float32)
    target.save_pretrained(tmp_path / "target")  # the classic swap: the target folder given as the drafter
    with pytest.raises(hf_dspark.UserInputError, match="no drafter layout hf_dspark reads"):
        load_drafter(tmp_path / "target", torch.float32)


@pytest.mark.parametrize("kind,field", [("markov", "rope_parameters"), ("markov", "mask_token_id"),
                                        ("dflash", "mask_token_id"), ("eagle3", "rope_parameters")])
def test_missing_fields_that_change_outputs_are_refused(tmp_path, kind, field):
    """Stock loading fills a missing rope_parameters or mask_token_id with a default, and the drafter proposes
    other tokens (still lossless, but tau changed from 1.70 to 1.95 in the probe): refused, naming file and field."""
    target = tiny_target("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, pad_token_id=5)
    tiny_drafter(target, kind).save_pretrained(tmp_path / "good")
    broken = saved_copy(tmp_path / "good", tmp_path / "broken", lambda c: c.pop(field))
    for load in (AutoModel.from_pretrained, type(AutoModel.from_pretrained(tmp_path / "good")).from_pretrained):
        with pytest.raises(hf_dspark.DrafterLoadError, match=f"{broken / 'config.json'} has no '{field}'"):
            load(broken)
    if field == "rope_parameters":  # a transformers-4 style rope_theta is named, not silently ignored
        legacy = saved_copy(tmp_path / "good", tmp_path / "legacy",
                            lambda c: c.update(rope_theta=c.pop("rope_parameters")["rope_theta"]))
        with pytest.raises(hf_dspark.DrafterLoadError, match="old field rope_theta=500000.0: move it into"):
            AutoModel.from_pretrained(legacy)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_shipped_checkpoints_carry_every_required_field_and_load(kind):
    folder = hf_dspark.shipped_drafter_path(kind)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    drafter = AutoModel.from_pretrained(folder)
    for field in type(drafter.config).required_saved_fields:
        assert config[field] is not None and getattr(drafter.config, field) == config[field]


def test_num_assistant_tokens_follows_one_rule(tmp_path, monkeypatch):
    """More drafts than block_size crashed at batch 1 and were clamped silently in a batch, and 0 meant block_size:
    both paths now refuse anything outside 1..block_size, before any token, whether the drafter's default or the
    call sets it."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    ids = prompts(1, length=6)[0]
    message = r"num_assistant_tokens must be an int from 1 to the drafter's 4 draft slots"
    with monkeypatch.context() as patched:
        patched.setattr(type(target), "forward", lambda *a, **k: pytest.fail("a forward ran"))
        for bad in (0, -1, 5, 2.5, True):
            with pytest.raises(ValueError, match=message):
                target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12,
                                num_assistant_tokens=bad)
            drafter.generation_config.num_assistant_tokens = bad
            with pytest.raises(ValueError, match=message):
                target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
            drafter.generation_config.num_assistant_tokens = None
    assert drafter.generation_config.num_assistant_tokens is None and DraftingPlan.for_call(drafter).draft_length == 4
    expected = target.generate(ids, do_sample=False, max_new_tokens=12)
    for length in (1, 4):
        drafter.generation_config.num_assistant_tokens = length
        assert DraftingPlan.for_call(drafter).draft_length == length
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
        assert torch.equal(out, expected)
        assert max(drafter.last_generation_stats.draft_lengths) <= length
    drafter.config.block_size = 2  # a length that stopped fitting is refused on use too, not clamped
    with pytest.raises(ValueError, match="2 draft slots"):
        DraftingPlan.for_call(drafter)
    eagle = tiny_drafter(target, "eagle3", block_size=3)
    with pytest.raises(ValueError, match="3 draft slots"):
        target.generate(ids, assistant_model=eagle, do_sample=False, max_new_tokens=12, num_assistant_tokens=4)
