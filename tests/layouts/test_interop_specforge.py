"""SpecForge / RadixArk `DSparkDraftModel` drafters, read by `hf_dspark.AutoDrafter`
(`hf_dspark/models/formats/specforge_dspark.py`): checkpoints built, saved and run by SpecForge's own code
(tests/data/specforge_golden/, made by benchmarks/interop/make_specforge_goldens.py with specforge 0.2.0) give the
same per-slot logits and confidences; the SGLang rewrite of an export reads the same; fields and tensors are checked
strictly; decoding is exact. Where `specforge` is importable (an overlay, never this environment), a fresh drafter
built by it is checked too."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_dspark
from factories import tiny_target
from hf_dspark.models.errors import DrafterLoadError
from layout_fixtures import (agreeing_markov_head, assert_batch_greedy_identical, assert_greedy_identical,
                             bigram_target)

GOLDEN = Path(__file__).parents[1] / "data" / "specforge_golden"
VARIANTS = {"vanilla": ("markov", True), "gated": ("gated", False), "rnn": ("rnn", True), "no_markov": (None, True)}


def _compare(drafter, golden: dict) -> None:
    drafter.attach_stored_heads(golden["embed_tokens"], golden["lm_head"])
    with torch.no_grad():
        out = drafter(input_ids=golden["block"], target_hidden_states=golden["features"],
                      previous_token_ids=golden["previous"])
    torch.testing.assert_close(out.base_logits, golden["base_logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits, golden["logits"], atol=1e-5, rtol=0)
    if "confidence_logits" in golden:
        torch.testing.assert_close(out.confidence_logits, golden["confidence_logits"], atol=1e-5, rtol=0)
    else:
        assert out.confidence_logits is None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_per_slot_logits_match_specforge(variant, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dspark.models.formats"):
        drafter = hf_dspark.AutoDrafter.from_pretrained(GOLDEN / variant)
    assert sum("specforge (DSparkDraftModel)" in r.getMessage() for r in caplog.records) == 1
    head, confidence = VARIANTS[variant]
    config = drafter.config
    assert (config.markov_head, config.confidence_head, config.sample_from_anchor, config.block_size) == (
        head, confidence, True, 4)
    assert config.mask_token_id == 5 and config.target_num_hidden_layers == 6
    _compare(drafter, load_file(GOLDEN / variant / "golden.safetensors"))


def test_the_sglang_rewrite_of_an_export_reads_the_same(tmp_path):
    """SpecForge's scripts/gates/normalize_dflash_export.py renames the architecture Qwen3DSparkModel and copies the
    head fields to the top level; the copies must agree with dflash_config."""
    folder = shutil.copytree(GOLDEN / "vanilla", tmp_path / "sglang")
    config = json.loads((folder / "config.json").read_text())
    nested = config["dflash_config"]
    config.update(architectures=["Qwen3DSparkModel"], markov_rank=nested["markov_rank"], markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True)
    config.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(config))
    _compare(hf_dspark.AutoDrafter.from_pretrained(folder), load_file(folder / "golden.safetensors"))
    config["markov_rank"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterLoadError, match="markov_rank=8 and dflash_config.markov_rank=16"):
        hf_dspark.AutoDrafter.from_pretrained(folder)


def _edited(tmp_path, name: str, edit=None, tensors=None) -> Path:
    folder = shutil.copytree(GOLDEN / "vanilla", tmp_path / name)
    (folder / "golden.safetensors").unlink()
    config = json.loads((folder / "config.json").read_text())
    if edit:
        edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors(load_file(folder / "model.safetensors")), str(folder / "model.safetensors"))
    return folder


def test_fields_and_tensors_are_checked_strictly(tmp_path):
    nested = lambda **kv: lambda c: c["dflash_config"].update(kv)  # noqa: E731
    refused = {
        "unknown": (lambda c: c.update(new_field=1), r"\['new_field'\]"),
        "nested_unknown": (nested(conv_kernel_size=3), r"dflash_config field\(s\) \['conv_kernel_size'\]"),
        "domino": (nested(shift_label=True), "shift_label"),
        "prefix": (nested(pure_draft_prefix_len=2), "pure_draft_prefix_len"),
        "mha": (nested(attention_mode="mha"), "attention_mode"),
        "head": (nested(markov_head_type="lstm"), "markov_head_type"),
        "mask": (nested(mask_token_id=None), "mask_token_id"),
        "block": (lambda c: c.pop("block_size"), "block_size"),
        "width": (lambda c: c.update(target_hidden_size=128), "target_hidden_size"),
        "vocab": (lambda c: c.update(draft_vocab_size=64), "draft_vocab_size"),
        "sliding": (lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                       use_sliding_window=True), "layer_types"),
    }
    for name, (edit, problem) in refused.items():
        with pytest.raises(DrafterLoadError, match=problem):
            hf_dspark.AutoDrafter.from_pretrained(_edited(tmp_path, name, edit))
    tensor_refusals = {
        "missing": (lambda t: {k: v for k, v in t.items() if k != "norm.weight"}, "norm.weight"),
        "extra": (lambda t: {**t, "logit_head.prefix_gru.weight": torch.zeros(2, 2)}, "prefix_gru"),
        "twice": (lambda t: {**t, "logit_head.markov_head.markov_w1.weight": t["markov_head.markov_w1.weight"].clone()},
                  "a head twice"),
        "shape": (lambda t: {**t, "confidence_head.proj.weight": torch.zeros(1, 64)}, "confidence_head.proj"),
    }
    for name, (change, problem) in tensor_refusals.items():
        with pytest.raises(DrafterLoadError, match=problem):
            hf_dspark.AutoDrafter.from_pretrained(_edited(tmp_path, f"t_{name}", tensors=change))


def test_early_logit_head_names_load(tmp_path):
    """SpecForge's loader maps early checkpoints' `logit_head.markov_head.*` / `logit_head.confidence_head.*`."""
    def renamed(tensors):
        return {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
                for k, v in tensors.items()}
    folder = _edited(tmp_path, "early", tensors=renamed)
    _compare(hf_dspark.AutoDrafter.from_pretrained(folder), load_file(GOLDEN / "vanilla" / "golden.safetensors"))


def test_decodes_exactly(tmp_path):
    target = tiny_target("qwen3", vocab_size=128, num_hidden_layers=6)
    prompts = [torch.randint(6, 128, (1, 6 + i), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for variant in VARIANTS:
        assert_greedy_identical(target, hf_dspark.AutoDrafter.from_pretrained(GOLDEN / variant), prompts, 12)
    # A SpecForge checkpoint whose Markov head predicts the target's next token: drafts are accepted.
    agreeing = bigram_target(128, 64, 6)
    w1, w2 = agreeing_markov_head(agreeing)

    def with_head(tensors):
        proj = tensors["confidence_head.proj.weight"]
        return {**tensors, "markov_head.markov_w1.weight": w1, "markov_head.markov_w2.weight": w2,
                "confidence_head.proj.weight": torch.cat([proj[:, :64], proj.new_zeros(1, 128)], dim=1)}
    folder = _edited(tmp_path, "agreeing", lambda c: c["dflash_config"].update(markov_rank=128), with_head)
    drafter = hf_dspark.AutoDrafter.from_pretrained(folder)
    assert assert_greedy_identical(agreeing, drafter, prompts, 16) > 0
    assert_batch_greedy_identical(agreeing, drafter, 128)


def test_a_drafter_fresh_from_specforges_own_code(tmp_path):
    pytest.importorskip("specforge.modeling.draft.dspark", reason="specforge is installed only in an overlay")
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "interop"))
    import make_specforge_goldens as maker

    generator = torch.Generator().manual_seed(9)
    target = maker.tiny_target(generator)
    model = maker.build_and_save("rnn", tmp_path / "fresh", generator)
    _compare(hf_dspark.AutoDrafter.from_pretrained(tmp_path / "fresh"), maker.golden(model, target, generator))
