"""Both slot conventions run natively: slot k predicts anchor + k + 1 (DeepSpec, hf_dspark: `sample_from_anchor`
True) or slot j predicts anchor + j with slot 0 unused (`vllm-project/speculators`, z-lab DFlash: False). Greedy
output equals plain greedy under either; the drafting core, the batched engine and training read the slots the
config names (a drafter read the other way would silently reach tau ~ 1)."""

import pytest
import torch

from hf_dspark.generation import DraftingPlan, batched_speculative_generate
from hf_dspark.training import build_blocks
from factories import prompts, tiny_drafter, tiny_target
from batch_helpers import left_pad

KINDS = ["markov", "gated", "rnn", "dflash"]


@pytest.mark.parametrize("kind", KINDS)
def test_slot_zero_unused_drafters_match_plain_greedy(family, kind):
    target = tiny_target(family)
    drafter = tiny_drafter(target, kind, block_size=4, sample_from_anchor=False)
    assert drafter.config.num_draft_slots == 3 and DraftingPlan.for_call(drafter).draft_length == 3
    for ids in prompts(3):
        expected = target.generate(ids, do_sample=False, max_new_tokens=20)
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20),
                           expected)
        assert max(drafter.last_generation_stats.draft_lengths) <= 3


@pytest.mark.parametrize("kind", ["markov", "dflash"])
def test_slot_zero_unused_drafters_match_plain_greedy_in_a_batch(kind):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4, sample_from_anchor=False)
    drafter.generation_config.dspark_round_planning = False  # every round drafts its whole budget
    prompt_list = prompts(3)
    ids, mask = left_pad(prompt_list)
    out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=12, policy="all")
    for row, prompt in enumerate(prompt_list):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=12)[0]
        assert torch.equal(out.sequences[row], expected)
    assert max(max(s.draft_lengths) for s in out.stats) == 3


def _oracle_forward(drafter, reference: torch.Tensor, laid_out_from: int):
    """Make the drafter propose the target's own continuation, block row r predicting the token at
    anchor + r + 1 - `laid_out_from`: what a checkpoint trained in that convention would propose. Drafting computes
    the drafted rows' logits from their final states (`draft_block`), so the forward writes into each row's state the
    position it predicts, and the LM head proposes the reference token there."""
    original_forward, original_logits = drafter.forward, drafter.compute_logits

    def forward(*args, **kwargs):
        cache, context = kwargs.get("cache"), kwargs.get("target_hidden_states")
        anchor = (cache.get_seq_length() if cache is not None else 0) + (context.shape[1] if context is not None else 0)
        out = original_forward(*args, **kwargs)
        marks = torch.zeros_like(out.last_hidden_state)
        marks[..., 0] = anchor + torch.arange(marks.shape[1]) + 1 - laid_out_from
        out.last_hidden_state = marks
        return out

    def compute_logits(hidden):
        logits = torch.full_like(original_logits(hidden), -10.0)
        positions = hidden[..., 0].round().long()
        inside = (positions >= 0) & (positions < reference.shape[1])
        tokens = reference[0, positions.clamp(0, reference.shape[1] - 1)]
        return logits.scatter(-1, tokens[..., None], torch.where(inside, 10.0, -10.0)[..., None])

    drafter.forward, drafter.compute_logits = forward, compute_logits


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_the_drafting_core_reads_the_slots_its_convention_names(sample_from_anchor):
    target = tiny_target("llama")
    ids = prompts(1)[0]
    reference = target.generate(ids, do_sample=False, max_new_tokens=40)
    laid_out_from = 0 if sample_from_anchor else 1
    right = tiny_drafter(target, "dflash", block_size=4, sample_from_anchor=sample_from_anchor)
    wrong = tiny_drafter(target, "dflash", block_size=4, sample_from_anchor=not sample_from_anchor)
    for drafter in (right, wrong):
        _oracle_forward(drafter, reference, laid_out_from)
        drafter.generation_config.dspark_round_planning = False
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24)
        assert torch.equal(out, reference[:, : ids.shape[1] + 24])  # lossless either way
    slots = right.config.num_draft_slots
    full = [a for a, d in zip(right.last_generation_stats.accepted, right.last_generation_stats.draft_lengths)
            if d == slots]
    assert full and all(a == slots for a in full)  # read as trained: every draft accepted
    assert sum(wrong.last_generation_stats.accepted) == 0  # read the other way: tau 1, silently, hence the field


def test_training_blocks_label_each_convention():
    input_ids = torch.arange(10, 20)[None]
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0]])
    anchors, valid = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    ours = build_blocks(input_ids, loss_mask, anchors, valid, block_size=3, mask_token_id=0)
    theirs = build_blocks(input_ids, loss_mask, anchors, valid, block_size=3, mask_token_id=0, first_slot=1)
    assert theirs.input_ids.tolist() == ours.input_ids.tolist() == [[13, 0, 0, 16, 0, 0]]
    assert theirs.position_ids.tolist() == ours.position_ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    # Slot j predicts anchor + j: slot 0 (the anchor itself) is never supervised.
    assert theirs.labels.tolist()[0][1:3] == [14, 15] and theirs.labels.tolist()[0][4:6] == [17, 18]
    assert theirs.slot_valid.tolist() == [[False, True, True, False, True, False]]
    assert theirs.slot_index.tolist()[0][1:3] == [0, 1]  # draft index: loss weights start at the first draft
    assert theirs.previous_token_ids.tolist()[0][1:3] == [13, 14]  # the anchor before the first draft
    assert theirs.target_rows.tolist()[0][1:3] == [3, 4]  # the target's distribution after anchor + j - 1
    assert ours.target_rows.tolist() == ours.position_ids.tolist()


def test_a_slot_zero_unused_drafter_trains(tmp_path):
    """One trainer step on the anchor + j convention: finite losses over the supervised draft slots only."""
    from transformers import TrainingArguments

    from hf_dspark.training import DSparkTrainer

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "rnn", block_size=4, sample_from_anchor=False).train()
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(2, 96, (24,), generator=generator),
                 "loss_mask": torch.tensor([0] * 6 + [1] * 18)} for _ in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2,
                             per_device_train_batch_size=2, remove_unused_columns=False, save_strategy="no")
    trainer = DSparkTrainer(model=drafter, target=target, args=args, train_dataset=examples, num_anchors=4)
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(before[name], value) for name, value in drafter.state_dict().items())


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_a_round_computes_the_lm_head_over_its_drafted_slots_only(monkeypatch, sample_from_anchor):
    """A round that drafts two slots of a block of six computes the LM head over those two only, at batch 1 and in
    the engine, and nothing else of the block's."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=6, sample_from_anchor=sample_from_anchor)
    drafter.generation_config.update(dspark_round_planning=False, num_assistant_tokens=2)
    shapes, compute_logits = [], drafter.compute_logits
    monkeypatch.setattr(drafter, "compute_logits", lambda hidden: shapes.append(tuple(hidden.shape[:-1])) or
                        compute_logits(hidden))
    ids = prompts(1)[0]
    assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12),
                       target.generate(ids, do_sample=False, max_new_tokens=12))
    prompt_list = prompts(3)
    batch, mask = left_pad(prompt_list)
    out = batched_speculative_generate(target, drafter, batch, mask, max_new_tokens=12, policy="all")
    for row, prompt in enumerate(prompt_list):
        assert torch.equal(out.sequences[row], target.generate(prompt, do_sample=False, max_new_tokens=12)[0])
    drafted = [shape for shape in shapes if 0 not in shape]
    assert (1, 2) in drafted and (3, 2) in drafted  # batch 1's rounds, then the engine's three rows
    assert all(shape[-1] <= 2 for shape in drafted)
    assert all(shape in ((0,), (1, 2), (2, 2), (3, 2), (1, 1), (2, 1), (3, 1)) for shape in shapes), shapes
