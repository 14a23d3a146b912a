"""Loss terms, block construction and data parsing checked against hand-computed values."""

import json
import math
import os

import pytest
import torch

from hf_dspark.training import (
    Decontaminator, build_blocks, dspark_loss, iter_json_records, l1_distance, load_prompts, position_weights,
    sample_anchors, user_turns,
)
from hf_dspark.training.losses import soft_cross_entropy


def test_position_weights_follow_exponential_decay():
    weights = position_weights(torch.arange(7), decay=4.0)
    assert weights[0] == 1.0
    torch.testing.assert_close(weights, torch.tensor([math.exp(-k / 4.0) for k in range(7)]))


def test_dspark_loss_matches_hand_computation():
    draft_logits = torch.log(torch.tensor([[0.5, 0.5, 0.0 + 1e-30], [0.2, 0.3, 0.5]]))
    target_logits = torch.log(torch.tensor([[0.7, 0.3, 1e-30], [0.2, 0.3, 0.5]]))
    labels = torch.tensor([0, 2])
    slots = torch.tensor([0, 1])
    confidence_logits = torch.tensor([0.0, 2.0])
    loss, details = dspark_loss(draft_logits, target_logits, labels, slots, confidence_logits,
                                ce_weight=0.1, tv_weight=0.9, bce_weight=1.0, decay=4.0)
    w = torch.tensor([1.0, math.exp(-1 / 4)])
    l1 = torch.tensor([0.4, 0.0])  # |0.5-0.7| + |0.5-0.3|, identical rows
    ce = torch.tensor([-math.log(0.5), -math.log(0.5)])
    accept = 1 - 0.5 * l1  # 0.8, 1.0
    bce = torch.tensor([
        -(0.8 * math.log(0.5) + 0.2 * math.log(0.5)),
        -(1.0 * math.log(torch.sigmoid(torch.tensor(2.0)))),
    ])
    expected = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / w.sum()
    torch.testing.assert_close(details["l1"], l1, atol=1e-5, rtol=0)
    torch.testing.assert_close(details["acceptance"], accept, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, expected.float(), atol=1e-5, rtol=0)


def test_draft_vocabulary_distance_counts_mass_outside_it():
    target_logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    draft_logits = torch.log(torch.tensor([[0.6, 0.4]]))  # over target ids [0, 2]
    subset = torch.tensor([0, 2])
    _, details = dspark_loss(draft_logits, target_logits, torch.tensor([1]), torch.tensor([0]),
                             draft_to_target=subset)
    # |0.6-0.5| + |0.4-0.2| + p(1)=0.3 outside the draft vocabulary
    torch.testing.assert_close(details["l1"], torch.tensor([0.6]), atol=1e-5, rtol=0)
    assert details["ce"][0] == 0  # label 1 is not drafted: ignored
    assert l1_distance(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]))[0] == 0
    soft = soft_cross_entropy(torch.log(torch.tensor([[0.5, 0.5]])), target_logits, subset)
    torch.testing.assert_close(soft, torch.tensor([-(0.5 + 0.2) * math.log(0.5)]), atol=1e-5, rtol=0)


def test_anchors_and_blocks_have_no_future_leakage():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0]])
    anchors, valid = sample_anchors(loss_mask, num_anchors=10)
    assert valid.sum() == 4 and anchors[valid].tolist() == [3, 4, 5, 6]  # anchor and its next token in the answer

    blocks = build_blocks(input_ids, loss_mask, torch.tensor([[3, 6]]), torch.tensor([[True, True]]),
                          block_size=3, mask_token_id=0)
    assert blocks.input_ids.tolist() == [[13, 0, 0, 16, 0, 0]]
    assert blocks.position_ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    assert blocks.labels.tolist() == [[14, 15, 16, 17, 18, 19]]
    assert blocks.previous_token_ids.tolist() == [[13, 14, 15, 16, 17, 18]]
    # Labels past the answer (positions 8, 9) are not supervised, nor anything after them in the block.
    assert blocks.slot_valid.tolist() == [[True, True, True, True, False, False]]
    mask = blocks.attention_mask[0, 0]
    length = input_ids.shape[1]
    for query, anchor in enumerate([3, 3, 3, 6, 6, 6]):
        context = mask[query, :length]
        assert context[:anchor].all() and not context[anchor:].any()  # strictly before the anchor
        own_block = mask[query, length:]
        assert own_block.tolist() == ([True] * 3 + [False] * 3 if anchor == 3 else [False] * 3 + [True] * 3)


def test_truncated_sharegpt_array_is_recovered(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "first [question]"}, {"from": "gpt", "value": "x"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "second, with \"quotes\" and ]"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "third"}]},
    ]
    text = json.dumps(records, indent=2)
    cut = text.index('"third"') + 3  # inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    recovered = list(iter_json_records(path))
    assert [r["id"] for r in recovered] == ["a", "b"]
    assert load_prompts([path]) == ["first [question]", 'second, with "quotes" and ]']


def test_prompt_formats_and_jsonl(tmp_path):
    assert user_turns({"turns": ["a", "b"]}) == ["a", "b"]
    assert user_turns({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}) == ["u"]
    assert user_turns({"instruction": "do", "input": "this"}) == ["do\n\nthis"]
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["one"]}\n{"instruction": "two"}\n{"turns": ["one"]}\n{"tur')
    assert load_prompts([path]) == ["one", "two"]


def test_decontamination_drops_eval_prompts():
    from hf_dspark.evaluation import benchmark_path

    gsm = json.loads(benchmark_path("gsm8k").read_text().splitlines()[5])["turns"][0]
    humaneval = json.loads(benchmark_path("humaneval").read_text().splitlines()[3])["turns"][0]
    decontaminator = Decontaminator.from_benchmarks()
    kept = decontaminator.filter([gsm, "  " + gsm.upper() + " ", "Please help: " + humaneval, "Tell me a joke about cats."])
    assert kept == ["Tell me a joke about cats."]


def test_optional_soft_cross_entropy_term():
    draft_logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    target_logits = torch.log(torch.tensor([[0.8, 0.1, 0.1]]))
    base, _ = dspark_loss(draft_logits, target_logits, torch.tensor([0]), torch.tensor([0]),
                          ce_weight=0.0, tv_weight=1.0, bce_weight=0.0)
    with_kl, _ = dspark_loss(draft_logits, target_logits, torch.tensor([0]), torch.tensor([0]),
                             ce_weight=0.0, tv_weight=1.0, bce_weight=0.0, kl_weight=2.0)
    soft = -(0.8 * math.log(0.5) + 0.1 * math.log(0.25) + 0.1 * math.log(0.25))
    torch.testing.assert_close(with_kl - base, torch.tensor(2.0 * soft), atol=1e-5, rtol=0)


def test_time_budget_schedule_and_stop(tmp_path):
    import json

    from transformers import TrainerControl, TrainerState

    from hf_dspark.training.budget import TimeBudgetCallback

    budget = TimeBudgetCallback(100.0, warmup_steps=4)
    assert budget.factor(0) == pytest.approx(0.25) and budget.factor(3) == pytest.approx(1.0)
    budget.elapsed = 50.0
    assert budget.factor(10) == pytest.approx(0.5)  # half the time spent: half-way down the cosine
    control = budget.on_step_end(None, TrainerState(), TrainerControl())
    assert not control.should_training_stop
    budget.elapsed = 100.0
    control = budget.on_step_end(None, TrainerState(), TrainerControl())
    assert control.should_training_stop and control.should_save and budget.factor(10) == pytest.approx(0.0)
    state = {"stateful_callbacks": {"TimeBudgetCallback": budget.state()}}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert TimeBudgetCallback.spent_seconds(tmp_path) >= 100.0
    assert TimeBudgetCallback.spent_seconds(tmp_path / "missing") == 0.0


def test_context_init_reproduces_the_copied_target_layers_input():
    from hf_dspark.training.init import init_context_from_target, init_layers_from_target
    from factories import tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", target_layer_ids=[0, 1])
    init_layers_from_target(drafter, target, [2, 3])
    assert init_context_from_target(drafter, target, 2) == 1
    ids = torch.randint(0, target.config.vocab_size, (1, 9))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in drafter.target_hidden_state_indices], dim=-1)
        expected = target.model.layers[2].input_layernorm(hidden[2])  # what target layer 2 attends from
        torch.testing.assert_close(drafter.fuse_context(features), expected)
    with pytest.raises(ValueError, match="not fused"):
        init_context_from_target(drafter, target, 3)  # layer 2 is not among the fused layers


def test_markov_head_bigram_init_predicts_the_data_bigrams():
    from hf_dspark.training.init import init_markov_head_from_bigrams
    from factories import tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", draft_vocab_size=32)  # rank 16
    drafter.set_draft_vocab(torch.arange(10, 42))
    # A deterministic successor for every drafted token: y = next in a cycle; token 5 lies outside the vocabulary.
    successor = {t: 10 + (t - 10 + 7) % 32 for t in range(10, 42)}
    examples = []
    for start in range(10, 42):
        ids, t = [5, start], start
        for _ in range(20):
            t = successor[t]
            ids.append(t)
        examples.append({"input_ids": ids, "loss_mask": [0] + [1] * (len(ids) - 1)})
    kept = init_markov_head_from_bigrams(drafter, examples)
    assert 0.5 < kept <= 1.0 + 1e-6
    head = drafter.sequential_head
    previous = torch.arange(10, 42)
    bias = head.output(head.token_embedding(drafter.head_rows(previous)))
    predicted = drafter.draft_to_target[bias.argmax(-1)]
    assert predicted.tolist() == [successor[t] for t in range(10, 42)]


def _fusion_features(target, drafter, ids):
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i] for i in drafter.target_hidden_state_indices], dim=-1)


def test_preconditioned_fusion_keeps_a_continued_drafters_function_and_saves_a_plain_drafter(tmp_path):
    from hf_dspark.models import DSparkDraftModel
    from hf_dspark.training.precondition import (
        fold_context_preconditioning, fused_feature_scales, precondition_context_fusion,
    )
    from hf_dspark.training.recipes import _fused_features
    from factories import tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", target_layer_ids=[0, 1])
    ids = torch.randint(0, target.config.vocab_size, (1, 12))
    features = _fusion_features(target, drafter, ids)
    before = drafter.fuse_context(features).detach()
    names = set(drafter.state_dict())
    examples = [{"input_ids": ids[0], "loss_mask": torch.ones(12)}]
    scales = fused_feature_scales(examples, lambda e: _fusion_features(target, drafter, e["input_ids"][None])[0])
    # Without a target cache, training reads the same features from the target itself.
    torch.testing.assert_close(_fused_features(drafter, target, examples[0]), features[0])
    assert scales.shape == (drafter.fc.in_features,) and bool((scales > 0).all())
    precondition_context_fusion(drafter, scales, fresh=False)
    torch.testing.assert_close(drafter.fuse_context(features), before)
    assert drafter.fc.parametrizations.weight.original.requires_grad
    with pytest.raises(ValueError, match="already preconditioned"):
        precondition_context_fusion(drafter, scales, fresh=False)

    assert fold_context_preconditioning(drafter) and not fold_context_preconditioning(drafter)
    assert set(drafter.state_dict()) == names  # the saved layout is the plain drafter's
    torch.testing.assert_close(drafter.fuse_context(features), before)
    drafter.save_pretrained(tmp_path / "folded")
    reloaded = DSparkDraftModel.from_pretrained(tmp_path / "folded")
    torch.testing.assert_close(reloaded.fc.weight, drafter.fc.weight)


def test_feature_scales_ignore_attention_sink_rows():
    from hf_dspark.training.precondition import fused_feature_scales

    torch.manual_seed(0)
    features = torch.randn(400, 6)
    features[:, 2] = 500.0 + torch.randn(400)  # a massive-activation column, large on every token
    features[:4] *= 1000.0  # a few sink tokens, huge in every column
    examples = [{"loss_mask": torch.ones(100), "rows": features[i * 100 : (i + 1) * 100]} for i in range(4)]
    scales = fused_feature_scales(examples, lambda example: example["rows"])
    assert scales[2] == pytest.approx(500.0, rel=0.01)
    others = scales[[0, 1, 3, 4, 5]]
    assert bool((others > 0.5).all() and (others < 1.0).all())  # median |N(0, 1)| is 0.674; the sinks do not count


def test_preconditioning_lets_small_features_train_beside_a_massive_one():
    """Adam moves each weight by about the learning rate, so through a column 500x larger than the rest a step
    changes the output 500x more: the raw fusion cannot fit what the small columns say; the preconditioned one can."""
    from torch import nn
    from hf_dspark.training.precondition import (
        fold_context_preconditioning, fused_feature_scales, precondition_context_fusion,
    )

    torch.manual_seed(0)
    inputs = torch.randn(512, 8)
    inputs[:, 0] = 500.0 + torch.randn(512)  # carries nothing about the target
    truth = inputs[:, 1:] @ torch.randn(7, 4)
    examples = [{"loss_mask": torch.ones(512), "rows": inputs}]
    losses = {}
    for preconditioned in (False, True):
        torch.manual_seed(1)
        model = nn.Module()
        model.fc = nn.Linear(8, 4, bias=False)
        if preconditioned:
            precondition_context_fusion(model, fused_feature_scales(examples, lambda e: e["rows"]), fresh=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(300):
            optimizer.zero_grad()
            loss = (model.fc(inputs) - truth).pow(2).mean()
            loss.backward()
            optimizer.step()
        fold_context_preconditioning(model)
        with torch.no_grad():
            losses[preconditioned] = float((model.fc(inputs) - truth).pow(2).mean())
    assert losses[True] < 0.1 * losses[False], losses


def _fake_checkpoint(folder, step: int):
    """The files `Trainer._save_checkpoint` writes, small."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"state": torch.arange(64)}, folder / name)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


@pytest.mark.parametrize("damage,reason", [
    (lambda f: (f / "trainer_state.json").unlink(), "no trainer_state.json"),
    (lambda f: (f / "trainer_state.json").write_text('{"global_st'), "trainer_state.json is unreadable"),
    (lambda f: (f / "model.safetensors").unlink(), "no model weights"),
    (lambda f: (f / "optimizer.pt").unlink(), "no optimizer state"),
    (lambda f: (f / "scheduler.pt").unlink(), "no scheduler state"),
    (lambda f: (f / "rng_state.pth").unlink(), "no RNG state"),
    (lambda f: os.truncate(f / "model.safetensors", 200), "model.safetensors is truncated"),
    (lambda f: os.truncate(f / "optimizer.pt", 300), "optimizer.pt is truncated"),
])
def test_a_checkpoint_is_complete_only_with_everything_a_resume_reads(tmp_path, damage, reason):
    from hf_dspark.training.checkpoints import checkpoint_problem, newest_complete_checkpoint

    complete = _fake_checkpoint(tmp_path / "checkpoint-2", 2)
    assert checkpoint_problem(complete) is None
    damage(_fake_checkpoint(tmp_path / "checkpoint-10", 10))
    assert reason in checkpoint_problem(tmp_path / "checkpoint-10")
    said = []
    assert newest_complete_checkpoint(tmp_path, log=said.append) == complete  # by step: 10 is newer than 2
    assert said == [f"{tmp_path / 'checkpoint-10'} is incomplete ({checkpoint_problem(tmp_path / 'checkpoint-10')}); "
                    "skipped, and left on disk."]
    assert (tmp_path / "checkpoint-10").is_dir()


def test_rotation_deletes_old_complete_checkpoints_only(tmp_path):
    """transformers' rotation deletes any `checkpoint-*` folder, a user's half checkpoint included."""
    from hf_dspark.training.checkpoints import publish_checkpoint, rotate_checkpoints

    run = tmp_path / "run"
    for step in (2, 4, 6):
        _fake_checkpoint(run / f"checkpoint-{step}", step)
    (_fake_checkpoint(run / "checkpoint-8", 8) / "trainer_state.json").unlink()
    said = []
    publish_checkpoint(_fake_checkpoint(tmp_path / "staged" / "checkpoint-8", 8), run / "checkpoint-8",
                       log=said.append)
    assert said == [f"moved the incomplete {run / 'checkpoint-8'} to {run / 'incomplete' / 'checkpoint-8'} to save a "
                    "complete checkpoint in its place; delete it when you no longer need it."]
    assert not (run / "incomplete" / "checkpoint-8" / "trainer_state.json").exists()  # the half one, kept as it was
    assert (run / "checkpoint-8" / "trainer_state.json").is_file()
    (_fake_checkpoint(run / "checkpoint-12", 12) / "optimizer.pt").unlink()
    rotate_checkpoints(run, 2, run / "checkpoint-8")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-12", "checkpoint-6", "checkpoint-8", "incomplete"]
