"""Parity with `vllm-project/speculators` 0.9.0's own code (installed from PyPI with --no-deps beside transformers
5.24, see scripts/setup.sh): its DSpark, DFlash and Eagle3 speculators, built and saved by its classes, load into
hf_dspark with per-slot draft logits equal to its own forward's; ours, exported, load in its `from_pretrained` with
nothing missing and the same logits; round trips are exact; loaded drafters keep greedy output identical."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_dspark
from hf_dspark.hub.export_speculators import export_speculators
from hf_dspark.models.errors import DrafterLoadError, UserInputError
from hf_dspark.models.layers import DraftContextCache
from hf_dspark.models.formats import speculators as layout
from factories import prompts, tiny_drafter, tiny_target

# Their models still pass `past_key_values`, which transformers 5.24+ deprecates (pyproject.toml makes the warning an
# error for hf_dspark's own code).
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

try:
    import speculators
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    import speculators.models.eagle3.core as eagle3_core
    from speculators.proposals.greedy import GreedyTokenProposalConfig
except ImportError as error:  # not skipped: the parity checks are part of the test command
    raise ImportError(
        f"{error}. These tests run speculators 0.9.0's own code: install it as scripts/setup.sh does, "
        "`pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0` and "
        "`pip install 'datasets==5.1.0' 'openai>=2.0.0' 'loguru>=0.7.2,<=0.7.3'` (what it imports).") from error

VOCAB, HIDDEN, BLOCK, DRAFT_VOCAB = 96, 64, 4, 40
AUX_IDS = [1, 2]  # speculators' hidden_states indices = our target layers 0 and 1 of the 4-layer tiny targets


def layer_config(model_type="qwen3", layers=2):
    cls = Qwen3Config if model_type == "qwen3" else LlamaConfig
    config = cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    config._attn_implementation = "eager"  # their default, flex attention, compiles its masks (GPU-oriented)
    return config


def proposal(kind, tokens, verifier=None):
    return speculators.SpeculatorsConfig(
        algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
        default_proposal_method="greedy", verifier=speculators.VerifierConfig(name_or_path=verifier, architectures=[]))


def draft_ids(seed=5):
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values


def their_drafter(kind, target, *, draft=False, model_type="qwen3", layers=2, seed=0, distinct_outside=False,
                  **fields):
    """A speculators drafter made by its own classes, random weights, the target's embedding and LM head. With a
    draft vocabulary, W1's rows outside it are one shared row unless `distinct_outside` (trained checkpoints)."""
    draft_size = DRAFT_VOCAB if draft else VOCAB
    if kind == "eagle3":
        config = speculators.Eagle3SpeculatorConfig(
            transformer_layer_config=layer_config(model_type, layers), draft_vocab_size=draft_size,
            eagle_aux_hidden_state_layer_ids=[1, 2, 3], speculators_config=proposal(kind, 3), **fields)
        model_class = speculators.Eagle3DraftModel
    else:
        config_class = speculators.DSparkSpeculatorConfig if kind == "dspark" else speculators.DFlashSpeculatorConfig
        if kind == "dspark":
            fields = {"markov_rank": 8, **fields}
        config = config_class(transformer_layer_config=layer_config(layers=layers), draft_vocab_size=draft_size,
                              block_size=BLOCK, aux_hidden_state_layer_ids=AUX_IDS, mask_token_id=3,
                              speculators_config=proposal(kind, BLOCK), **fields)
        model_class = speculators.DSparkDraftModel if kind == "dspark" else speculators.DFlashDraftModel
    torch.manual_seed(seed)
    model = model_class(config).eval()
    ids = draft_ids()
    if draft:
        mask = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
        model.load_vocab_mappings(mask, ids - torch.arange(DRAFT_VOCAB))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.3 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.lm_head.weight[ids] if draft else target.lm_head.weight)
        markov = getattr(model, "markov_head", None)
        if markov is not None and draft and not distinct_outside:  # one row shared outside the draft vocabulary
            outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, ids, False)
            markov.markov_w1.weight[outside] = markov.markov_w1.weight[outside][0]
    return model


def capture_metrics(monkeypatch, module):
    """Record the logits (and confidence logits) their forward hands to its loss, per call."""
    calls = []

    def record(logits, targets, *args, **kwargs):
        confidence = args[0] if module is dspark_core else None
        calls.append((logits.detach().clone(), None if confidence is None else confidence.detach().clone()))
        return torch.zeros(()), {}

    monkeypatch.setattr(module, "compute_metrics", record)
    return calls


def context(layers, seed=1, length=14):
    """Token ids and the target features of `layers` layers, concatenated, for every position."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (1, length), generator=generator)
    return ids, torch.randn(1, length, layers * HIDDEN, generator=generator)


def their_block_logits(monkeypatch, model, ids, features, anchors):
    module = dspark_core if isinstance(model, speculators.DSparkDraftModel) else dflash_core
    calls = capture_metrics(monkeypatch, module)
    length = ids.shape[1]
    loss_mask = torch.zeros(1, length).index_fill_(1, torch.tensor(anchors), 1.0)
    with torch.no_grad():  # one valid position per anchor: their anchor sampling picks exactly these, sorted
        model(hidden_states=features, input_ids=ids, loss_mask=loss_mask, max_anchors=len(anchors),
              verifier_last_hidden_states=torch.zeros(1, length, HIDDEN),
              document_ids=torch.zeros(1, length, dtype=torch.long))
    logits, confidence = calls[-1]
    blocks = logits.view(len(anchors), BLOCK, -1)
    return blocks, None if confidence is None else confidence.view(len(anchors), BLOCK)


def our_block_logits(drafter, ids, features, anchor):
    """Our drafter's teacher-forced logits for the block at `anchor` (context: the rows before it)."""
    config = drafter.config
    block = torch.full((1, BLOCK), config.mask_token_id)
    block[0, 0] = ids[0, anchor]
    if config.sample_from_anchor:
        previous = ids[:, anchor : anchor + BLOCK]
    else:
        previous = torch.cat([ids[:, anchor : anchor + 1], ids[:, anchor : anchor + BLOCK - 1]], dim=1)
    with torch.no_grad():
        out = drafter(input_ids=block, target_hidden_states=features[:, :anchor], previous_token_ids=previous)
    return out.logits[0], None if out.confidence_logits is None else out.confidence_logits[0]


def assert_same_block_logits(monkeypatch, theirs, ours):
    ids, features = context(len(ours.config.target_layer_ids))
    anchors = [3, 8]
    their_logits, their_confidence = their_block_logits(monkeypatch, theirs, ids, features, anchors)
    first = ours.config.first_draft_slot
    for index, anchor in enumerate(anchors):
        logits, confidence = our_block_logits(ours, ids, features, anchor)
        torch.testing.assert_close(logits[first:], their_logits[index, first:], rtol=0, atol=1e-5)
        assert (confidence is None) == (their_confidence is None)
        if confidence is not None:
            torch.testing.assert_close(confidence[first:], their_confidence[index, first:], rtol=0, atol=1e-5)


def their_eagle3_logits(monkeypatch, model, ids, features, steps=3):
    calls = capture_metrics(monkeypatch, eagle3_core)
    length = ids.shape[1]
    with torch.no_grad():  # their training layout: row t reads g_t and x_{t+1}, at position t + 1
        model(hidden_states=features, input_ids=ids, document_ids=torch.zeros(1, length, dtype=torch.long),
              loss_mask=torch.ones(1, length), verifier_last_hidden_states=torch.zeros(1, length, HIDDEN),
              ttt_steps=steps)
    return [logits[0] for logits, _ in calls]


def assert_same_eagle3_logits(monkeypatch, theirs, ours, steps=3):
    # Their chain runs as one training-layout pass, ours step by step on a cache: the matmuls have other shapes, and
    # with several threads their blocking rounds differently, up to 3e-5 after three chained steps. One thread
    # compares the two computations, not two thread schedules.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _assert_same_eagle3_logits(monkeypatch, theirs, ours, steps)
    finally:
        torch.set_num_threads(threads)


def _assert_same_eagle3_logits(monkeypatch, theirs, ours, steps):
    ids, features = context(len(ours.config.target_layer_ids))
    their_steps = their_eagle3_logits(monkeypatch, theirs, ids, features, steps)
    positions = torch.arange(1, ids.shape[1] + 1)[None]
    with torch.no_grad():
        step0 = ours(input_ids=ids, target_hidden_states=features, position_ids=positions).logits[0]
        torch.testing.assert_close(step0, their_steps[0], rtol=1e-5, atol=1e-5)
        for row in (0, 5, ids.shape[1] - steps):  # a chain drafted on the drafter's own states, as in generation
            cache = DraftContextCache()
            out = ours(input_ids=ids[:, : row + 1], target_hidden_states=features[:, : row + 1],
                       position_ids=positions[:, : row + 1], cache=cache)
            for step in range(1, steps):
                out = ours(input_ids=ids[:, row + step : row + step + 1], hidden_states=out.hidden_states[:, -1:],
                           position_ids=torch.tensor([[row + 1 + step]]), cache=cache)
                # Each step feeds its own state to the next: float32 rounding (which depends on the thread count)
                # compounds along the chain, so chained steps get twice step 0's tolerance.
                torch.testing.assert_close(out.logits[0, -1], their_steps[step][row], rtol=1e-5, atol=2e-5)


def assert_same_logits(monkeypatch, theirs, ours):
    if isinstance(theirs, speculators.Eagle3DraftModel):
        assert_same_eagle3_logits(monkeypatch, theirs, ours)
    else:
        assert_same_block_logits(monkeypatch, theirs, ours)


def load_ours(folder):
    return layout.load(folder, json.loads((folder / "config.json").read_text()))


def saved_target(tmp_path, family="qwen3"):
    """A tiny target saved to a folder and loaded back, so that exports can name it as their verifier."""
    folder = tmp_path / f"target-{family}"
    tiny_target(family).save_pretrained(folder)
    return (Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM).from_pretrained(folder).eval()


THEIR_CASES = {
    "dspark-vanilla": ("dspark", {"markov_head_type": "vanilla"}),
    "dspark-gated-draft-vocab-slot0-unused": ("dspark", {"markov_head_type": "gated", "draft": True,
                                                         "sample_from_anchor": False}),
    "dspark-rnn": ("dspark", {"markov_head_type": "rnn"}),
    # A trained W1 has its own row for every token, inside the draft vocabulary or not: kept whole.
    "dspark-draft-vocab-distinct-rows": ("dspark", {"draft": True, "distinct_outside": True}),
    "dspark-confidence-without-markov-input": ("dspark", {"confidence_head_with_markov": False,
                                                          "sample_from_anchor": False}),
    "dspark-confidence-only": ("dspark", {"markov_rank": 0, "confidence_head_with_markov": False}),
    "dflash": ("dflash", {}),
    "dflash-draft-vocab-from-anchor": ("dflash", {"draft": True, "sample_from_anchor": True}),
    "eagle3-llama": ("eagle3", {"model_type": "llama"}),
    "eagle3-qwen3-draft-vocab-two-layers": ("eagle3", {"model_type": "qwen3", "draft": True, "layers": 2}),
}


@pytest.mark.parametrize("case", THEIR_CASES)
def test_their_drafters_load_with_their_per_slot_logits(monkeypatch, tmp_path, case):
    kind, fields = THEIR_CASES[case]
    target = tiny_target("qwen3")
    theirs = their_drafter(kind, target, **fields)
    theirs.save_pretrained(tmp_path / "theirs")
    config = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert layout.matches(config) and not layout.matches(tiny_drafter(target, "markov").config.to_dict())
    ours = load_ours(tmp_path / "theirs")
    assert ours.training is False and next(ours.parameters()).dtype == torch.float32
    if kind == "eagle3":
        assert ours.config.block_size == 3  # their speculative_tokens
    else:
        assert ours.config.sample_from_anchor == theirs.config.sample_from_anchor
        ours.attach_target(target)  # their block checkpoints store no embedding: the target's is shared
    assert ours.config.target_layer_ids == [i - 1 for i in (theirs.target_layer_ids)]
    assert_same_logits(monkeypatch, theirs, ours)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_loaded_speculators_drafters_keep_greedy_output_identical(tmp_path, kind):
    target = tiny_target("qwen3")
    their_drafter(kind, target, draft=kind == "eagle3").save_pretrained(tmp_path / "theirs")
    drafter = hf_dspark.AutoDrafter.from_pretrained(tmp_path / "theirs")
    for ids in prompts(2):
        expected = target.generate(ids, do_sample=False, max_new_tokens=16)
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16),
                           expected)


def our_drafter(target, kind, **overrides):
    if kind == "eagle3":
        drafter = tiny_drafter(target, "eagle3", block_size=3, **overrides)
    else:
        drafter = tiny_drafter(target, kind, block_size=BLOCK, **overrides)
    with torch.no_grad():  # norms away from 1 so that a swapped norm would show
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    if drafter.draft_to_target is not None:
        drafter.set_draft_vocab(draft_ids(seed=9))
    return drafter.eval()


OUR_CASES = {
    "dspark-markov-draft-vocab": ("qwen3", "markov", {"draft_vocab_size": DRAFT_VOCAB, "target_layer_ids": [0, 1]}),
    "dspark-gated-slot0-unused": ("qwen3", "gated", {"sample_from_anchor": False, "target_layer_ids": [0, 2]}),
    "dspark-rnn": ("qwen3", "rnn", {}),
    "dflash": ("qwen3", "dflash", {"sample_from_anchor": False, "target_layer_ids": [0, 1]}),
    "eagle3-qwen3": ("qwen3", "eagle3", {}),
    "eagle3-llama-draft-vocab": ("llama", "eagle3", {"draft_vocab_size": DRAFT_VOCAB}),
}


def their_load(folder):
    """speculators' own from_pretrained of `folder` (eager attention; the verifier it names gives the heads)."""
    config = speculators.SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    model = speculators.SpeculatorModel.from_pretrained(folder, config=config)
    if config.speculators_model_type == "eagle3":  # its Eagle3 override cannot return the loading info
        return model, None
    # Asked for the loading info, it skips loading the verifier's embedding: a second call only for the info.
    _, info = speculators.SpeculatorModel.from_pretrained(folder, config=config, output_loading_info=True)
    return model, info


@pytest.mark.parametrize("case", OUR_CASES)
def test_our_export_loads_in_speculators_with_nothing_missing_and_the_same_logits(monkeypatch, tmp_path, case):
    family, kind, overrides = OUR_CASES[case]
    target = saved_target(tmp_path, family)
    ours = our_drafter(target, kind, **overrides)
    export_speculators(ours, tmp_path / "exported", target=target)
    theirs, info = their_load(tmp_path / "exported")
    assert type(theirs).__name__ == {"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel"}.get(
        kind, "DSparkDraftModel")
    if info is not None:
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.save_pretrained(tmp_path / "resaved")  # what their save writes = what we wrote, tensor for tensor
    written, resaved = load_file(tmp_path / "exported" / "model.safetensors"), load_file(
        tmp_path / "resaved" / "model.safetensors")
    assert written.keys() == resaved.keys()
    assert all(torch.equal(written[name], resaved[name]) for name in written)
    ours.attach_target(target)
    assert_same_logits(monkeypatch, theirs.eval(), ours)


@pytest.mark.parametrize("case", OUR_CASES)
def test_round_trip_through_speculators_layout_is_bit_identical(tmp_path, case):
    family, kind, overrides = OUR_CASES[case]
    target = tiny_target(family)
    ours = our_drafter(target, kind, **overrides)
    back = load_ours(export_speculators(ours, tmp_path / "exported", target=target))
    assert type(back) is type(ours)
    mine, theirs = ours.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in mine)
    for name in ("block_size", "sample_from_anchor", "markov_head", "markov_rank", "confidence_head", "qk_norm",
                 "target_layer_ids", "mask_token_id", "rope_parameters", "draft_vocab_size", "head_dim"):
        assert getattr(back.config, name, None) == getattr(ours.config, name, None), name
    ours.attach_target(target)
    back.attach_target(target)
    ids, features = context(len(ours.config.target_layer_ids))
    with torch.no_grad():
        if kind == "eagle3":
            pairs = [(d(input_ids=ids, target_hidden_states=features).logits, None) for d in (ours, back)]
        else:
            pairs = [our_block_logits(d, ids, features, anchor=6) for d in (ours, back)]
    assert all(a is b or torch.equal(a, b) for a, b in zip(*pairs))


@pytest.mark.parametrize("case", ["dspark-gated-draft-vocab-slot0-unused", "eagle3-qwen3-draft-vocab-two-layers",
                                  "dspark-draft-vocab-distinct-rows"])
def test_round_trip_from_speculators_writes_their_checkpoint_back(tmp_path, case):
    kind, fields = THEIR_CASES[case]
    target = tiny_target("qwen3")
    their_drafter(kind, target, **fields).save_pretrained(tmp_path / "theirs")
    ours = load_ours(tmp_path / "theirs")
    export_speculators(ours, tmp_path / "again", target=None if kind == "eagle3" else target)  # Eagle3: stored heads
    original, again = (load_file(tmp_path / name / "model.safetensors") for name in ("theirs", "again"))
    assert original.keys() == again.keys()
    assert all(torch.equal(original[name], again[name]) for name in original)


def test_unsorted_draft_vocabulary_and_target_layers_export_ascending_with_the_same_drafts(tmp_path):
    """speculators builds d2t ascending and vLLM concatenates target layers in layer order: an hf_dspark drafter
    with either unsorted is written permuted (LM-head rows, W2 rows, fc column blocks) and drafts the same."""
    target = tiny_target("qwen3")
    ours = our_drafter(target, "gated", draft_vocab_size=DRAFT_VOCAB, target_layer_ids=[2, 0])
    ours.set_draft_vocab(draft_ids(seed=9)[torch.randperm(DRAFT_VOCAB, generator=torch.Generator().manual_seed(0))])
    back = load_ours(export_speculators(ours, tmp_path / "exported", target=target))
    assert torch.equal(back.draft_to_target, ours.draft_to_target.sort().values)
    assert back.config.target_layer_ids == [0, 2]
    back.attach_target(target)
    ours.attach_target(target)
    ids, features = context(2)
    swapped = torch.cat([features[..., HIDDEN:], features[..., :HIDDEN]], dim=-1)  # layer 0's rows first
    for anchor in (3, 8):
        mine = ours.to_target_vocab(our_block_logits(ours, ids, features, anchor)[0])
        again = back.to_target_vocab(our_block_logits(back, ids, swapped, anchor)[0])
        torch.testing.assert_close(again, mine, rtol=0, atol=1e-5)


def saved_dspark(tmp_path, **fields):
    their_drafter("dspark", tiny_target("qwen3"), **fields).save_pretrained(tmp_path / "theirs")
    return tmp_path / "theirs", json.loads((tmp_path / "theirs" / "config.json").read_text())


@pytest.mark.parametrize("change, named", [
    # DFlash 2 loads (tests/layouts/test_interop_speculators_dflash2.py), but has no DSpark head to read these into
    (lambda c: c.update(speculators_model_type="dflash2"), "'markov_rank'"),
    (lambda c: c.update(markov_head_type="rnn", sample_from_anchor=False), "slot 0"),
    (lambda c: c.update(some_new_field=1), "some_new_field"),
    (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"],
                                                    sliding_window=8, use_sliding_window=True), "layer_types"),
    (lambda c: c["transformer_layer_config"].update(mystery=True), "mystery"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[2, 1]), "aux_hidden_state_layer_ids"),
    (lambda c: c.pop("mask_token_id"), "mask_token_id"),
])
def test_what_hf_dspark_does_not_compute_is_refused_naming_the_field(tmp_path, change, named):
    folder, config = saved_dspark(tmp_path)
    change(config)
    with pytest.raises(DrafterLoadError, match=named):
        layout.load(folder, config)


def test_eagle3_options_we_do_not_compute_are_refused(tmp_path):
    their_drafter("eagle3", tiny_target("qwen3"), norm_before_residual=True).save_pretrained(tmp_path / "e")
    with pytest.raises(DrafterLoadError, match="norm_before_residual"):
        load_ours(tmp_path / "e")


def test_a_markov_head_with_distinct_rows_outside_the_draft_vocabulary_keeps_them(tmp_path):
    folder, config = saved_dspark(tmp_path, draft=True, distinct_outside=True)
    ours = layout.load(folder, config)
    assert ours.config.markov_w1_full_vocab and ours.sequential_head.token_embedding.weight.shape[0] == VOCAB
    stored = load_file(folder / "model.safetensors")["markov_head.markov_w1.weight"]
    assert torch.equal(ours.sequential_head.token_embedding.weight, stored)
    assert not layout.load(*saved_dspark(tmp_path / "shared", draft=True)).config.markov_w1_full_vocab


def test_export_refuses_what_speculators_cannot_hold(tmp_path):
    llama = tiny_target("llama")
    with pytest.raises(UserInputError, match="qk_norm"):
        export_speculators(tiny_drafter(llama, "markov"), tmp_path / "a")
    with pytest.raises(UserInputError, match="pass target="):
        export_speculators(tiny_drafter(tiny_target("qwen3"), "markov", draft_vocab_size=DRAFT_VOCAB), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
