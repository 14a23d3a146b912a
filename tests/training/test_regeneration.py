"""`regenerate` on a tiny random target with the default target's tokenizer: shards, resume, refusal."""

import json

import pytest
import torch

from hf_dspark.targets.default_target import load_default_target
from hf_dspark.training import RegenerationConfig, iter_regenerated, regenerate
from hf_dspark.training.regenerate import chat_prompt_ids, is_sampled
from saved_chat_models import tiny_chat_target


def test_regeneration_writes_shards_and_resumes_without_duplicates(tmp_path, tokenizer):
    target = tiny_chat_target(tokenizer)
    prompts = [f"Question number {i}: what is {i} + {i}?" for i in range(7)]
    config = RegenerationConfig(max_new_tokens=6, batch_size=3, shard_size=4, seed=1)
    first = regenerate(target, tokenizer, prompts[:7], tmp_path, config, target_name="tiny", progress=False)
    assert first["prompts"] == 7 and first["answer_tokens"] > 0
    records = [json.loads(line) for shard in sorted(tmp_path.glob("shard-*.jsonl")) for line in shard.open()]
    assert sorted(r["id"] for r in records) == list(range(7))
    for record in records:
        answer = record["input_ids"][record["prompt_length"] :]
        assert 1 <= len(answer) <= 6 and record["prompt"] == prompts[record["id"]]

    # Interrupted run: drop the last shard and a torn line, then resume: only the missing prompts are redone.
    shards = sorted(tmp_path.glob("shard-*.jsonl"))
    shards[-1].unlink()
    with shards[0].open("a") as handle:
        handle.write('{"id": 99, "input_')
    again = regenerate(target, tokenizer, prompts[:7], tmp_path, config, target_name="tiny", progress=False)
    assert again["prompts"] == 7 - 4
    examples = list(iter_regenerated(tmp_path))
    assert len(examples) == 7
    assert all(len(e["input_ids"]) == len(e["loss_mask"]) and sum(e["loss_mask"]) >= 1 for e in examples)

    with pytest.raises(ValueError, match="other settings"):
        regenerate(target, tokenizer, prompts[:7], tmp_path, RegenerationConfig(max_new_tokens=9), target_name="tiny",
                   progress=False)


@pytest.fixture(scope="module")
def smollm2():
    target, tokenizer = load_default_target(torch.float32)
    return target, tokenizer


def _records(folder):
    return sorted((json.loads(line) for shard in sorted(folder.glob("shard-*.jsonl")) for line in shard.open()),
                  key=lambda r: r["id"])


@pytest.mark.slow  # the real SmolLM2 target
def test_continuous_batching_gives_each_prompt_its_plain_greedy_answer(tmp_path, smollm2):
    """Rows end at different steps (EOS or the length limit) and are refilled with waiting prompts; every greedy
    answer is still the one plain `generate` writes for that prompt alone."""
    target, tokenizer = smollm2
    prompts = ["Say yes.", "Name a colour.", "Write a haiku about rain.", "What is 2 + 2?",
               "List three fruits.", "Say hello in French."]
    config = RegenerationConfig(max_new_tokens=20, greedy_fraction=1.0, batch_size=3, refill_every=2, max_turns=1)
    stats = regenerate(target, tokenizer, prompts, tmp_path, config, progress=False)
    records = _records(tmp_path)
    assert [r["id"] for r in records] == list(range(6))
    lengths = set()
    for record in records:
        (start, end), = record["answer_spans"]
        prompt = torch.tensor([record["input_ids"][:start]])
        plain = target.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=tokenizer.eos_token_id)
        answer = plain[0, start:].tolist()
        if tokenizer.eos_token_id in answer:
            answer = answer[: answer.index(tokenizer.eos_token_id) + 1]
        assert record["input_ids"][start:end] == answer
        assert record["finished"] == (answer[-1] == tokenizer.eos_token_id) and not record["sampled"]
        lengths.add(end - start)
    assert len(lengths) > 1  # rows really ended at different steps
    assert stats["answer_tokens"] == sum(r["answer_spans"][0][1] - r["answer_spans"][0][0] for r in records)


@pytest.mark.slow  # the real SmolLM2 target
def test_later_turns_are_answered_after_the_targets_own_answers(tmp_path, smollm2):
    target, tokenizer = smollm2
    conversations = [["Say only the word yes.", "Now say only the word no."],
                     ["What is the capital of France? One word.", "And of Italy? One word.", "And of Spain?"]]
    config = RegenerationConfig(max_new_tokens=24, greedy_fraction=1.0, batch_size=4, max_turns=3)
    regenerate(target, tokenizer, conversations, tmp_path, config, progress=False)
    records = _records(tmp_path)
    assert [len(r["answer_spans"]) for r in records] == [2, 3]
    for record, turns in zip(records, conversations):
        ids, spans = record["input_ids"], record["answer_spans"]
        messages = []
        for turn, (start, end) in zip(turns, spans):
            messages.append({"role": "user", "content": turn})
            # The context before each answer is the templated conversation, with the target's own earlier answers.
            assert ids[:start] == chat_prompt_ids(tokenizer, messages)
            plain = target.generate(torch.tensor([ids[:start]]), do_sample=False, max_new_tokens=24,
                                    pad_token_id=tokenizer.eos_token_id)[0, start:].tolist()
            assert ids[start:end] == plain[: end - start] and ids[end - 1] == tokenizer.eos_token_id
            messages.append({"role": "assistant", "content": tokenizer.decode(ids[start:end - 1])})
    examples = list(iter_regenerated(tmp_path))
    for example, record in zip(examples, records):
        assert sum(example["loss_mask"]) == sum(end - start for start, end in record["answer_spans"])


def test_sampled_share_is_fixed_by_seed_and_fraction():
    config = RegenerationConfig(greedy_fraction=0.75, seed=3)
    chosen = [is_sampled(i, config) for i in range(4000)]
    assert chosen == [is_sampled(i, RegenerationConfig(greedy_fraction=0.75, seed=3)) for i in range(4000)]
    assert 0.22 < sum(chosen) / 4000 < 0.28
    assert not any(is_sampled(i, RegenerationConfig(greedy_fraction=1.0)) for i in range(100))
    with pytest.raises(ValueError, match="temperature"):
        RegenerationConfig(temperature=-1)


def test_gzipped_shards_are_read_and_resumed_after(tmp_path, tokenizer):
    """Finished shards are committed gzipped; a run resumes after them and training reads both kinds."""
    import gzip
    import shutil

    target = tiny_chat_target(tokenizer)
    prompts = [f"Tell me about the number {i}." for i in range(5)]
    config = RegenerationConfig(max_new_tokens=4, batch_size=2, shard_size=2)
    regenerate(target, tokenizer, prompts[:5], tmp_path, config, target_name="tiny", progress=False)
    first = sorted(tmp_path.glob("shard-*.jsonl"))
    for shard in first[:-1]:
        with open(shard, "rb") as source, gzip.open(f"{shard}.gz", "wb") as packed:
            shutil.copyfileobj(source, packed)
        shard.unlink()
    first[-1].unlink()  # the unfinished tail of an interrupted run
    again = regenerate(target, tokenizer, prompts[:5], tmp_path, config, target_name="tiny", progress=False)
    assert again["prompts"] == 1
    names = sorted(p.name for p in tmp_path.glob("shard-*"))
    assert names == ["shard-00000.jsonl.gz", "shard-00001.jsonl.gz", "shard-00002.jsonl"]
    assert len(list(iter_regenerated(tmp_path))) == 5


def test_sampled_answers_follow_the_warpers_and_their_own_seed(tmp_path, tokenizer):
    """A sampled conversation draws from temperature, top-k and top-p (generate's warpers, in generate's order)
    with a generator seeded from its id: its answer is the same whatever batch it shares, and another seed draws
    another one."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    target = tiny_chat_target(tokenizer)
    prompts = [f"Tell me about the number {i}." for i in range(6)]

    def run(name, **settings):
        config = RegenerationConfig(max_new_tokens=8, **settings)
        regenerate(target, tokenizer, prompts, tmp_path / name, config, progress=False)
        return {record["id"]: record for record in _records(tmp_path / name)}

    alone, shared = run("alone", greedy_fraction=0.5, batch_size=1), run("shared", greedy_fraction=0.5, batch_size=4)
    assert {i for i, r in alone.items() if r["sampled"]} and {i for i, r in alone.items() if not r["sampled"]}
    assert all(alone[i]["input_ids"] == shared[i]["input_ids"] for i in alone)
    first, second = run("seed-0", greedy_fraction=0.0, seed=0), run("seed-1", greedy_fraction=0.0, seed=1)
    assert all(first[i]["input_ids"] != second[i]["input_ids"] for i in first)

    config = RegenerationConfig()
    warpers = LogitsProcessorList([TemperatureLogitsWarper(config.temperature), TopKLogitsWarper(config.top_k),
                                   TopPLogitsWarper(config.top_p)])
    for record in first.values():
        (start, end), = record["answer_spans"]
        ids = torch.tensor([record["input_ids"]])
        with torch.no_grad():
            allowed = warpers(ids, target(ids).logits[0, start - 1 : end - 1]).isfinite()
        assert all(allowed[position, token] for position, token in enumerate(record["input_ids"][start:end]))
