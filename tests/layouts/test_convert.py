"""DeepSpec checkpoint import/export: every published tensor mapped, identical logits after a round trip, both slot
conventions kept (a checkpoint whose slot j predicts anchor + j loads as such), other layouts' fields refused."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_dspark
from hf_dspark.cli.main import main
from hf_dspark.hub.convert import export_deepspec, import_deepspec
from hf_dspark.models.errors import DrafterLoadError
from factories import prompts, tiny_drafter, tiny_target


def qwen3_layer_shapes(p: str, d: int, heads: int, kv: int, hd: int, inter: int, attention_input: int | None = None
                       ) -> dict:
    """Tensor names and shapes of one Qwen3 decoder layer under prefix `p` (DeepSpec's draft layers); Eagle3's
    attention reads `attention_input` = 2d features."""
    a = attention_input or d
    return {p + "self_attn.q_proj.weight": (heads * hd, a), p + "self_attn.k_proj.weight": (kv * hd, a),
            p + "self_attn.v_proj.weight": (kv * hd, a), p + "self_attn.o_proj.weight": (d, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter), p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,)}


def published_layout(target, *, layers=2, fused=2, rank=16, confidence=True, block=4):
    """A checkpoint laid out as DeepSpec's `Qwen3DSparkModel` saves it (key names and shapes from DeepSpec's
    modeling code; config = a copy of the target's Qwen3 config plus the DSpark fields), random weights."""
    c = target.config
    d, heads, kv, hd, inter, vocab = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                      c.intermediate_size, c.vocab_size)
    shapes = {"fc.weight": (d, fused * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(layers):
        shapes |= qwen3_layer_shapes(f"layers.{i}.", d, heads, kv, hd, inter)
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
    shapes = {"fc.weight": (d, fused * d), "norm.weight": (d,), p + "hidden_norm.weight": (d,),
              **qwen3_layer_shapes(p, d, heads, kv, hd, inter, attention_input=2 * d)}
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
                                    # The flags however they are written: 0 / "false" / "0", 1 / "true".
                                    {"sample_from_anchor": 0}, {"sample_from_anchor": "false"},
                                    {"sample_from_anchor": "False"}, {"dspark_bonus_anchor": 1},
                                    {"dspark_bonus_anchor": "true"}])
def test_a_checkpoint_whose_slot_j_predicts_anchor_plus_j_keeps_that_convention(qwen3, tmp_path, fields):
    config, weights = published_layout(qwen3)
    drafter = import_deepspec(write_checkpoint(tmp_path / "c", config | fields, weights))
    assert drafter.config.sample_from_anchor is False and drafter.config.first_draft_slot == 1
    exported = json.loads((export_deepspec(drafter, tmp_path / "out") / "config.json").read_text())
    assert exported["sample_from_anchor"] is False and exported["dspark_bonus_anchor"] is True


@pytest.mark.parametrize("fields", [{"speculators_model_type": "dspark"}, {"architectures": ["DFlashDraftModel"]},
                                    {"dflash_config": {"sample_from_anchor": "0"}}])
def test_another_projects_fields_in_a_deepspec_config_are_refused(qwen3, tmp_path, fields):
    config, weights = published_layout(qwen3)
    with pytest.raises(DrafterLoadError):
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


def test_slot_convention_flag_that_is_not_a_boolean_is_refused_and_true_passes(qwen3, tmp_path):
    config, weights = published_layout(qwen3)
    with pytest.raises(DrafterLoadError, match="sample_from_anchor='maybe'.*write true or false"):
        import_deepspec(write_checkpoint(tmp_path / "c", config | {"sample_from_anchor": "maybe"}, weights))
    for index, value in enumerate([True, 1, "true", "True"]):
        fields = {"sample_from_anchor": value, "dspark_bonus_anchor": "false"}
        drafter = import_deepspec(write_checkpoint(tmp_path / f"ok{index}", config | fields, weights))
        assert drafter.config.sample_from_anchor is True


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


# ------------------------------------------------------------------------------------------------------------------
# What DeepSpec's own loader asserts, and DeepSpec fields kept through an import/export round trip
# ------------------------------------------------------------------------------------------------------------------

# Read from DeepSpec (deepspec/modeling/dspark/qwen3/modeling.py and eagle3/qwen3/modeling.py, afdfa7c): its
# `__init__` asserts hasattr(config, field) for each.
DEEPSPEC_ASSERTS = {"Qwen3DSparkModel": ["target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
                                         "markov_rank"],
                    "Qwen3Eagle3Model": ["target_layer_ids", "ttt_length", "step_loss_decay"]}


@pytest.mark.parametrize("kind", ["markov", "dflash", "eagle3"])
def test_exports_carry_every_field_deepspecs_loader_asserts(qwen3, tmp_path, kind):
    config = json.loads((export_deepspec(tiny_drafter(qwen3, kind), tmp_path / "x") / "config.json").read_text())
    architecture = config["architectures"][0]
    missing = [f for f in DEEPSPEC_ASSERTS[architecture] if f not in config]
    assert not missing, missing
    if architecture == "Qwen3DSparkModel":
        assert config["num_anchors"] == 512 and config["markov_rank"] >= 1 and "markov_head_type" in config
        assert "confidence_head_with_markov" in config or not config["enable_confidence_head"]
    else:
        assert config["step_loss_decay"] == 0.8


def test_deepspec_fields_survive_import_save_load_and_export(qwen3, tmp_path):
    config, weights = published_layout(qwen3)
    extra = {"num_anchors": 256, "target_model_name_or_path": "Qwen/Qwen3-8B"}
    with pytest.raises(DrafterLoadError, match="deepspec_note"):  # a field nobody reads is refused, not ignored
        import_deepspec(write_checkpoint(tmp_path / "odd", config | extra | {"deepspec_note": 1}, weights))
    source = write_checkpoint(tmp_path / "d", config | extra, weights)
    imported = import_deepspec(source)
    assert imported.config.deepspec_fields == extra
    imported.save_pretrained(tmp_path / "ours")
    reloaded = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path / "ours")
    exported = json.loads((export_deepspec(reloaded, tmp_path / "again") / "config.json").read_text())
    assert {k: exported[k] for k in extra} == extra  # 256, not the default 512

    e_config, e_weights = published_eagle3_layout(qwen3)
    e_extra = {"step_loss_decay": 0.7, "target_model_name_or_path": "Qwen/Qwen3-8B"}
    eagle = import_deepspec(write_checkpoint(tmp_path / "e", e_config | e_extra, e_weights))
    exported = json.loads((export_deepspec(eagle, tmp_path / "e-again") / "config.json").read_text())
    assert {k: exported[k] for k in e_extra} == e_extra


# ------------------------------------------------------------------------------------------------------------------
# `hf-dspark convert` with a tied-embedding target; every failure is one line and exit code 2
# ------------------------------------------------------------------------------------------------------------------


def test_convert_cli_with_a_tied_embedding_target(tmp_path, capsys):
    """SmolLM2, Qwen3-0.6B..4B and Gemma tie the LM head to the embedding: safetensors refuses to save two names
    for one tensor, which crashed the export with a traceback."""
    tied = tiny_target("qwen3", tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    tied.save_pretrained(tmp_path / "target")
    tiny_drafter(tied, "markov").save_pretrained(tmp_path / "ours")
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "deepspec"), "--target", str(tmp_path / "target")]) == 0
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "deepspec" / "model.safetensors")
    assert torch.equal(stored["embed_tokens.weight"], tied.get_input_embeddings().weight)
    assert torch.equal(stored["lm_head.weight"], tied.get_input_embeddings().weight)
    # ... and back, the stored embedding and head checked against the tied target
    assert main(["convert", str(tmp_path / "deepspec"), str(tmp_path / "back"), "--target", str(tmp_path / "target")]) == 0
    back = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path / "back")
    ours = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path / "ours")
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name


def _corrupt_weights(tmp_path):
    folder = tmp_path / "corrupt"
    tiny_drafter(tiny_target("qwen3"), "markov").save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    return folder


@pytest.mark.parametrize("case", ["no-such-folder", "no-config", "bad-json", "bad-target", "corrupt-weights",
                                  "missing-field"])
def test_every_convert_failure_is_one_line_and_exit_code_2(qwen3, tmp_path, capsys, case):
    source, extra = tmp_path / "src", []
    if case == "no-such-folder":
        source = tmp_path / "nowhere"
    elif case == "no-config":
        source.mkdir()
    elif case == "bad-json":
        source.mkdir()
        (source / "config.json").write_text("{not json")
    elif case == "bad-target":
        tiny_drafter(qwen3, "markov").save_pretrained(source)
        extra = ["--target", str(tmp_path / "no-target-here")]
    elif case == "corrupt-weights":
        source = _corrupt_weights(tmp_path)
    else:
        config, weights = published_layout(qwen3)
        del config["mask_token_id"]
        write_checkpoint(source, config, weights)
    capsys.readouterr()
    assert main(["convert", str(source), str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-dspark convert: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------------------
# DFlash exports: a rank-1 all-zero vanilla Markov head, numerically the same drafter
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"confidence_head": True}, {"draft_vocab_size": 40}])
def test_dflash_exports_a_rank1_zero_markov_head_with_identical_outputs(qwen3, tmp_path, monkeypatch, options):
    from hf_dspark.models.formats import deepspec
    from safetensors.torch import load_file

    dflash = tiny_drafter(qwen3, "dflash", **options)
    if options.get("draft_vocab_size"):
        dflash.set_draft_vocab(torch.randperm(qwen3.config.vocab_size, generator=torch.Generator().manual_seed(2))[:40])
    exported = export_deepspec(dflash, tmp_path / "x", target=qwen3)
    config = json.loads((exported / "config.json").read_text())
    stored = load_file(exported / "model.safetensors")
    assert config["markov_rank"] == 1 and config["markov_head_type"] == "vanilla"
    vocab, out_vocab = qwen3.config.vocab_size, options.get("draft_vocab_size", qwen3.config.vocab_size)
    assert stored["markov_head.markov_w1.weight"].shape == (vocab, 1)
    assert stored["markov_head.markov_w2.weight"].shape == (out_vocab, 1)
    assert not stored["markov_head.markov_w1.weight"].any() and not stored["markov_head.markov_w2.weight"].any()
    if options.get("confidence_head"):
        assert config["confidence_head_with_markov"] is True
        assert stored["confidence_head.proj.weight"].shape == (1, qwen3.config.hidden_size + 1)

    # Import recognises the zero head: the DFlash drafter comes back.
    back = import_deepspec(exported, target=qwen3)
    assert back.config.markov_head is None and back.sequential_head is None
    # Loaded as it is written (a DSpark drafter with that rank-1 head), it is numerically the same drafter.
    monkeypatch.setattr(deepspec, "_is_zero_vanilla_head", lambda config, weights: False)
    with_head = import_deepspec(exported, target=qwen3)
    assert with_head.config.markov_head == "markov" and with_head.config.markov_rank == 1
    features = torch.randn(1, 5, len(dflash.config.target_layer_ids) * qwen3.config.hidden_size)
    block, previous = torch.tensor([[7, 3, 3, 3]]), torch.tensor([[7, 11, 12, 13]])
    outputs = []
    for model in (dflash, back, with_head):
        model.attach_target(qwen3)
        outputs.append(model(input_ids=block, target_hidden_states=features, previous_token_ids=previous))
    for out in outputs[1:]:
        assert torch.equal(out.logits, outputs[0].logits)  # the zero bias adds exactly 0.0
    if options.get("confidence_head"):
        assert torch.equal(outputs[1].confidence_logits, outputs[0].confidence_logits)
        # One more (zero) input column can change the float summation order of the d + 1 products, nothing else.
        assert torch.allclose(outputs[2].confidence_logits, outputs[0].confidence_logits, rtol=0, atol=1e-6)
    ids = torch.tensor([[5, 9, 17, 3, 44, 61]])
    plain = qwen3.generate(ids, max_new_tokens=12, do_sample=False)
    for model in (dflash, with_head):  # flat prices: both plan the same rounds
        assert torch.equal(qwen3.generate(ids, assistant_model=model, max_new_tokens=12, do_sample=False,
                                          dspark_learn_round_costs=False), plain)
    assert with_head.last_generation_stats.draft_lengths == dflash.last_generation_stats.draft_lengths
    assert with_head.last_generation_stats.accepted == dflash.last_generation_stats.accepted


def test_draft_vocabulary_export_warns_which_engines_take_it(qwen3, tmp_path, caplog):
    drafter = tiny_drafter(qwen3, "markov", draft_vocab_size=40)
    drafter.set_draft_vocab(torch.arange(40))
    with caplog.at_level("WARNING", logger="hf_dspark.hub.convert"):
        export_deepspec(drafter, tmp_path / "x", target=qwen3)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "draft vocabulary" in text
    assert "vLLM and llama.cpp" in text and "SGLang cannot load it" in text and "DeepSpec has no draft vocabulary" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_dspark.hub.convert"):
        export_deepspec(tiny_drafter(qwen3, "markov"), tmp_path / "full", target=qwen3)
    assert not caplog.records  # a full-vocabulary DSpark export is served by every engine: nothing to warn about


# ------------------------------------------------------------------------------------------------------------------
# target_layer_ids = -1: the embedding output (DeepSpec's convention, HF hidden_states[0])
# ------------------------------------------------------------------------------------------------------------------


def test_minus_one_reads_the_embedding_output_in_generation_training_and_the_cache(qwen3, tmp_path):
    from hf_dspark.training import DSparkTrainer
    from hf_dspark.training.target_cache import TargetCacheDataset, build_target_cache

    drafter = tiny_drafter(qwen3, "markov", target_layer_ids=[-1, 1])
    assert drafter.target_hidden_state_indices == [0, 2]
    width = qwen3.config.hidden_size
    fused = []
    hook = drafter.fc.register_forward_hook(lambda module, args, out: fused.append(args[0].detach().clone()))
    ids = torch.tensor([[5, 9, 17, 3, 44, 61, 2, 8]])
    out = qwen3.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    hook.remove()
    assert torch.equal(out, qwen3.generate(ids, max_new_tokens=12, do_sample=False))
    context = torch.cat(fused, dim=1)[0]  # every context row the drafter fused, in sequence order
    with torch.no_grad():
        reference = qwen3(out, output_hidden_states=True).hidden_states
    rows = context.shape[0]
    assert rows >= ids.shape[1] - 1
    assert torch.allclose(context[:, :width], reference[0][0, :rows], atol=1e-5)  # the embedding output
    assert torch.allclose(context[:, :width], qwen3.get_input_embeddings()(out)[0, :rows], atol=1e-5)
    assert torch.allclose(context[:, width:], reference[2][0, :rows], atol=1e-5)  # layer 1's output

    # Training reads the same features (online), and the target cache stores them.
    trainer = DSparkTrainer(model=drafter, target=qwen3, args=None, num_anchors=4)
    batch = {"input_ids": out, "attention_mask": torch.ones_like(out)}
    features, _ = trainer.target_features(batch)
    assert torch.allclose(features[0, :, :width], reference[0][0], atol=1e-5)
    examples = [{"input_ids": out[0].tolist(), "loss_mask": [0] * 4 + [1] * (out.shape[1] - 4)}]
    build_target_cache(qwen3, examples, tmp_path / "cache", [-1, 1], progress=False)
    cached = TargetCacheDataset(tmp_path / "cache", layer_ids=[-1, 1])[0]["target_features"]
    assert torch.allclose(cached[:, :width].float(), reference[0][0], atol=2e-2)  # stored in bf16


def test_minus_one_converts_both_ways_and_other_negative_ids_are_refused(qwen3, tmp_path, caplog):
    config, weights = published_layout(qwen3, fused=2)
    drafter = import_deepspec(write_checkpoint(tmp_path / "d", config | {"target_layer_ids": [-1, 1]}, weights),
                              target=qwen3)
    assert drafter.config.target_layer_ids == [-1, 1]
    with caplog.at_level("WARNING", logger="hf_dspark.hub.convert"):
        exported = json.loads((export_deepspec(drafter, tmp_path / "x") / "config.json").read_text())
    assert exported["target_layer_ids"] == [-1, 1]
    assert "SGLang refuses negative target layer ids" in " ".join(r.getMessage() for r in caplog.records)
    with pytest.raises(Exception, match="-1 for the embedding output"):  # the config's validation error
        tiny_drafter(qwen3, "markov", target_layer_ids=[-2, 1])
    with pytest.raises(hf_dspark.DrafterTargetMismatchError, match="-1 for the embedding output"):
        tiny_drafter(qwen3, "markov", target_layer_ids=[-1, 3]).attach_target(qwen3)  # 3 = the last layer


# ------------------------------------------------------------------------------------------------------------------
# DeepSpec's per-slot --confidence-threshold beside our cumulative one
# ------------------------------------------------------------------------------------------------------------------


def _record_rounds(monkeypatch, drafter):
    """Per drafting pass (batch 1 and batched): every confidence `slot_confidences` computed (what decides the length),
    the budget and the resulting draft lengths."""
    from hf_dspark.generation.engine import speculative_engine as batched
    from hf_dspark.generation.one_prompt.prompt_rows import OnePromptRows

    rounds, slot_confidences = [], drafter.slot_confidences

    def recording_confidences(hidden, previous_embeddings, first_slot=0):
        confidences = slot_confidences(hidden, previous_embeddings, first_slot)
        rounds[-1]["confidences"] += [confidences[:, j].detach().clone() for j in range(confidences.shape[1])]
        return confidences

    single, batch = OnePromptRows.draft, batched._draft

    def draft_one(self, budget, *args):
        rounds.append({"confidences": [], "budget": budget.tolist()})
        drafts = single(self, budget, *args)
        rounds[-1]["lengths"] = drafts.lengths.tolist()
        return drafts

    def draft_batch(drafter_, rows, budget, *args):
        rounds.append({"confidences": [], "budget": budget.tolist()})
        drafts = batch(drafter_, rows, budget, *args)
        rounds[-1]["lengths"] = drafts.lengths.tolist()
        return drafts

    monkeypatch.setattr(drafter, "slot_confidences", recording_confidences)
    monkeypatch.setattr(OnePromptRows, "draft", draft_one)
    monkeypatch.setattr(batched, "_draft", draft_batch)
    return rounds


def _check_rounds(rounds, rule: str, threshold: float) -> bool:
    """Each row's draft length is DeepSpec's (per_slot) or ours (cumulative) on the confidences computed, within its
    budget. Returns whether some row kept drafting after its survival fell below the threshold."""
    kept_below = False
    for record in rounds:
        for row, (length, budget) in enumerate(zip(record["lengths"], record["budget"])):
            confidences = [float(c[row]) for c in record["confidences"]]
            survival = torch.tensor(confidences).cumprod(0).tolist()
            expected = _deepspec_length(confidences if rule == "per_slot" else survival, threshold)
            assert length == min(expected, budget), (record, row)
            kept_below |= length > 0 and survival[length - 1] < threshold
    return kept_below


def _deepspec_length(confidences: list[float], threshold: float) -> int:
    """DeepSpec's `_confident_prefix_length`: the slots before the first whose own confidence is below it."""
    below = [i for i, c in enumerate(confidences) if c < threshold]
    return below[0] if below else len(confidences)


def test_imported_drafters_use_deepspecs_per_slot_threshold(qwen3, tmp_path, monkeypatch):
    config, weights = published_layout(qwen3)
    drafter = import_deepspec(write_checkpoint(tmp_path / "d", config, weights))
    assert drafter.config.confidence_threshold_rule == "per_slot"
    assert drafter.generation_config.dspark_confidence_threshold_rule == "per_slot"
    drafter.save_pretrained(tmp_path / "ours")
    loaded = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path / "ours")
    assert loaded.generation_config.dspark_confidence_threshold_rule == "per_slot"
    # Ours stays cumulative.
    assert tiny_drafter(qwen3, "markov").generation_config.dspark_confidence_threshold_rule == "cumulative"
    drafter.generation_config.dspark_confidence_threshold_rule = "product"
    monkeypatch.setattr(type(qwen3), "forward", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match="confidence_threshold_rule"):  # refused before any token
        qwen3.generate(prompts(1)[0], assistant_model=drafter, do_sample=False, max_new_tokens=4)


@pytest.mark.parametrize("rule", ["per_slot", "cumulative"])
def test_per_slot_threshold_gives_deepspecs_draft_lengths_and_stays_exact(qwen3, monkeypatch, rule):
    drafter = tiny_drafter(qwen3, "markov", block_size=6)
    drafter.generation_config.update(assistant_confidence_threshold=0.35, dspark_confidence_threshold_rule=rule,
                                     dspark_round_planning=False)  # every round drafts: the rule alone decides
    rounds = _record_rounds(monkeypatch, drafter)
    for ids in prompts(3):
        out = qwen3.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20)
        assert torch.equal(out, qwen3.generate(ids, do_sample=False, max_new_tokens=20))
    assert len(rounds) > 10
    # The rules differ on this drafter: per-slot keeps drafting after the product has fallen below the threshold.
    assert _check_rounds(rounds, rule, 0.35) == (rule == "per_slot")


@pytest.mark.parametrize("rule", ["per_slot", "cumulative"])
def test_per_slot_threshold_in_a_batch_gives_deepspecs_draft_lengths_and_stays_exact(qwen3, monkeypatch, rule):
    drafter = tiny_drafter(qwen3, "markov", block_size=6)
    drafter.generation_config.update(assistant_confidence_threshold=0.35, dspark_confidence_threshold_rule=rule,
                                     dspark_round_planning=False)  # every round drafts: the rule alone decides
    rounds = _record_rounds(monkeypatch, drafter)
    ids = torch.cat([p[:, :6] for p in prompts(3)])
    mask = torch.ones_like(ids)
    out = qwen3.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=16)
    assert torch.equal(out, qwen3.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16))
    assert len(rounds) > 3 and len(rounds[0]["lengths"]) == 3
    assert _check_rounds(rounds, rule, 0.35) == (rule == "per_slot")


# ------------------------------------------------------------------------------------------------------------------
# What each engine reads from an export, pinned (read from vLLM 0.33.0, SGLang 0.5.23, llama.cpp as bundled in
# llama-cpp-python 0.3.36, DeepSpec afdfa7c). vLLM has no missing-weight check, so an export lacking a tensor would
# load uninitialised weights there silently: the tensor lists below are complete on purpose.
# ------------------------------------------------------------------------------------------------------------------


def _qwen3_backbone(config: dict) -> dict:
    """Tensor names and shapes of the Qwen3 draft layers every engine builds from DeepSpec's config."""
    d, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = config.get("head_dim") or d // heads, config["intermediate_size"]
    shapes = {"fc.weight": (d, len(config["target_layer_ids"]) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(config["num_hidden_layers"]):
        shapes |= qwen3_layer_shapes(f"layers.{i}.", d, heads, kv, hd, inter)
        p = f"layers.{i}."
        if config.get("attention_bias"):
            shapes |= {p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                       p + "self_attn.v_proj.bias": (kv * hd,)}
    return shapes


def _compare(stored: dict, required: dict, optional: dict, unknown_is_error: bool) -> list[str]:
    problems = [f"missing {n}" for n in required if n not in stored]
    problems += [f"{n} is {stored[n]}, the engine builds {s}" for n, s in {**required, **optional}.items()
                 if n in stored and s is not None and stored[n] != s]
    if unknown_is_error:
        problems += [f"unexpected {n}" for n in stored if n not in required and n not in optional]
    return problems


def vllm_problems(config: dict, stored: dict) -> list[str]:
    """vllm/model_executor/models/{registry,qwen3_dspark,qwen3_dflash}.py, spec_decode/eagle/eagle3_utils.py."""
    problems = []
    if config.get("architectures") != ["Qwen3DSparkModel"]:  # "DSparkDraftModel" is vLLM's DeepSeek-V4 drafter
        problems.append(f"architectures {config.get('architectures')}")
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "hidden_act", "rms_norm_eps", "max_position_embeddings", "num_hidden_layers",
                  "target_layer_ids", "mask_token_id", "markov_rank"):
        if field not in config:
            problems.append(f"no {field}")
    if "rope_parameters" not in config and "rope_theta" not in config:
        problems.append("no rotary parameters")
    if len(config.get("layer_types") or []) != config.get("num_hidden_layers"):
        problems.append("layer_types must list every draft layer (all full_attention: non-causal blocks)")
    if config.get("sample_from_anchor", True) is not True:
        problems.append("sample_from_anchor is not true")
    if problems:
        return problems
    vocab, d, rank = config["vocab_size"], config["hidden_size"], config["markov_rank"]
    draft_vocab = config.get("draft_vocab_size") or vocab
    required = _qwen3_backbone(config) | {"markov_head.markov_w1.weight": (vocab, rank),
                                          "markov_head.markov_w2.weight": (draft_vocab, rank)}
    if config.get("enable_confidence_head"):  # absent weights silently disable it, so an export must carry them
        width = d + (rank if config.get("confidence_head_with_markov", False) else 0)  # vLLM's default: False
        required |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    optional = {"embed_tokens.weight": (vocab, d), "lm_head.weight": (draft_vocab, d), "t2d": None}
    if draft_vocab < vocab:  # "Reduced-vocabulary ... must include lm_head weights" and "a d2t mapping"
        required |= {"lm_head.weight": (draft_vocab, d), "d2t": (draft_vocab,)}
    return _compare(stored, required, optional, unknown_is_error=True)  # AutoWeightsLoader refuses unknown names


def sglang_problems(config: dict, stored: dict) -> list[str]:
    """sglang/srt/models/{dspark,dflash}.py, speculative/{dflash_utils,dspark_components/dspark_config}.py."""
    problems = []
    if not set(config.get("architectures") or []) & {"Qwen3DSparkModel", "LingDSparkModel", "DSparkDraftModel"}:
        problems.append(f"architectures {config.get('architectures')}")
    rank = int(config.get("markov_rank", 0))
    if rank <= 0:
        problems.append("DSpark requires markov_rank > 0")
    if config.get("markov_head_type", "vanilla") not in ("vanilla", "gated", "rnn"):
        problems.append(f"markov_head_type {config.get('markov_head_type')}")
    if not isinstance(config.get("mask_token_id"), int):
        problems.append("DSpark requires mask_token_id")
    if not isinstance(config.get("block_size"), int):
        problems.append("no block_size (gamma)")
    depth = config.get("num_target_layers") or max(config.get("target_layer_ids") or [0]) + 1
    if any(not 0 <= i < depth for i in config.get("target_layer_ids") or [None]):
        problems.append(f"target_layer_ids {config.get('target_layer_ids')} out of range [0, {depth})")
    if len(config.get("layer_types") or []) != config.get("num_hidden_layers"):
        problems.append("layer_types must have one entry per draft layer")
    if not config.get("sample_from_anchor", True):
        problems.append("sample_from_anchor false")
    if problems:
        return problems
    vocab, d = config["vocab_size"], config["hidden_size"]
    required = _qwen3_backbone(config) | {"markov_head.markov_w1.weight": (vocab, rank),
                                          "markov_head.markov_w2.weight": (vocab, rank)}  # full vocabulary only
    if config.get("enable_confidence_head", True):
        width = d + (rank if config.get("confidence_head_with_markov", rank > 0) else 0)
        required |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    # lm_head / embed_tokens / rotary_emb are skipped (the target's are used) and unknown names are ignored.
    return _compare(stored, required, {}, unknown_is_error=False)


def llama_cpp_problems(config: dict, stored: dict) -> list[str]:
    """convert_hf_to_gguf.py (conversion/qwen.py DSparkModel/DFlashModel, gguf-py tensor_mapping.py) and
    common/speculative.cpp, src/models/dflash.cpp."""
    problems = []
    if not set(config.get("architectures") or []) & {"Qwen3DSparkModel", "DSparkDraftModel", "LingDSparkModel"}:
        problems.append(f"architectures {config.get('architectures')}")
    if config.get("markov_head_type", "vanilla") != "vanilla":
        problems.append("only markov_head_type 'vanilla' converts")
    for field in ("block_size", "target_layer_ids", "mask_token_id"):
        if field not in config:
            problems.append(f"no {field}")
    if config.get("sample_from_anchor") is not True:
        problems.append("sample_from_anchor must be true (anchor-first slots)")
    if "markov_head.markov_w1.weight" not in stored:
        problems.append("no markov_w1: converted as draft-dflash, which reads slots 1..B-1 (off by one)")
    if problems:
        return problems
    vocab, d, rank = config["vocab_size"], config["hidden_size"], stored["markov_head.markov_w1.weight"][1]
    draft_vocab = config.get("draft_vocab_size") or vocab
    required = _qwen3_backbone(config) | {"markov_head.markov_w1.weight": (vocab, rank),
                                          "markov_head.markov_w2.weight": (draft_vocab, rank)}
    optional = {"confidence_head.proj.weight": (1, d + rank), "confidence_head.proj.bias": (1,),  # reads [h; W1]
                "embed_tokens.weight": (vocab, d), "lm_head.weight": (draft_vocab, d), "t2d": None}
    if draft_vocab < vocab:
        required["d2t"] = (draft_vocab,)
    return _compare(stored, required, optional, unknown_is_error=True)  # "Can not map tensor"


def deepspec_problems(config: dict, stored: dict) -> list[str]:
    """deepspec/modeling/dspark/qwen3/modeling.py, dspark/common.py (validate_target_layer_ids), markov_head.py."""
    problems = [f"assert hasattr(config, {f!r})" for f in DEEPSPEC_ASSERTS["Qwen3DSparkModel"] if f not in config]
    rank = int(config.get("markov_rank", 0))
    if rank and "markov_head_type" not in config:
        problems.append("markov_head_type must be provided when markov_rank > 0")
    if config.get("enable_confidence_head") and "confidence_head_with_markov" not in config:
        problems.append("confidence_head_with_markov must be provided")
    ids = config.get("target_layer_ids") or []
    if any(not (i == -1 or 0 <= i < config.get("num_target_layers", 10**9)) for i in ids) or ids != sorted(set(ids)):
        problems.append(f"target_layer_ids {ids}: -1 or target layers, strictly increasing")
    if (config.get("draft_vocab_size") or config["vocab_size"]) != config["vocab_size"]:
        problems.append("DeepSpec has no draft vocabulary")
    if problems:
        return problems
    vocab, d = config["vocab_size"], config["hidden_size"]
    required = _qwen3_backbone(config) | {"embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d)}
    if rank:
        required |= {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)}
    if config.get("enable_confidence_head"):
        width = d + (rank if config["confidence_head_with_markov"] else 0)
        required |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return _compare(stored, required, {"d2t": None, "t2d": None}, unknown_is_error=True)


ENGINES = {"vllm": vllm_problems, "sglang": sglang_problems, "llama.cpp": llama_cpp_problems,
           "deepspec": deepspec_problems}


def _export(drafter, target, folder) -> tuple[dict, dict]:
    from safetensors import safe_open

    export_deepspec(drafter, folder, target=target)
    with safe_open(folder / "model.safetensors", "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return json.loads((folder / "config.json").read_text()), stored


def _engine_case(case: str):
    if case == "tied-embedding target":
        target = tiny_target("qwen3", tie_word_embeddings=True)
        return target, tiny_drafter(target, "markov")
    if case == "dflash":
        target = tiny_target("qwen3")
        return target, tiny_drafter(target, "dflash")
    if case == "dflash with confidence head":
        target = tiny_target("qwen3", tie_word_embeddings=True)
        return target, tiny_drafter(target, "dflash", confidence_head=True)
    if case == "llama target, qk_norm=True":
        target = tiny_target("llama")
        return target, tiny_drafter(target, "markov", qk_norm=True)
    if case == "draft vocabulary":
        target = tiny_target("qwen3")
        drafter = tiny_drafter(target, "markov", draft_vocab_size=40)
        drafter.set_draft_vocab(torch.arange(0, 80, 2))
        return target, drafter
    if case == "embedding output (-1)":
        target = tiny_target("qwen3")
        return target, tiny_drafter(target, "markov", target_layer_ids=[-1, 1])
    raise ValueError(case)


ENGINE_CASES = {  # which engines serve each export (the rest must say why not)
    "tied-embedding target": {"vllm", "sglang", "llama.cpp", "deepspec"},
    "dflash": {"vllm", "sglang", "llama.cpp", "deepspec"},
    "dflash with confidence head": {"vllm", "sglang", "llama.cpp", "deepspec"},
    "llama target, qk_norm=True": {"vllm", "sglang", "llama.cpp", "deepspec"},
    "draft vocabulary": {"vllm", "llama.cpp"},
    "embedding output (-1)": {"vllm", "llama.cpp", "deepspec"},
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_each_engine_finds_every_field_and_tensor_it_reads(tmp_path, case):
    target, drafter = _engine_case(case)
    config, stored = _export(drafter, target, tmp_path / "export")
    for engine, problems in ENGINES.items():
        found = problems(config, stored)
        if engine in ENGINE_CASES[case]:
            assert found == [], (engine, found)
        else:
            assert found, f"{engine} should refuse the {case} export"
    # The export is still the same drafter (logits identical after the round trip).
    back = import_deepspec(tmp_path / "export", target=target)
    for model in (drafter, back):
        model.attach_target(target)
    features = torch.randn(1, 5, len(drafter.config.target_layer_ids) * target.config.hidden_size)
    block, previous = torch.tensor([[7, 3, 3, 3]]), torch.tensor([[7, 11, 12, 13]])
    a = drafter(input_ids=block, target_hidden_states=features, previous_token_ids=previous)
    b = back(input_ids=block, target_hidden_states=features, previous_token_ids=previous)
    assert torch.equal(a.logits, b.logits)


def test_engine_checks_catch_an_incomplete_export(qwen3, tmp_path):
    """What vLLM would load silently (uninitialised weights) is caught here, and DeepSpec's asserts too."""
    config, stored = _export(tiny_drafter(qwen3, "markov"), qwen3, tmp_path / "x")
    incomplete = {k: v for k, v in stored.items() if k != "layers.1.mlp.up_proj.weight"}
    assert vllm_problems(config, incomplete) == ["missing layers.1.mlp.up_proj.weight"]
    assert deepspec_problems({k: v for k, v in config.items() if k != "num_anchors"}, stored) == [
        "assert hasattr(config, 'num_anchors')"]
    assert sglang_problems(config | {"markov_rank": 0}, stored) == ["DSpark requires markov_rank > 0"]


def test_eagle3_export_fits_deepspecs_eagle3_loader(qwen3, tmp_path):
    """deepspec/modeling/eagle3/qwen3/modeling.py: one layer reading [embedding ; hidden] (2d wide)."""
    config, stored = _export(tiny_drafter(qwen3, "eagle3"), qwen3, tmp_path / "e")
    assert [f for f in DEEPSPEC_ASSERTS["Qwen3Eagle3Model"] if f not in config] == []
    d, heads, kv, hd, inter = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                               config["head_dim"], config["intermediate_size"])
    p = "layers.0."
    required = {"fc.weight": (d, len(config["target_layer_ids"]) * d), "norm.weight": (d,),
                "embed_tokens.weight": (config["vocab_size"], d), "lm_head.weight": (config["vocab_size"], d),
                p + "hidden_norm.weight": (d,), **qwen3_layer_shapes(p, d, heads, kv, hd, inter, attention_input=2 * d)}
    assert _compare(stored, required, {}, unknown_is_error=True) == []


# ------------------------------------------------------------------------------------------------------------------
# Issue 25: convert reads safetensors inside the folder only, refuses a target of another architecture and integer
# weights
# ------------------------------------------------------------------------------------------------------------------


class _CreatesMarkerWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")  # unpickling creates the marker file


def _index_naming(folder, entry: str, names) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: entry for name in names}}))


@pytest.mark.parametrize("entry", ["weights.bin", "../outside.safetensors", "/etc/passwd"])
def test_convert_refuses_an_index_naming_a_pickle_or_a_file_outside_the_folder(qwen3, tmp_path, capsys, entry):
    """DeepSpec folders were read by globbing *.safetensors, ignoring the index; an index naming anything but
    safetensors shards inside the folder is now refused (the import reads exactly the shards it names)."""
    config, weights = published_layout(qwen3)
    source = write_checkpoint(tmp_path / "deepspec", config, weights)
    (source / "model.safetensors").rename(tmp_path / "outside.safetensors")
    marker = tmp_path / "unpickled"
    torch.save({"payload": _CreatesMarkerWhenUnpickled(marker)}, source / "weights.bin")
    _index_naming(source, entry, weights)
    with pytest.raises(hf_dspark.UserInputError, match=f"model.safetensors.index.json .*names '{entry}'.*re-save"):
        import_deepspec(source)
    # the export direction reads our drafter (from_pretrained), and --target a target folder, the same way
    tiny_drafter(qwen3, "markov").save_pretrained(tmp_path / "bad-ours")
    tiny_drafter(qwen3, "markov").save_pretrained(tmp_path / "good-ours")
    qwen3.save_pretrained(tmp_path / "bad-target")
    for folder in (tmp_path / "bad-ours", tmp_path / "bad-target"):
        stored = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        _index_naming(folder, entry, stored)
    out = str(tmp_path / "out")
    for argv in ([str(source), out], [str(tmp_path / "bad-ours"), out],
                 [str(tmp_path / "good-ours"), out, "--target", str(tmp_path / "bad-target")],
                 [str(source), out, "--target", str(tmp_path / "bad-target")]):
        capsys.readouterr()
        assert main(["convert", *argv]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("hf-dspark ")]
        assert len(lines) == 1 and "Traceback" not in err and f"names '{entry}'" in lines[0], err
        assert not (tmp_path / "out").exists()
    assert not marker.exists()


def test_import_reads_the_shards_its_index_names(qwen3, tmp_path):
    config, weights = published_layout(qwen3)
    source = tmp_path / "sharded"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(source / shard))
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    save_file({"stale.weight": torch.zeros(2)}, str(source / "stale-copy.safetensors"))  # named by no index entry
    drafter = import_deepspec(source, target=qwen3)
    assert torch.equal(drafter.state_dict()["fc.weight"], weights["fc.weight"])


def _llama_shaped_like(qwen3):
    """A Llama target whose sizes all equal the tiny Qwen3's: only model_type tells them apart."""
    llama = tiny_target("llama")
    for name in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(llama.config, name) == getattr(qwen3.config, name), name
    assert llama.config.head_dim == qwen3.config.head_dim
    return llama


def test_convert_refuses_a_target_of_another_architecture_with_the_same_shapes(qwen3, tmp_path, capsys):
    llama = _llama_shaped_like(qwen3)
    drafter = tiny_drafter(qwen3, "markov")
    with pytest.raises(hf_dspark.DrafterTargetMismatchError, match="'qwen3'.*'llama'"):
        export_deepspec(drafter, tmp_path / "exported", target=llama)
    config, weights = published_layout(qwen3)
    del weights["embed_tokens.weight"], weights["lm_head.weight"]  # nothing to compare with the target's
    source = write_checkpoint(tmp_path / "deepspec", config, weights)
    with pytest.raises(hf_dspark.DrafterTargetMismatchError, match="'qwen3'.*'llama'"):
        import_deepspec(source, target=llama)
    assert import_deepspec(source, target=qwen3) is not None
    llama.save_pretrained(tmp_path / "llama")
    drafter.save_pretrained(tmp_path / "ours")
    for folder in (source, tmp_path / "ours"):
        capsys.readouterr()
        assert main(["convert", str(folder), str(tmp_path / "out"), "--target", str(tmp_path / "llama")]) == 2
        err = capsys.readouterr().err
        assert "'qwen3'" in err and "'llama'" in err and not (tmp_path / "out").exists(), err


def test_integer_weights_are_refused_by_convert_and_from_pretrained(qwen3, tmp_path, capsys):
    config, weights = published_layout(qwen3)
    weights["fc.weight"] = (weights["fc.weight"] * 50).to(torch.int8)
    with pytest.raises(hf_dspark.UserInputError, match=r"fc.weight \(torch.int8\).*float"):
        import_deepspec(write_checkpoint(tmp_path / "deepspec", config, weights))
    folder = tmp_path / "ours"
    tiny_drafter(qwen3, "markov", draft_vocab_size=40).save_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    assert stored["draft_to_target"].dtype == torch.int64  # an integer buffer stays allowed
    hf_dspark.DSparkDraftModel.from_pretrained(folder)
    stored["fc.weight"] = (stored["fc.weight"] * 50).to(torch.int8)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hf_dspark.UserInputError, match=r"fc.weight \(I8\).*float"):
        hf_dspark.DSparkDraftModel.from_pretrained(folder)
    capsys.readouterr()
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 2
    assert "fc.weight (I8)" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------------------
# Issue 24 section 4: what running the exports in llama.cpp build 11434 found (benchmarks/interop/llama_cpp.py)
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,options", [("markov", {}), ("markov", {"draft_vocab_size": 40}), ("dflash", {}),
                                          ("eagle3", {"qk_norm": True})])
def test_export_writes_the_targets_embedding_and_head_in_the_targets_dtype(qwen3, tmp_path, kind, options):
    """hf_dspark drafts with the target's own (float32) embedding and LM head. The export cast them to the
    drafter's dtype (bfloat16 for the shipped drafters), so llama.cpp, which reads the stored embedding and a draft
    vocabulary's LM head rows, drafted from rounded copies. The drafter's own weights keep their precision."""
    drafter = tiny_drafter(qwen3, kind, **options)
    if options.get("draft_vocab_size"):
        drafter.set_draft_vocab(torch.arange(0, 80, 2))
    drafter = drafter.to(torch.bfloat16)
    assert qwen3.dtype == torch.float32
    export_deepspec(drafter, tmp_path / "x", target=qwen3)
    stored = load_file(tmp_path / "x" / "model.safetensors")
    rows = drafter.draft_to_target if drafter.draft_to_target is not None else slice(None)
    assert stored["embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(stored["embed_tokens.weight"], qwen3.get_input_embeddings().weight.detach())
    assert stored["lm_head.weight"].dtype == torch.float32
    assert torch.equal(stored["lm_head.weight"], qwen3.get_output_embeddings().weight.detach()[rows])
    assert stored["fc.weight"].dtype == torch.bfloat16 and torch.equal(stored["fc.weight"], drafter.fc.weight)
    back = import_deepspec(tmp_path / "x", target=qwen3)  # still recognised as the target's embedding and head
    assert torch.equal(back.fc.weight.float(), drafter.fc.weight.float())


def test_eagle3_export_says_why_llama_cpp_cannot_run_it(qwen3, tmp_path, caplog):
    """llama.cpp build 11434's converter registers no `Qwen3Eagle3Model`, and its EAGLE3 graph (src/models/eagle3.cpp)
    is a Llama layer without per-head q/k norms, reading exactly 3 target layers: DeepSpec's Eagle3 layout (always
    with q/k norms) cannot run there, and renaming it would drop the norms. The export says so, naming the engine and
    the route that does run there: a drafter built without q/k norms, in speculators' layout (`Eagle3Speculator`,
    measured: same text and per-round accepted counts as hf_dspark)."""
    drafter = tiny_drafter(qwen3, "eagle3", qk_norm=True, draft_vocab_size=40)
    drafter.set_draft_vocab(torch.arange(0, 80, 2))
    with caplog.at_level("WARNING", logger="hf_dspark.hub.convert"):
        export_deepspec(drafter, tmp_path / "x", target=qwen3)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "llama.cpp cannot run" in text and "Qwen3Eagle3Model" in text and "q/k norm" in text, text
    assert "qk_norm=False" in text and "--to speculators" in text and "draft-eagle3" in text  # the route that runs
    assert "served by vLLM and llama.cpp" not in text  # the draft-vocabulary note is for drafters they serve
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_dspark.hub.convert"):
        export_deepspec(tiny_drafter(qwen3, "dflash"), tmp_path / "dflash", target=qwen3)
    assert not caplog.records  # DFlash runs in llama.cpp (measured): nothing to warn about


def test_model_card_names_llama_cpps_draft_length_and_what_sglang_cannot_load(qwen3):
    """`--spec-type draft-dspark` alone drafts 3 tokens a round (llama.cpp's default `--spec-draft-n-max`), not the
    block; and SGLang cannot load a draft vocabulary."""
    from hf_dspark.hub.model_card import describe_serving

    full = describe_serving(tiny_drafter(qwen3, "markov", block_size=5).config)
    assert "--spec-type draft-dspark --spec-draft-n-max 5" in full and "SGLang with" in full
    assert "conf-min" not in full
    vocab = describe_serving(tiny_drafter(qwen3, "markov", block_size=5, draft_vocab_size=40).config)
    assert "--spec-draft-n-max 5" in vocab and "SGLang with" not in vocab and "SGLang cannot" in vocab


def test_a_deepspec_w1_with_its_own_row_for_every_token_keeps_them(qwen3, tmp_path):
    """A trained draft-vocabulary checkpoint's W1 differs outside the draft vocabulary: it loads whole
    (`markov_w1_full_vocab`) and exports back bit for bit, greedy output unchanged."""
    drafter = tiny_drafter(qwen3, "markov", draft_vocab_size=40)
    drafter.set_draft_vocab(torch.randperm(qwen3.config.vocab_size, generator=torch.Generator().manual_seed(3))[:40])
    exported = export_deepspec(drafter, tmp_path / "compact", target=qwen3)
    weights = load_file(exported / "model.safetensors")
    weights["markov_head.markov_w1.weight"] = torch.randn_like(weights["markov_head.markov_w1.weight"])
    save_file(weights, exported / "model.safetensors", metadata={"format": "pt"})
    loaded = import_deepspec(exported, target=qwen3)
    assert loaded.config.markov_w1_full_vocab
    again = load_file(export_deepspec(loaded, tmp_path / "again", target=qwen3) / "model.safetensors")
    assert torch.equal(again["markov_head.markov_w1.weight"], weights["markov_head.markov_w1.weight"])
    ids = prompts(1)[0]
    assert torch.equal(qwen3.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=12),
                       qwen3.generate(ids, do_sample=False, max_new_tokens=12))


def _first_new_eos(new: list[int], block_size: int) -> tuple[int, int]:
    """(index, token) of a token first generated at an index that oracle drafting reaches as a draft other than the
    round's last slot (index 0 comes from the prompt's forward, then every round emits block_size drafts + 1)."""
    for index, token in enumerate(new):
        if index >= 2 and token not in new[:index] and (index - 1) % (block_size + 1) < block_size - 1:
            return index, token
    raise AssertionError(f"no usable EOS candidate in {new}")


def test_a_round_stopped_by_eos_counts_only_the_drafts_it_emits(monkeypatch):
    """llama.cpp and hf_dspark produced the same text with drafted counts equal but accepted counts one or two apart:
    in the round that reaches EOS, hf_dspark counted drafts past the EOS (matched, never emitted) as accepted. A
    round emits its accepted drafts plus one target token; with the stop inside the drafts, the EOS is that token
    (as llama.cpp counts it), so tokens = 1 (from the prompt's forward) + sum(accepted + 1) holds to the end."""
    from hf_dspark.generation import batched_speculative_generate
    from hf_dspark.generation.one_prompt.prompt_rows import OnePromptRows
    from batch_helpers import left_pad, use_oracle

    target, block = tiny_target("llama"), 4
    drafter = tiny_drafter(target, "markov", block_size=block)
    prompt = prompts(1)[0]
    reference = target.generate(prompt, do_sample=False, max_new_tokens=40)[0]
    index, eos = _first_new_eos(reference[prompt.shape[1]:].tolist(), block)
    single = OnePromptRows.draft

    def oracle(self, budget, *args):  # the target's own continuation: every draft is accepted
        drafts = single(self, budget, *args)
        start, drafted = self.sequence.shape[1], drafts.tokens.shape[1]
        drafts.tokens[0] = reference[start : start + drafted]
        return drafts

    monkeypatch.setattr(OnePromptRows, "draft", oracle)
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=30, eos_token_id=eos)
    generated = out.shape[1] - prompt.shape[1]
    assert generated == index + 1 and torch.equal(out[0], reference[: out.shape[1]])
    stats = drafter.last_generation_stats
    assert 1 + sum(a + 1 for a in stats.accepted) == generated, stats.accepted
    monkeypatch.setattr(OnePromptRows, "draft", single)
    # The batched engine counts the same way.
    use_oracle(monkeypatch, [reference], block_size=block)
    drafter.generation_config.dspark_round_planning = False  # every round drafts (the oracle's drafts)
    result = batched_speculative_generate(target, drafter, *left_pad([prompt]), max_new_tokens=30,
                                          eos_token_id=eos)
    assert torch.equal(result.sequences[0], out[0])
    rounds = result.stats[0]
    assert 1 + sum(a + 1 for a in rounds.accepted) == generated, rounds.accepted
