"""DeepSpec checkpoint import/export: every published tensor mapped, identical logits after a round trip, the
slot-convention trap refused."""

import json

import pytest
import torch
from safetensors.torch import save_file

import hf_dspark
from hf_dspark.cli.main import main
from hf_dspark.hub.convert import SlotConventionError, export_deepspec, import_deepspec
from conftest import tiny_drafter, tiny_target


def published_layout(target, *, layers=2, fused=2, rank=16, confidence=True, block=4):
    """A checkpoint laid out as DeepSpec's `Qwen3DSparkModel` saves it (key names and shapes from DeepSpec's
    modeling code; config = a copy of the target's Qwen3 config plus the DSpark fields), random weights."""
    c = target.config
    d, heads, kv, hd, inter, vocab = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                      c.intermediate_size, c.vocab_size)
    shapes = {"fc.weight": (d, fused * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                   p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                   p + "mlp.down_proj.weight": (d, inter), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
    if rank:
        shapes |= {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)}
    if confidence:
        shapes |= {"confidence_head.proj.weight": (1, d + rank), "confidence_head.proj.bias": (1,)}
    generator = torch.Generator().manual_seed(7)
    weights = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(torch.bfloat16).clone()
    weights["lm_head.weight"] = target.get_output_embeddings().weight.detach().to(torch.bfloat16).clone()
    config = c.to_dict() | {
        "architectures": ["Qwen3DSparkModel"], "num_target_layers": c.num_hidden_layers, "num_hidden_layers": layers,
        "block_size": block, "tie_word_embeddings": False, "layer_types": ["full_attention"] * layers,
        "mask_token_id": 3, "target_layer_ids": [0, 1][:fused], "num_anchors": 512,
        "enable_confidence_head": confidence, "markov_rank": rank}
    if confidence:
        config["confidence_head_with_markov"] = bool(rank)
    if rank:
        config["markov_head_type"] = "vanilla"
    return config, weights


def write_checkpoint(folder, config, weights):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def published_eagle3_layout(target, *, fused=5, ttt=4):
    """DeepSpec's `Qwen3Eagle3Model`: one layer reading [embedding ; hidden] (2d wide) with Qwen3 q/k norms."""
    c = target.config
    d, heads, kv, hd, inter = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    p = "layers.0."
    shapes = {"fc.weight": (d, fused * d), "norm.weight": (d,),
              p + "self_attn.q_proj.weight": (heads * hd, 2 * d), p + "self_attn.k_proj.weight": (kv * hd, 2 * d),
              p + "self_attn.v_proj.weight": (kv * hd, 2 * d), p + "self_attn.o_proj.weight": (d, heads * hd),
              p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
              p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
              p + "mlp.down_proj.weight": (d, inter), p + "hidden_norm.weight": (d,),
              p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    generator = torch.Generator().manual_seed(8)
    weights = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(torch.bfloat16).clone()
    weights["lm_head.weight"] = target.get_output_embeddings().weight.detach().to(torch.bfloat16).clone()
    config = c.to_dict() | {
        "architectures": ["Qwen3Eagle3Model"], "num_target_layers": c.num_hidden_layers, "num_hidden_layers": 1,
        "layer_types": ["full_attention"], "target_model_name_or_path": "Qwen/Qwen3-8B",
        "target_layer_ids": [0, 1, 1, 2, 2][:fused], "ttt_length": ttt, "step_loss_decay": 0.8,
        "draft_num_hidden_layers": 1, "tie_word_embeddings": False}
    return config, weights


def test_every_published_eagle3_tensor_is_mapped(qwen3, tmp_path):
    config, weights = published_eagle3_layout(qwen3, fused=5)
    config["target_layer_ids"] = [0, 1, 2, 1, 0]
    drafter = import_deepspec(write_checkpoint(tmp_path / "e", config, weights), target=qwen3)
    assert isinstance(drafter, hf_dspark.Eagle3DraftModel) and drafter.config.block_size == 4
    state = drafter.state_dict()
    for name, tensor in weights.items():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(state[name], tensor), name
    assert len(state) == len(weights) - 2


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_every_published_tensor_is_mapped(qwen3, tmp_path, kind):
    rank, confidence = (16, True) if kind == "dspark" else (0, False)
    config, weights = published_layout(qwen3, rank=rank, confidence=confidence)
    drafter = import_deepspec(write_checkpoint(tmp_path / kind, config, weights), target=qwen3)
    state = drafter.state_dict()
    renamed = {"markov_head.markov_w1.weight": "sequential_head.token_embedding.weight",
               "markov_head.markov_w2.weight": "sequential_head.output.weight",
               "confidence_head.proj.weight": "confidence_proj.weight",
               "confidence_head.proj.bias": "confidence_proj.bias"}
    shared = {"embed_tokens.weight", "lm_head.weight"}
    for name, tensor in weights.items():
        if name not in shared:
            assert torch.equal(state[renamed.get(name, name)], tensor), name  # same values, same (bf16) precision
    assert len(state) == len(weights) - len(shared)  # nothing of ours left at its random init
    assert drafter.config.block_size == 4 and drafter.config.mask_token_id == 3
    assert drafter.config.target_num_hidden_layers == qwen3.config.num_hidden_layers
    assert (drafter.config.markov_head is None) == (kind == "dflash")


@pytest.mark.parametrize("kind,options", [("markov", {}), ("markov", {"draft_vocab_size": 40}), ("gated", {}),
                                          ("rnn", {}), ("dflash", {}), ("dflash", {"draft_vocab_size": 40}),
                                          ("dflash", {"confidence_head": True})])
def test_export_import_round_trip_gives_identical_logits(qwen3, tmp_path, kind, options):
    drafter = tiny_drafter(qwen3, kind, **options)
    if options.get("draft_vocab_size"):
        drafter.set_draft_vocab(torch.randperm(qwen3.config.vocab_size, generator=torch.Generator().manual_seed(1))[:40])
    exported = export_deepspec(drafter, tmp_path / "deepspec", target=qwen3)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["sample_from_anchor"] is True
    # Readers on transformers 4 (DeepSpec, pinned engines) take the rotary base from rope_theta.
    assert config["rope_theta"] == drafter.config.rope_parameters["rope_theta"] and config["rope_scaling"] is None
    assert config["enable_confidence_head"] == drafter.config.confidence_head
    back = import_deepspec(exported, target=qwen3)
    drafter.attach_target(qwen3)
    back.attach_target(qwen3)
    features = torch.randn(1, 5, len(drafter.config.target_layer_ids) * qwen3.config.hidden_size)
    block = torch.tensor([[7, 3, 3, 3]])
    previous = torch.tensor([[7, 11, 12, 13]])
    a = drafter(input_ids=block, target_hidden_states=features, previous_token_ids=previous)
    b = back(input_ids=block, target_hidden_states=features, previous_token_ids=previous)
    assert torch.equal(a.logits, b.logits)
    if a.confidence_logits is not None:
        assert torch.equal(a.confidence_logits, b.confidence_logits)


@pytest.mark.parametrize("fields", [{"sample_from_anchor": False}, {"dspark_bonus_anchor": True},
                                    {"speculators_model_type": "dspark"},
                                    {"architectures": ["DFlashDraftModel"]}])
def test_slot_convention_mismatch_is_refused(qwen3, tmp_path, fields):
    config, weights = published_layout(qwen3)
    with pytest.raises(SlotConventionError, match=r"anchor \+ k \+ 1"):
        import_deepspec(write_checkpoint(tmp_path / "c", config | fields, weights))


def test_import_refuses_a_drafter_of_another_target(qwen3, tmp_path):
    config, weights = published_layout(qwen3)
    other = tiny_target("qwen3", seed=5)
    with pytest.raises(hf_dspark.DrafterTargetMismatchError, match="another model"):
        import_deepspec(write_checkpoint(tmp_path / "c", config, weights), target=other)
    # A fine-tuned target (the same model, its head nudged) is another model too.
    nudged = tiny_target("qwen3")
    with torch.no_grad():
        nudged.get_output_embeddings().weight.add_(0.01 * torch.randn_like(nudged.get_output_embeddings().weight))
    with pytest.raises(hf_dspark.DrafterTargetMismatchError, match="lm_head"):
        import_deepspec(tmp_path / "c", target=nudged)
    assert import_deepspec(tmp_path / "c", target=qwen3) is not None  # the bf16 copy of the right target passes


def test_import_refuses_missing_or_unknown_tensors(qwen3, tmp_path):
    config, weights = published_layout(qwen3)
    del weights["layers.1.mlp.up_proj.weight"]
    weights["medusa_head.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="missing.*layers.1.mlp.up_proj.weight.*unexpected.*medusa_head"):
        import_deepspec(write_checkpoint(tmp_path / "c", config, weights))


def test_export_refuses_what_deepspec_cannot_hold():
    llama = tiny_target("llama")
    with pytest.raises(ValueError, match="q/k RMSNorm"):
        export_deepspec(tiny_drafter(llama, "markov"), "/nonexistent")
    with pytest.raises(ValueError, match="q/k RMSNorm"):
        export_deepspec(tiny_drafter(llama, "eagle3"), "/nonexistent")
    qwen = tiny_target("qwen3")
    with pytest.raises(ValueError, match="only 1-layer"):
        export_deepspec(tiny_drafter(qwen, "eagle3", num_hidden_layers=2), "/nonexistent")
    with pytest.raises(ValueError, match="draft vocabulary .* pass the target"):
        export_deepspec(tiny_drafter(qwen, "markov", draft_vocab_size=40), "/nonexistent")


def test_eagle3_export_import_round_trip_gives_identical_logits(qwen3, tmp_path):
    drafter = tiny_drafter(qwen3, "eagle3")
    assert drafter.config.qk_norm  # a Qwen3 target: per-head q/k norms, as in DeepSpec
    exported = export_deepspec(drafter, tmp_path / "deepspec", target=qwen3)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Eagle3Model"] and config["ttt_length"] == drafter.config.block_size
    back = import_deepspec(exported, target=qwen3)
    ids = torch.tensor([[5, 9, 17, 3, 44, 61, 2, 8]])
    drafter.eval()
    for model in (drafter, back):
        model.attach_target(qwen3)
    features = torch.randn(1, 6, len(drafter.config.target_layer_ids) * qwen3.config.hidden_size)
    a = drafter(input_ids=ids[:, :6], target_hidden_states=features)
    b = back(input_ids=ids[:, :6], target_hidden_states=features)
    assert torch.equal(a.logits, b.logits)
    assert qwen3.generate(ids, assistant_model=back, max_new_tokens=10, do_sample=False).tolist() == \
        qwen3.generate(ids, assistant_model=drafter, max_new_tokens=10, do_sample=False).tolist()


def test_convert_cli_both_directions(qwen3, tmp_path):
    qwen3.save_pretrained(tmp_path / "target")
    config, weights = published_layout(qwen3)
    source = write_checkpoint(tmp_path / "deepspec", config, weights)
    assert main(["convert", str(source), str(tmp_path / "ours"), "--target", str(tmp_path / "target")]) == 0
    ours = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path / "ours")
    assert (tmp_path / "ours" / "custom_generate" / "generate.py").is_file()
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "again"), "--target", str(tmp_path / "target")]) == 0
    again = import_deepspec(tmp_path / "again", target=qwen3)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name])


def test_convert_cli_explains_a_refusal(tmp_path, capsys):
    llama = tiny_target("llama")
    tiny_drafter(llama, "markov").save_pretrained(tmp_path / "llama-drafter")
    assert main(["convert", str(tmp_path / "llama-drafter"), str(tmp_path / "out")]) == 2
    assert "q/k RMSNorm" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields", [{"sample_from_anchor": 0}, {"sample_from_anchor": "false"},
                                    {"sample_from_anchor": "False"}, {"dflash_config": {"sample_from_anchor": "0"}},
                                    {"dspark_bonus_anchor": 1}, {"dspark_bonus_anchor": "true"},
                                    {"speculators_model_type": "dflash", "sample_from_anchor": "false"}])
def test_slot_convention_flags_are_read_however_they_are_written(qwen3, tmp_path, fields):
    config, weights = published_layout(qwen3)
    with pytest.raises(SlotConventionError, match=r"anchor \+ k \+ 1"):
        import_deepspec(write_checkpoint(tmp_path / "c", config | fields, weights))


def test_slot_convention_flag_that_is_not_a_boolean_is_refused_and_true_passes(qwen3, tmp_path):
    config, weights = published_layout(qwen3)
    with pytest.raises(SlotConventionError, match="sample_from_anchor='maybe'.*write true or false"):
        import_deepspec(write_checkpoint(tmp_path / "c", config | {"sample_from_anchor": "maybe"}, weights))
    for index, value in enumerate([True, 1, "true", "True"]):
        fields = {"sample_from_anchor": value, "dspark_bonus_anchor": "false", "speculators_model_type": "dspark"}
        assert import_deepspec(write_checkpoint(tmp_path / f"ok{index}", config | fields, weights)) is not None


def test_convert_cli_names_a_config_that_does_not_fit_its_weights(qwen3, tmp_path, capsys):
    """Three target layers in config.json but an fc fusing two: a one-line refusal naming the field, exit code 2
    (it was a raw size-mismatch RuntimeError from load_state_dict)."""
    config, weights = published_layout(qwen3, fused=2)
    source = write_checkpoint(tmp_path / "deepspec", config | {"target_layer_ids": [0, 1, 2]}, weights)
    with pytest.raises(ValueError, match=r"fc.weight \(64, 128\) stored, \(64, 192\) for the config.*target_layer_ids"):
        import_deepspec(source)
    assert main(["convert", str(source), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "target_layer_ids" in err and "Traceback" not in err
    assert not (tmp_path / "ours").exists()
