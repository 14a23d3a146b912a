"""Every option `generate()` accepts, through `assistant_model=` and `custom_generate=` at batch 1: greedy output
equals plain `generate` with the same options token for token (float32), or the call is refused before the target
runs a single forward, with a message naming the option."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, SynthIDTextWatermarkingConfig, WatermarkingConfig

import hf_dspark
from hf_dspark.models.errors import UserInputError
from factories import prompts, tiny_drafter, tiny_target

EOS = 3


def _only_even_after_two(batch_id, input_ids):
    """A prefix_allowed_tokens_fn that reads the context: even ids after a token divisible by 3, else all."""
    return list(range(0, 96, 2)) if int(input_ids[-1]) % 3 == 0 else list(range(96))


# Options whose processors read the context or the length: each must give plain generate's tokens.
EXACT = {
    "repetition_penalty": dict(repetition_penalty=1.4),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.5),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8], [20, 21, 22]]),
    "sequence_bias": dict(sequence_bias={(11,): 4.0, (12, 13): 6.0}),
    "min_new_tokens": dict(min_new_tokens=12, eos_token_id=EOS),
    "min_length": dict(min_length=14, eos_token_id=EOS),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=_only_even_after_two),
    "forced_bos_token_id": dict(forced_bos_token_id=9),
    "forced_eos_token_id": dict(forced_eos_token_id=EOS, max_new_tokens=10),
    "remove_invalid_values": dict(remove_invalid_values=True),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(3, 1.5), eos_token_id=EOS),
    "suppress_tokens": dict(suppress_tokens=[4, 6, 10, 17]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[30, 31]),
    "renormalize_logits": dict(renormalize_logits=True),
    "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=3.0, context_width=2)),
    "max_time": dict(max_time=600.0),
    "guidance_scale=1": dict(guidance_scale=1.0),  # 1 is "off" in stock generate
    "several": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, suppress_tokens=[4], sequence_bias={(11,): 2.0}),
}

# Options stock generate honours but a speculative loop cannot follow: each is refused before any forward.
REFUSED = {
    "guidance_scale": (dict(guidance_scale=1.5), "guidance_scale"),
    "synthid_watermark": (
        dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[3, 5, 7, 11], ngram_len=3)),
        "watermarking_config",
    ),
    "num_beams": (dict(num_beams=2), "num_beams"),
    "beam_sample": (dict(num_beams=2, do_sample=True), "num_beams"),
    "num_beam_groups": (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "num_beam"),
    "dola_layers": (dict(dola_layers="high"), "dola_layers"),
    "penalty_alpha": (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    "force_words_ids": (dict(force_words_ids=[[5]], num_beams=2), "force_words_ids"),
    "prompt_lookup_num_tokens": (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    "assistant_early_exit": (dict(assistant_early_exit=2), "assistant_early_exit"),
    # transformers' own speculative switches (issue 44 §1): never silently one or the other.
    "use_mtp": (dict(use_mtp=True), "use_mtp"),
    "speculation_type": (dict(speculation_type="dflash"), "speculation_type"),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov")
    return target, drafter


def _generate(target, ids, route: str, drafter, **options):
    kwargs = dict(do_sample=False, max_new_tokens=24)
    kwargs.update(options)
    if route == "assistant_model":
        return target.generate(ids, assistant_model=drafter, **kwargs)
    if route == "custom_generate":
        return target.generate(ids, custom_generate=hf_dspark.custom_generate_for(drafter), **kwargs)
    return target.generate(ids, **kwargs)


@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
@pytest.mark.parametrize("name", list(EXACT))
def test_greedy_output_equals_plain_generate_under_each_option(models, route, name):
    target, drafter = models
    for ids in prompts(3):
        expected = _generate(target, ids, "plain", None, **EXACT[name])
        actual = _generate(target, ids, route, drafter, **EXACT[name])
        assert torch.equal(actual, expected), f"{name} via {route}: {actual.tolist()} != {expected.tolist()}"


class _ForwardCounter:
    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.count += 1


@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_options_a_speculative_loop_cannot_follow_are_refused_before_any_forward(models, route, name):
    target, drafter = models
    options, named = REFUSED[name]
    ids = prompts(1)[0]
    counter = _ForwardCounter(target)
    try:
        # trust_remote_code: without it stock generate() itself refuses the modes moved to Hub repos (contrastive,
        # constrained beams) before any drafter check; with it, hf_dspark must refuse before any download.
        with pytest.raises(ValueError) as refusal:
            _generate(target, ids, route, drafter, trust_remote_code=True, **options)
    finally:
        counter.handle.remove()
    assert named in str(refusal.value), str(refusal.value)
    assert counter.count == 0, f"{name}: the target ran {counter.count} forwards before the refusal"


def test_guidance_scale_was_silently_wrong_before_it_was_refused(models):
    """Why guidance_scale is refused: the loop calls processors once per scored position, so the guidance
    processor's own unconditional cache runs out of step. Applied per slot as the loop would, it differs."""
    target, drafter = models
    ids = prompts(1)[0]
    plain = _generate(target, ids, "plain", None, guidance_scale=1.5)
    assert not torch.equal(plain, _generate(target, ids, "plain", None)), "guidance must change this output"
    with pytest.raises(UserInputError, match="guidance_scale"):
        _generate(target, ids, "assistant_model", drafter, guidance_scale=1.5)


class _CountingProcessor(LogitsProcessor):
    """A user processor that keeps state (a call counter) and bans one token by position: stateless processors
    are exact; the documented contract is one call per scored position, some of which are later rejected."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        scores = scores.clone()
        scores[:, int(input_ids.shape[1]) % 7 + 2] = -float("inf")
        return scores


def test_a_user_processor_sees_each_scored_position_and_stays_exact_when_stateless(models):
    target, drafter = models
    ids = prompts(1)[0]
    plain_processor, spec_processor = _CountingProcessor(), _CountingProcessor()
    expected = _generate(target, ids, "plain", None, logits_processor=LogitsProcessorList([plain_processor]))
    actual = _generate(target, ids, "assistant_model", drafter, logits_processor=LogitsProcessorList([spec_processor]))
    assert torch.equal(actual, expected)
    assert plain_processor.calls == 24
    # Draft slots and verification slots are scored too: at least one call per emitted token.
    assert spec_processor.calls >= 24


def test_a_pad_id_inside_the_prompt_without_a_mask_is_explained_and_the_fix_works(models):
    """Stock generate() infers an attention_mask from the pad id when none is passed; say so, and the named fix
    (an explicit all-ones mask) gives plain generate's output with the same mask."""
    target, drafter = models
    ids = prompts(1)[0].clone()
    ids[0, 2] = target.config.pad_token_id
    target.generate(ids, do_sample=False, max_new_tokens=8)  # plain generate runs
    with pytest.raises(UserInputError) as refusal:
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=8)
    message = str(refusal.value)
    assert f"pad token id {target.config.pad_token_id} at position 2" in message
    assert "attention_mask=torch.ones_like(input_ids)" in message
    mask = torch.ones_like(ids)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    actual = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=8)
    assert torch.equal(actual, expected)
