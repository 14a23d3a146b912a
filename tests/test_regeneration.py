"""`regenerate` on a tiny random target with the default target's tokenizer: shards, resume, refusal."""

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_dspark.models.default_target import default_target_dir, load_default_target
from hf_dspark.training import RegenerationConfig, iter_regenerated, regenerate


@pytest.fixture(scope="module")
def tokenizer():
    if not (default_target_dir() / "tokenizer.json").is_file():
        load_default_target()  # materialises the cached copy once
    return AutoTokenizer.from_pretrained(default_target_dir())


def tiny_chat_target(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


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
