"""Settings that cannot work are refused the same way at batch size 1 and in a batch, with a ValueError that names
the setting (issue 16: top_p=0, num_draft_tokens, a drafter on another device than its target)."""

import pytest
import torch

from hf_dspark import DrafterTargetMismatchError
from conftest import prompts, tiny_drafter, tiny_target

MAX_NEW = 10


def batch_of(prompt_list):
    width = max(p.shape[1] for p in prompt_list)
    ids = torch.zeros(len(prompt_list), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompt_list):
        ids[row, width - prompt.shape[1]:] = prompt[0]
        mask[row, width - prompt.shape[1]:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, tiny_drafter(target, "markov", block_size=4)


@pytest.mark.parametrize("top_p,match", [(0.0, r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
                                         (-0.5, "top_p")])  # a negative one transformers itself refuses
def test_top_p_outside_its_range_is_refused_at_every_batch_size(pair, top_p, match):
    """Stock generate read top_p=0 as top-1 at batch 1 while the batched engine refused it: now both refuse."""
    target, drafter = pair
    prompt_list = prompts(2)
    ids, mask = batch_of(prompt_list)
    calls = {
        "batch 1": lambda: target.generate(prompt_list[0], assistant_model=drafter, do_sample=True, top_p=top_p,
                                           max_new_tokens=MAX_NEW),
        "batch 2": lambda: target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True,
                                           top_p=top_p, max_new_tokens=MAX_NEW),
    }
    messages = set()
    for name, call in calls.items():
        with pytest.raises(ValueError, match=match) as raised:
            call()
        messages.add(str(raised.value))
    assert len(messages) == 1  # one rule, one message


def test_top_p_inside_its_range_still_samples_at_both_batch_sizes(pair):
    target, drafter = pair
    prompt_list = prompts(2)
    ids, mask = batch_of(prompt_list)
    torch.manual_seed(0)
    one = target.generate(prompt_list[0], assistant_model=drafter, do_sample=True, top_p=0.5, max_new_tokens=MAX_NEW)
    two = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True, top_p=0.5,
                          max_new_tokens=MAX_NEW)
    assert one.shape[1] == prompt_list[0].shape[1] + MAX_NEW and two.shape[1] == ids.shape[1] + MAX_NEW


def test_num_draft_tokens_holds_in_a_batch_as_at_batch_one(pair):
    target, drafter = pair
    prompt_list = prompts(3)
    ids, mask = batch_of(prompt_list)
    expected = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompt_list]
    with pytest.raises(ValueError, match=r"num_draft_tokens must be an int from 1 to the drafter's block_size \(4\)"):
        drafter.num_draft_tokens = 6  # was a crash at batch 1 and a silent clamp in a batch
    try:
        drafter.num_draft_tokens = 2
        target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW)
        batch = drafter.last_batch_output
        for sequence, reference in zip(batch.sequences, expected):
            assert torch.equal(sequence, reference)
        assert max(max(s.draft_lengths) for s in batch.stats) == 2
    finally:
        drafter.num_draft_tokens = None


def test_a_drafter_on_another_device_is_named_in_attach_target():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov").to("meta")  # stands in for cuda vs cpu: no GPU needed
    with pytest.raises(DrafterTargetMismatchError, match=r"drafter is on meta but the target's input embedding is "
                                                         r"on cpu.*drafter.to\('cpu'\)"):
        drafter.attach_target(target)
    # generate() moves a drafter beside its target (attach_target(follow=True)), but not one never loaded.
    with pytest.raises(DrafterTargetMismatchError, match="meta device, not loaded"):
        target.generate(prompts(1)[0], assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(DrafterTargetMismatchError, match="meta device, not loaded"):
        ids, mask = batch_of(prompts(2))
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cpu_drafter_follows_a_gpu_target():
    target = tiny_target("llama").to("cuda")
    drafter = tiny_drafter(target, "markov")
    with pytest.raises(DrafterTargetMismatchError, match=r"drafter is on cpu but .* cuda:0.*drafter.to\('cuda:0'\)"):
        drafter.attach_target(target)  # training's attach (follow=False) names the mismatch
    out = target.generate(prompts(1)[0].cuda(), assistant_model=drafter, do_sample=False, max_new_tokens=8)
    assert next(drafter.parameters()).device.type == "cuda"
    assert torch.equal(out, target.generate(prompts(1)[0].cuda(), do_sample=False, max_new_tokens=8))
