"""DSparkDraftConfig's optional drafting settings (z-lab DFlash's: soft-capped logits, a scaled raw input embedding,
in-block causal and sliding-window layers) hold on every path that runs a drafter: batch-1 generation, the batched
engine (whose drafter cache has holes), training blocks, the trainer's target distribution, hf_dspark's own save
and load; exports to layouts that cannot express them refuse. z-lab parity is in test_interop_zlab.py."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError

import hf_dspark
from hf_dspark.hub.export_speculators import export_speculators
from factories import VOCAB, prompts, tiny_drafter, tiny_target
from hf_dspark.generation import batched_speculative_generate
from hf_dspark.hub.convert import export_deepspec
from hf_dspark.models.errors import UserInputError
from hf_dspark.training import DSparkTrainer, build_blocks
from batch_helpers import left_pad

ATTENTION = {
    "causal": {"block_causal": True},
    "causal_one_layer": {"block_causal": [False, True]},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3},
    "sliding_causal": {"block_causal": True, "layer_types": ["sliding_attention"] * 2, "sliding_window": 2},
}
EVERYTHING = {**ATTENTION["sliding_causal"], "final_logit_softcapping": 3.0, "input_embedding_scale": 2.0}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _features(target, drafter, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in drafter.target_hidden_state_indices], dim=-1)


@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_batched_drafter_passes_equal_single_prompt_passes(target, case):
    """Every backbone pass of the batched engine (left padding and rejected drafts leave holes in its drafter cache,
    so positions are not column indices) gives each row the final states (what its logits are read from) a fresh
    batch-1 pass gives on that row's committed context."""
    drafter = tiny_drafter(target, "dflash", block_size=4, **ATTENTION[case])
    drafter.generation_config.dspark_round_planning = False  # a backbone pass every round, to compare each
    prompt_list = prompts(3, length=7)
    ids, mask = left_pad(prompt_list)
    calls = []
    handle = drafter.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((kwargs, out.last_hidden_state.clone())), with_kwargs=True)
    try:
        out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=12, policy="all")
    finally:
        handle.remove()
    compared = 0
    for kwargs, states in calls:
        if kwargs.get("attention_mask") is None or states.shape[0] != len(prompt_list):
            continue  # a context-only pass (its output is discarded), or rows retired: the row order changed
        for row, sequence in enumerate(out.sequences):
            anchor_position = int(kwargs["position_ids"][row, 0])
            block = kwargs["input_ids"][row : row + 1]
            assert int(block[0, 0]) == int(sequence[anchor_position])
            with torch.no_grad():
                alone = drafter(input_ids=block,
                                target_hidden_states=_features(target, drafter, sequence[None, :anchor_position]))
            torch.testing.assert_close(states[row : row + 1], alone.last_hidden_state, atol=1e-4, rtol=0)
            compared += 1
    assert compared >= 9


@pytest.mark.parametrize("kind", ["dflash", "markov"])
@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_batched_greedy_equals_plain_with_restricted_attention(target, case, kind):
    drafter = tiny_drafter(target, kind, block_size=4, **ATTENTION[case])
    prompt_list = prompts(3)
    ids, mask = left_pad(prompt_list)
    out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=12, policy="all")
    for row, prompt in enumerate(prompt_list):
        assert torch.equal(out.sequences[row], target.generate(prompt, do_sample=False, max_new_tokens=12)[0])


@pytest.mark.parametrize("settings", [ATTENTION["causal"], ATTENTION["sliding"], EVERYTHING])
def test_batch_one_greedy_equals_plain(target, settings):
    drafter = tiny_drafter(target, "dflash", block_size=4, **settings)
    for ids in prompts(2):
        expected = target.generate(ids, do_sample=False, max_new_tokens=16)
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16), expected)


def _training_blocks(drafter, length: int = 16):
    ids = torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([[3, 7, 11]])
    blocks = build_blocks(ids, torch.ones_like(ids), anchors, torch.ones_like(anchors, dtype=torch.bool),
                          drafter.config.block_size, drafter.config.mask_token_id, drafter.config.first_draft_slot)
    return ids, anchors[0].tolist(), blocks


@pytest.mark.parametrize("case", ["plain", *sorted(ATTENTION)])
def test_training_blocks_see_what_drafting_sees(target, case):
    """Packed training blocks (build_blocks' mask, as the trainer passes it) give each block the logits the drafter
    gives it at inference on the context before its anchor."""
    drafter = tiny_drafter(target, "markov", block_size=4, **ATTENTION.get(case, {}))
    drafter.attach_target(target)
    ids, anchors, blocks = _training_blocks(drafter)
    features = _features(target, drafter, ids)
    with torch.no_grad():
        packed = drafter(input_ids=blocks.input_ids, target_hidden_states=features, position_ids=blocks.position_ids,
                         attention_mask=blocks.attention_mask).logits
        for n, anchor in enumerate(anchors):
            alone = drafter(input_ids=blocks.input_ids[:, 4 * n : 4 * n + 4],
                            target_hidden_states=features[:, :anchor]).logits
            torch.testing.assert_close(packed[:, 4 * n : 4 * n + 4], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_causal", [True, False])
def test_training_block_queries_never_see_later_slots_when_causal(target, block_causal):
    drafter = tiny_drafter(target, "dflash", block_size=4, block_causal=block_causal)
    drafter.attach_target(target)
    ids, _, blocks = _training_blocks(drafter)
    features = _features(target, drafter, ids)
    changed = blocks.input_ids.clone()
    changed[0, 4 + 2] = (changed[0, 4 + 2] + 1) % VOCAB  # slot 2 of the second block

    def logits(block_ids):
        with torch.no_grad():
            return drafter(input_ids=block_ids, target_hidden_states=features, position_ids=blocks.position_ids,
                           attention_mask=blocks.attention_mask).logits[0]

    before, after = logits(blocks.input_ids), logits(changed)
    moved = [not torch.allclose(before[i], after[i], atol=1e-6) for i in range(12)]
    assert moved[6] and not any(moved[:4] + moved[8:])  # the other blocks never see it
    assert moved[4:6] == ([False, False] if block_causal else [True, True])  # earlier slots: only bidirectional


def test_soft_capped_drafters_train_on_the_targets_uncapped_distribution(target):
    """The drafter's logits are capped (training reads them through compute_logits); the target's distribution,
    read from a target cache through the same LM head, is not."""
    drafter = tiny_drafter(target, "dflash", block_size=4, final_logit_softcapping=1.0)
    drafter.attach_target(target)
    final = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = target.lm_head(final)
        assert drafter.compute_logits(final).abs().max() < 1.0 < logits.abs().max()
        inputs = {"target_logsumexp": logits.logsumexp(-1), "target_argmax": logits.argmax(-1)}
        rows, positions = torch.zeros(5, dtype=torch.long), torch.arange(5)
        cached = DSparkTrainer.target_distribution(None, drafter, inputs, final, rows, positions)
    torch.testing.assert_close(cached.probs, logits[0].softmax(-1), atol=1e-6, rtol=0)


def test_settings_survive_save_and_load(target, tmp_path):
    drafter = tiny_drafter(target, "markov", block_size=4, **EVERYTHING)
    drafter.save_pretrained(tmp_path)
    loaded = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path).eval()
    assert loaded.config.drafting_options == drafter.config.drafting_options == {
        "final_logit_softcapping": 3.0, "input_embedding_scale": 2.0, "block_causal": True,
        "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 2}
    ids = prompts(1)[0]
    expected = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=10)
    assert torch.equal(target.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=10), expected)


@pytest.mark.parametrize("setting", [{"final_logit_softcapping": 3.0}, {"input_embedding_scale": 2.0},
                                     ATTENTION["causal_one_layer"], ATTENTION["sliding"]])
def test_exports_refuse_what_their_layout_cannot_express(target, tmp_path, setting):
    plain = tiny_drafter(target, "markov", block_size=4, qk_norm=True)
    export_deepspec(plain, tmp_path / "plain_deepspec", target=target)  # the same drafter without it exports
    export_speculators(plain, tmp_path / "plain_speculators", target=target)
    drafter = tiny_drafter(target, "markov", block_size=4, qk_norm=True, **setting)
    named = next(iter(setting))
    with pytest.raises(UserInputError, match="DeepSpec's layout cannot express") as error:
        export_deepspec(drafter, tmp_path / "deepspec", target=target)
    assert named in str(error.value)
    with pytest.raises(UserInputError, match="speculators") as error:
        export_speculators(drafter, tmp_path / "speculators", target=target)
    assert named in str(error.value)
    assert not (tmp_path / "deepspec").exists() and not (tmp_path / "speculators").exists()


@pytest.mark.parametrize("settings, named", [
    ({"block_causal": [True]}, "block_causal"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"layer_types": ["chunked_attention", "full_attention"], "sliding_window": 4}, "layer_types"),
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
    ({"input_embedding_scale": float("inf")}, "input_embedding_scale"),
])
def test_malformed_settings_are_refused_by_name(target, settings, named):
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match=named):
        hf_dspark.build_dflash_config(target.config, num_hidden_layers=2, **settings)
