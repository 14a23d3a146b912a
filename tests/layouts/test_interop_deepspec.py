"""DeepSpec's layout (hf_dspark.models.formats.deepspec) against DeepSpec's own code: the golden checkpoints in
tests/data/deepspec_golden/ were built, saved and run by DeepSpec (see its README.md); loaded here with no target,
our drafters must give DeepSpec's per-slot logits for the same inputs, and generate losslessly once attached."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, Qwen3Model

import hf_dspark
from hf_dspark.generation.round.drafting import draft_block
from hf_dspark.generation.round.sampling import ProcessorSampling
from hf_dspark.hub.convert import export_deepspec
from hf_dspark.models.errors import DrafterLoadError, DrafterTargetMismatchError, UserInputError
from hf_dspark.models.layers import DraftContextCache
from hf_dspark.models.formats import deepspec
from factories import prompts, tiny_drafter, tiny_target

GOLDEN = Path(__file__).parents[1] / "data" / "deepspec_golden"
BLOCK_VARIANTS = ["dspark_vanilla", "dspark_gated", "dspark_rnn", "dflash"]
TOLERANCE = dict(rtol=0, atol=1e-5)


def load_golden(name: str):
    config = json.loads((GOLDEN / name / "config.json").read_text())
    assert deepspec.matches(config)
    return deepspec.load(GOLDEN / name, config), load_file(GOLDEN / name / "golden.safetensors")


def golden_target(seed: int = 0):
    """A tiny Qwen3 of the goldens' shapes (hidden 64, 6 layers, vocab 128, head_dim 16); its own random weights."""
    return tiny_target("qwen3", vocab_size=128, seed=seed, num_hidden_layers=6, intermediate_size=96)


def our_features(drafter, golden, start: int, stop: int) -> torch.Tensor:
    """The context rows as hf_dspark builds them from the target's hidden states (`target_hidden_state_indices`)."""
    states = golden["target_hidden_states"]
    return torch.cat([states[i, start:stop] for i in drafter.target_hidden_state_indices], dim=-1)[None]


class RecordingGreedy(ProcessorSampling):
    """Greedy choice, keeping every slot's logits as the drafting core hands them over."""

    def __init__(self):
        super().__init__(None, do_sample=False)
        self.logits = []

    def process(self, logits, drafted):
        self.logits.append(logits)
        return super().process(logits, drafted)


@pytest.mark.parametrize("name", BLOCK_VARIANTS)
def test_block_drafter_slot_logits_equal_deepspecs(name):
    drafter, golden = load_golden(name)
    assert drafter.config.sample_from_anchor and drafter.config.confidence_threshold_rule == "per_slot"
    cache, context_rows = DraftContextCache(), 0
    prompt = golden["round1_context"].shape[1]
    bounds = {1: (0, prompt), 2: (prompt, prompt + golden["round2_context"].shape[1])}
    with torch.no_grad():
        for round_ in (1, 2):
            key = f"round{round_}_"
            features = our_features(drafter, golden, *bounds[round_])
            torch.testing.assert_close(features, golden[key + "context"], rtol=0, atol=0)  # -1 = hidden_states[0]
            block = golden[key + "block"]
            # DeepSpec's positions are what our forward defaults to: context rows after the cached ones, then the block.
            expected_positions = torch.arange(context_rows, context_rows + features.shape[1] + block.shape[1])
            assert torch.equal(golden[key + "position_ids"][0], expected_positions)
            out = drafter(input_ids=block, target_hidden_states=features, cache=cache)  # as DSparkCandidateGenerator
            context_rows += features.shape[1]
            torch.testing.assert_close(out.base_logits, golden[key + "base_logits"], **TOLERANCE)
            sampling = RecordingGreedy()
            tokens, _, confidences = draft_block(drafter, out, block[:, 0], drafter.config.num_draft_slots, sampling)
            torch.testing.assert_close(torch.stack(sampling.logits, dim=1), golden[key + "logits"], **TOLERANCE)
            assert torch.equal(tokens, golden[key + "tokens"])
            if key + "confidence_logits" in golden:
                torch.testing.assert_close(confidences, golden[key + "confidence_logits"].sigmoid(), **TOLERANCE)
            else:
                assert confidences is None


def test_eagle3_chain_logits_equal_deepspecs():
    drafter, golden = load_golden("eagle3")
    assert isinstance(drafter, hf_dspark.Eagle3DraftModel) and drafter.config.block_size == 4
    cache, prompt = DraftContextCache(), golden["round1_context"].shape[1]
    bounds = {1: (0, prompt), 2: (prompt, prompt + golden["round2_context"].shape[1])}
    with torch.no_grad():
        for round_ in (1, 2):
            key = f"round{round_}_"
            features = our_features(drafter, golden, *bounds[round_])
            torch.testing.assert_close(features, golden[key + "context"], rtol=0, atol=0)
            assert cache.get_seq_length() == int(golden[key + "cache_length"])
            # As Eagle3CandidateGenerator: context rows (feature at t, token at t + 1), then one step per draft.
            out = drafter(input_ids=golden[key + "input_ids"], target_hidden_states=features, cache=cache)
            context_length = cache.get_seq_length()
            logits, state, tokens = [out.logits[:, -1]], out.hidden_states[:, -1:], []
            for step in range(drafter.config.block_size):
                tokens.append(logits[-1].argmax(dim=-1))
                if step + 1 < drafter.config.block_size:
                    out = drafter(input_ids=tokens[-1][:, None], hidden_states=state, cache=cache)
                    logits.append(out.logits[:, -1])
                    state = out.hidden_states
            cache.crop(context_length)
            torch.testing.assert_close(torch.stack(logits, dim=1), golden[key + "logits"], **TOLERANCE)
            assert torch.equal(torch.stack(tokens, dim=1), golden[key + "tokens"])


@pytest.mark.parametrize("name", [*BLOCK_VARIANTS, "eagle3"])
def test_generation_with_a_loaded_checkpoint_is_lossless_and_uses_the_targets_heads(name):
    drafter, _ = load_golden(name)
    target = golden_target()
    stored_head = drafter.target_heads.lm_head
    for prompt in prompts(2, vocab_size=128):
        plain = target.generate(prompt, max_new_tokens=10, do_sample=False)
        speculative = target.generate(prompt, assistant_model=drafter, max_new_tokens=10, do_sample=False)
        assert torch.equal(plain, speculative)
    # generate() attached the target: its embedding and LM head replace the checkpoint's stored copies.
    assert drafter.target_heads.lm_head is target.get_output_embeddings()
    assert drafter.target_heads.embed_tokens is target.get_input_embeddings()
    hidden = torch.randn(1, 3, 64)
    torch.testing.assert_close(drafter.compute_logits(hidden), target.lm_head(hidden))
    assert not torch.allclose(stored_head(hidden), target.lm_head(hidden))


@pytest.mark.parametrize("name", ["dspark_rnn", "eagle3"])
def test_autodrafter_loads_deepspec_folders_through_this_reader(name):
    drafter, _ = load_golden(name)
    auto = hf_dspark.AutoDrafter.from_pretrained(GOLDEN / name)
    assert type(auto) is type(drafter) and auto.config.to_dict() == drafter.config.to_dict()
    assert all(torch.equal(auto.state_dict()[key], value) for key, value in drafter.state_dict().items())
    assert torch.equal(auto.target_heads.lm_head.weight, drafter.target_heads.lm_head.weight)


def test_automodel_reads_a_deepspec_folder_as_a_plain_qwen3_model():
    """What the issue reports: config.json says `model_type: qwen3`, so AutoModel builds the target's backbone class
    and drops the drafter's own tensors (fc, Markov and confidence heads) as unexpected."""
    model = AutoModel.from_pretrained(GOLDEN / "dspark_vanilla")
    assert type(model) is Qwen3Model and not isinstance(model, hf_dspark.DraftPreTrainedModel)
    assert not hasattr(model, "fc") and not any("markov" in name for name in model.state_dict())


def test_stored_heads_are_checked_against_a_target():
    drafter, _ = load_golden("dspark_vanilla")
    other = golden_target()
    with pytest.raises(DrafterTargetMismatchError, match="stored embed_tokens is not the target's"):
        deepspec.check_stored_heads_match(drafter, other, "dspark_vanilla")
    same = golden_target()
    with torch.no_grad():
        same.get_input_embeddings().weight.copy_(drafter.target_heads.embed_tokens.weight)
        same.get_output_embeddings().weight.copy_(drafter.target_heads.lm_head.weight)
    deepspec.check_stored_heads_match(drafter, same, "dspark_vanilla")
    drafter.attach_target(same)
    assert drafter.target_heads.lm_head is same.get_output_embeddings()


def copy_golden(name: str, folder: Path, config_changes: dict | None = None, weights=None) -> Path:
    shutil.copytree(GOLDEN / name, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes or {})
    (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights(load_file(folder / "model.safetensors")), str(folder / "model.safetensors"))
    return folder


def load_folder(folder: Path):
    return deepspec.load(folder, json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize("changes", [{"sample_from_anchor": False}, {"dspark_bonus_anchor": True}])
def test_slot_j_predicts_anchor_plus_j_loads_in_that_convention(tmp_path, changes):
    drafter = load_folder(copy_golden("dspark_vanilla", tmp_path / "c", changes))
    assert drafter.config.sample_from_anchor is False and drafter.config.num_draft_slots == 3
    with pytest.raises(DrafterLoadError, match="contradict"):
        load_folder(copy_golden("dspark_vanilla", tmp_path / "both", {"sample_from_anchor": True,
                                                                      "dspark_bonus_anchor": True}))


def test_a_bfloat16_checkpoint_keeps_its_dtype(tmp_path):
    folder = copy_golden("dspark_gated", tmp_path / "bf16",
                         weights=lambda w: {k: v.to(torch.bfloat16) for k, v in w.items()})
    drafter = load_folder(folder)
    assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}
    assert drafter.target_heads.lm_head.weight.dtype == torch.bfloat16


REFUSALS = [
    # A Qwen3 checkpoint relabelled as DeepSpec's Gemma 4 class (those load: test_interop_deepspec_gemma4.py)
    ("dspark_vanilla", {"architectures": ["Gemma4DSparkModel"]}, None, "lacks \\['global_head_dim'"),
    ("eagle3", {"architectures": ["Gemma4Eagle3Model"]}, None, "lacks \\['global_head_dim'"),
    ("dspark_vanilla", {"attention_sink_bias": True}, None, "attention_sink_bias"),
    ("dspark_vanilla", {"markov_head_type": "lstm"}, None, "markov_head_type='lstm'"),
    ("dspark_vanilla", {"use_sliding_window": True}, None, "use_sliding_window"),
    ("dspark_vanilla", {"sample_from_anchor": "maybe"}, None, "sample_from_anchor='maybe'"),
    ("eagle3", {"num_hidden_layers": 2, "draft_num_hidden_layers": 2}, None, "num_hidden_layers=2"),
    ("dflash", {"confidence_head_with_markov": True, "enable_confidence_head": True}, None,
     "confidence_head_with_markov"),
    ("dspark_vanilla", {"target_layer_ids": [0, 1]}, None, "fc.weight.*target_layer_ids"),
    ("dspark_vanilla", {}, lambda w: {**w, "extra.weight": torch.zeros(2)}, "unexpected \\['extra.weight'\\]"),
    ("dspark_vanilla", {}, lambda w: {k: v for k, v in w.items() if k != "markov_head.markov_w2.weight"},
     "missing \\['markov_head.markov_w2.weight'\\]"),
    ("dspark_vanilla", {}, lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"}, "lm_head.weight"),
    ("dspark_vanilla", {}, lambda w: {**w, "fc.weight": w["fc.weight"].to(torch.int8)}, "fc.weight \\(torch.int8\\)"),
]


@pytest.mark.parametrize("name,changes,weights,message", REFUSALS)
def test_unsupported_or_inconsistent_checkpoints_are_refused_naming_the_field(tmp_path, name, changes, weights,
                                                                            message):
    folder = copy_golden(name, tmp_path / "c", changes, weights)
    with pytest.raises(DrafterLoadError, match=message):
        load_folder(folder)


def test_pickled_weights_are_never_read(tmp_path, monkeypatch):
    folder = copy_golden("dflash", tmp_path / "c")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("a pickle was read"))
    with pytest.raises(UserInputError, match="no model.safetensors"):
        load_folder(folder)


EXPORTS = [("qwen3", "markov", {"draft_vocab_size": 40}, True), ("qwen3", "dflash", {}, True),
           ("qwen3", "gated", {}, False), ("qwen3", "eagle3", {}, True), ("gemma3", "markov", {}, True)]


@pytest.mark.parametrize("family,kind,options,with_target", EXPORTS)
def test_hf_dspark_exports_load_back_with_identical_logits(tmp_path, family, kind, options, with_target):
    """`hf-dspark convert` writes this layout (draft vocabulary as d2t/t2d, DFlash as a zero rank-1 head; without a
    target no heads are stored). A Gemma target's embedding scales by sqrt(hidden_size), so a plain lookup of the
    stored copy would be wrong: those drafters wait for their target instead of running on the stored copies."""
    target = tiny_target(family)
    drafter = tiny_drafter(target, kind, **options)
    if options.get("draft_vocab_size"):
        drafter.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(1))[:40])
    loaded = load_folder(export_deepspec(drafter, tmp_path / kind, target=target if with_target else None))
    assert (loaded._target_heads is not None) == (with_target and family == "qwen3")
    drafter.attach_target(target)
    if loaded._target_heads is None:
        loaded.attach_target(target)
    features = torch.randn(1, 5, len(drafter.config.target_layer_ids) * 64)
    ids = torch.randint(0, 96, (1, 5 if kind == "eagle3" else drafter.config.block_size))
    with torch.no_grad():
        ours, theirs = drafter(input_ids=ids, target_hidden_states=features), loaded(input_ids=ids,
                                                                                    target_hidden_states=features)
    torch.testing.assert_close(theirs.logits, ours.logits, **TOLERANCE)
