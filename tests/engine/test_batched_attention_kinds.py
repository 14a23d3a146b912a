"""Targets loaded with an attention implementation that cannot take the engine's hole masks (flash attention, or a
function a user registered) decode in batches: the engine's forwards run sdpa for them (transformers' own, with
torch's grouped-query kernel on the CPU), the rows are each prompt's own greedy output, and the model's own setting is
back after the call, whatever happened inside."""

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hf_dspark.transformers_internals.attention import GROUPED_SDPA, mask_taking_attention
from factories import prompts, tiny_drafter, tiny_target
from batch_helpers import left_pad
from batch_helpers import unpadded_rows

CALLS: list = []


def counting_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa that counts its calls: stands for an implementation the engine must not hand its hole masks to."""
    CALLS.append(query.shape[2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("counting_sdpa", counting_attention)
AttentionMaskInterface.register("counting_sdpa", sdpa_mask)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_target_on_another_attention_decodes_in_batches_with_sdpa(family):
    target = tiny_target(family)
    target.set_attn_implementation("counting_sdpa")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(3, length=7)
    CALLS.clear()
    references = [target.generate(p, do_sample=False, max_new_tokens=12)[0].tolist() for p in prompt_list]
    assert CALLS  # plain generate runs the model's own implementation
    ids, mask = left_pad(prompt_list)
    CALLS.clear()
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    assert CALLS == []  # every engine forward ran sdpa, which takes the holes
    assert unpadded_rows(out, mask, target.config.pad_token_id) == references
    assert target.config._attn_implementation == "counting_sdpa"


def test_the_attention_setting_is_restored_when_a_forward_fails():
    target = tiny_target("llama")
    target.set_attn_implementation("counting_sdpa")
    with pytest.raises(RuntimeError, match="inside"):
        with mask_taking_attention(target):
            assert target.config._attn_implementation == GROUPED_SDPA
            raise RuntimeError("inside")
    assert target.config._attn_implementation == "counting_sdpa"
    target.set_attn_implementation("eager")
    with mask_taking_attention(target):  # eager takes the masks: left as it is
        assert target.config._attn_implementation == "eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs CUDA")
def test_a_flash_attention_target_decodes_batches_as_its_sdpa_twin():
    pytest.importorskip("flash_attn")
    target = tiny_target("llama").to("cuda", torch.bfloat16)
    drafter = tiny_drafter(target, "markov", block_size=4).to("cuda", torch.bfloat16)
    ids, mask = left_pad(prompts(4, length=9, device="cuda"))
    outputs = {}
    for implementation in ("sdpa", "flash_attention_2"):
        target.set_attn_implementation(implementation)
        outputs[implementation] = target.generate(ids, attention_mask=mask, assistant_model=drafter,
                                                  do_sample=False, max_new_tokens=16)
    assert torch.equal(outputs["sdpa"], outputs["flash_attention_2"])
    assert target.config._attn_implementation == "flash_attention_2"
