"""speculators 0.9.0's DFlash 2 (`speculators_model_type: "dflash2"`, built and saved by its own classes) loads through
`hf_dspark.AutoDrafter` as a `DFlash2DraftModel`: per slot, the same backbone logits and the same selector scores of
the candidates as its own training forward computes, and greedy output identical to plain decoding. Ours, exported,
loads in speculators' own `from_pretrained` with nothing missing and the same scores; round trips are exact."""

import json

import pytest
import torch
import speculators
import speculators.models.dflash2.core as dflash2_core
from safetensors.torch import load_file

import hf_dspark
from factories import prompts, tiny_drafter, tiny_target
from hf_dspark.hub.export_speculators import export_speculators
from hf_dspark.models.errors import UserInputError
from test_interop_speculators import (AUX_IDS, BLOCK, HIDDEN, VOCAB, context, layer_config, proposal, saved_target,
                                      their_load)

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

SELECTOR = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


def their_dflash2(target, seed=0, **fields):
    """speculators' DFlash2DraftModel with random weights (its init makes the convolutions identities, which would
    hide a misplaced one) and the target's embedding and LM head."""
    config = speculators.DFlash2SpeculatorConfig(
        transformer_layer_config=layer_config(), draft_vocab_size=VOCAB, block_size=BLOCK,
        aux_hidden_state_layer_ids=AUX_IDS, mask_token_id=3, speculators_config=proposal("dflash2", BLOCK),
        **{**SELECTOR, **fields})
    torch.manual_seed(seed)
    model = speculators.DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.3 * torch.randn_like(param) if "norm" in name or "base_kernel" in name
                        else 0.3 * torch.randn_like(param))
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    return model


def their_scores(monkeypatch, model, ids, features, anchors):
    """(unary logits, candidate ids, their selector scores) of each anchor's block, as their loss receives them."""
    calls = []
    monkeypatch.setattr(dflash2_core, "compute_metrics",
                        lambda **kwargs: calls.append(kwargs) or (torch.zeros(()), {}))
    length = ids.shape[1]
    loss_mask = torch.zeros(1, length).index_fill_(1, torch.tensor(anchors), 1.0)
    with torch.no_grad():
        model(hidden_states=features, input_ids=ids, loss_mask=loss_mask, max_anchors=len(anchors),
              verifier_last_hidden_states=torch.randn(1, length, HIDDEN),
              document_ids=torch.zeros(1, length, dtype=torch.long))
    found = calls[-1]
    shape = (len(anchors), BLOCK, -1)
    return (found["unary_logits"].view(shape), found["training_candidate_ids"].view(shape),
            found["candidate_logits"].view(shape))


def assert_same_scores(monkeypatch, theirs, ours):
    """Per slot of two blocks: our backbone logits are their unary logits, our selector's scores of their training
    candidates are theirs, and our drafting path keeps exactly the backbone's top-k."""
    ids, features = context(len(ours.config.target_layer_ids))
    anchors = [3, 8]
    unary, candidates, scores = their_scores(monkeypatch, theirs, ids, features, anchors)
    first, from_anchor = ours.config.first_draft_slot, ours.config.sample_from_anchor
    for index, anchor in enumerate(anchors):
        block = torch.full((1, BLOCK), ours.config.mask_token_id)
        block[0, 0] = ids[0, anchor]
        # Slot k's predecessor: the token before the one it predicts (the anchor for the first drafting slot).
        predicted = torch.arange(BLOCK) + anchor + (1 if from_anchor else 0)
        previous = ids[:, (predicted - 1).clamp(min=anchor)]
        with torch.no_grad():
            out = ours(input_ids=block, target_hidden_states=features[:, :anchor], previous_token_ids=previous)
        torch.testing.assert_close(out.base_logits[0, first:], unary[index, first:], rtol=0, atol=1e-5)
        # Our teacher-forced logits are the selector's score of every token; theirs score the candidates.
        ours_at_candidates = out.logits[0].gather(-1, candidates[index])
        torch.testing.assert_close(ours_at_candidates[first:], scores[index, first:], rtol=0, atol=1e-5)
        for slot in range(first, BLOCK):
            logits, _, _ = ours.slot_logits(out.last_hidden_state[:, slot], out.base_logits[:, slot],
                                            previous[:, slot], None)
            kept = logits[0].isfinite().nonzero().flatten()
            top_k = ours.config.selector_top_k
            assert set(kept.tolist()) == set(unary[index, slot].topk(top_k).indices.tolist())
            torch.testing.assert_close(logits[0, kept], out.logits[0, slot, kept], rtol=0, atol=1e-5)


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_their_dflash2_loads_with_their_selector_scores(monkeypatch, tmp_path, sample_from_anchor):
    target = tiny_target("qwen3")
    theirs = their_dflash2(target, sample_from_anchor=sample_from_anchor)
    theirs.save_pretrained(tmp_path)
    ours = hf_dspark.AutoDrafter.from_pretrained(tmp_path)
    assert type(ours) is hf_dspark.DFlash2DraftModel
    assert {name: getattr(ours.config, name) for name in SELECTOR} == SELECTOR
    assert ours.config.sample_from_anchor == sample_from_anchor
    ours.attach_target(target)
    assert_same_scores(monkeypatch, theirs, ours)


def our_dflash2(target, **overrides):
    drafter = tiny_drafter(target, "dflash2", block_size=BLOCK, **{**SELECTOR, **overrides})
    with torch.no_grad():  # away from the identity convolutions and unit norms, so that a swapped one would show
        for name, param in drafter.named_parameters():
            if "norm" in name or "base_kernel" in name:
                param.add_(0.3 * torch.randn_like(param))
    return drafter.eval()


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_our_export_loads_in_speculators_with_nothing_missing_and_the_same_scores(monkeypatch, tmp_path,
                                                                                    sample_from_anchor):
    target = saved_target(tmp_path)
    ours = our_dflash2(target, sample_from_anchor=sample_from_anchor, target_layer_ids=[0, 1])
    export_speculators(ours, tmp_path / "exported", target=target)
    theirs, info = their_load(tmp_path / "exported")
    assert type(theirs).__name__ == "DFlash2DraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.save_pretrained(tmp_path / "resaved")  # what their save writes = what we wrote, tensor for tensor
    written, resaved = (load_file(tmp_path / name / "model.safetensors") for name in ("exported", "resaved"))
    assert written.keys() == resaved.keys() and all(torch.equal(written[name], resaved[name]) for name in written)
    ours.attach_target(target)
    assert_same_scores(monkeypatch, theirs.eval(), ours)


def test_round_trips_through_speculators_layout_are_exact(tmp_path):
    target = tiny_target("qwen3")
    ours = our_dflash2(target)
    back = hf_dspark.AutoDrafter.from_pretrained(export_speculators(ours, tmp_path / "exported", target=target))
    mine, again = ours.state_dict(), back.state_dict()
    assert mine.keys() == again.keys() and all(torch.equal(mine[name], again[name]) for name in mine)
    fields = ["block_size", "sample_from_anchor", "mask_token_id", "target_layer_ids", *SELECTOR]
    assert all(getattr(back.config, name) == getattr(ours.config, name) for name in fields)
    # Theirs -> ours -> theirs writes their checkpoint back, tensor for tensor.
    their_dflash2(target).save_pretrained(tmp_path / "theirs")
    export_speculators(hf_dspark.AutoDrafter.from_pretrained(tmp_path / "theirs"), tmp_path / "again", target=target)
    original, written = (load_file(tmp_path / name / "model.safetensors") for name in ("theirs", "again"))
    assert original.keys() == written.keys() and all(torch.equal(original[n], written[n]) for n in original)


def test_export_refuses_a_draft_vocabulary_speculators_cannot_hold(tmp_path):
    target = tiny_target("qwen3")
    ours = our_dflash2(target, draft_vocab_size=40)
    with pytest.raises(UserInputError, match="full vocabulary"):
        export_speculators(ours, tmp_path / "out", target=target)


def test_loaded_dflash2_keeps_greedy_output_identical(tmp_path):
    target = tiny_target("qwen3")
    their_dflash2(target).save_pretrained(tmp_path)
    ours = hf_dspark.AutoDrafter.from_pretrained(tmp_path)
    for ids in prompts(3):
        expected = target.generate(ids, do_sample=False, max_new_tokens=16)
        assert torch.equal(target.generate(ids, assistant_model=ours, do_sample=False, max_new_tokens=16), expected)


def test_a_draft_vocabulary_is_refused_as_speculators_refuses_it(tmp_path):
    target = tiny_target("qwen3")
    their_dflash2(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["draft_vocab_size"] = VOCAB // 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf_dspark.DrafterLoadError, match="speculators. DFlash2DraftModel refuses"):
        hf_dspark.AutoDrafter.from_pretrained(tmp_path)
