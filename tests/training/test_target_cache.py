"""Target cache: it reproduces the online loss, trains without the target, resumes, and refuses what it cannot do."""

import os

import pytest
import torch

from hf_dspark.training import DSparkTrainer, most_frequent_tokens
from hf_dspark.training import target_cache
from hf_dspark.training.target_cache import InsufficientDiskError, TargetCacheDataset, build_target_cache
from factories import tiny_drafter, tiny_target
from training_helpers import mean_tau, target_generated_examples, training_args


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
def test_cached_loss_equals_online_loss(tmp_path, kind):
    target = tiny_target("llama")
    examples = target_generated_examples(target, count=6)
    drafter = tiny_drafter(target, kind, draft_vocab_size=48)
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(torch.tensor(e["input_ids"]), minlength=target.config.vocab_size)
    drafter.set_draft_vocab(most_frequent_tokens(counts, 48))
    build_target_cache(target, examples, tmp_path / "cache", drafter.config.target_layer_ids, shard_size=4,
                       progress=False)
    cached = TargetCacheDataset(tmp_path / "cache", layer_ids=drafter.config.target_layer_ids)
    assert len(cached) == len(examples)
    assert [cached[i]["input_ids"].tolist() for i in range(len(cached))] == [e["input_ids"] for e in examples]

    trainer = DSparkTrainer(model=drafter, target=target, args=training_args(tmp_path / "run", 1),
                            train_dataset=examples, num_anchors=8)
    losses = []
    for batch in (trainer.data_collator(examples), trainer.data_collator([cached[i] for i in range(len(cached))])):
        torch.manual_seed(5)  # same anchors in both modes
        with torch.no_grad():
            losses.append(float(trainer.compute_loss(drafter, batch)))
    # Features are cached in bfloat16, so the two agree to bf16 precision, not bit for bit.
    assert losses[0] == pytest.approx(losses[1], rel=2e-2), losses


@pytest.mark.slow  # a training run
def test_training_from_cache_needs_no_target_and_raises_acceptance(tmp_path):
    target = tiny_target("llama")
    examples = target_generated_examples(target)
    drafter = tiny_drafter(target, "markov", block_size=4)
    before = mean_tau(target, drafter, examples)
    build_target_cache(target, examples, tmp_path / "cache", drafter.config.target_layer_ids, progress=False)
    drafter.attach_target(target)
    trainer = DSparkTrainer(model=drafter, target=None, args=training_args(tmp_path / "run", 150),
                            train_dataset=TargetCacheDataset(tmp_path / "cache"), num_anchors=16)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < 0.8 * losses[0]
    drafter.eval()
    assert mean_tau(target, drafter, examples) > before + 0.5


def test_interrupted_cache_build_resumes_and_refuses_other_data(tmp_path):
    target = tiny_target("llama")
    examples = target_generated_examples(target, count=6)
    folder = tmp_path / "cache"
    build_target_cache(target, examples, folder, [0, 2], shard_size=2, progress=False)
    complete = TargetCacheDataset(folder)[5]
    os.remove(folder / "shard-00002.safetensors")  # as if interrupted before the last shard was written
    with pytest.raises(FileNotFoundError, match="incomplete"):
        TargetCacheDataset(folder)
    build_target_cache(target, examples, folder, [0, 2], shard_size=2, progress=False)
    resumed = TargetCacheDataset(folder)[5]
    assert all(torch.equal(complete[k], resumed[k]) for k in complete)
    with pytest.raises(ValueError, match="other data"):
        build_target_cache(target, examples[:4], folder, [0, 2], shard_size=2, progress=False)
    with pytest.raises(ValueError, match="rebuild the cache"):
        TargetCacheDataset(folder, layer_ids=[1, 3])
    # A drafter reading a subset of the cached layers gets exactly those columns.
    width = target.config.hidden_size
    assert torch.equal(TargetCacheDataset(folder, layer_ids=[2])[5]["target_features"],
                       complete["target_features"][:, width:])


def test_cache_refuses_to_start_when_the_disk_is_too_small(tmp_path, monkeypatch, capsys):
    target = tiny_target("llama")
    examples = target_generated_examples(target, count=2, new_tokens=8)
    monkeypatch.setattr(target_cache.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(InsufficientDiskError, match="needs"):
        build_target_cache(target, examples, tmp_path / "cache", [0, 2], progress=False)
    assert "tokens in 1 shards" in capsys.readouterr().out
    assert not list((tmp_path / "cache").glob("shard-*"))
