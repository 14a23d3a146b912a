"""The two generate() routes into hf_dspark's loop, `assistant_model=drafter` (class-level wrappers of private
transformers methods) and `custom_generate=hf_dspark.custom_generate_for(drafter)` (transformers' public hook): the
private signatures they rely on are pinned against the installed transformers, a drifted signature is refused with
a clear message (simulated on stand-in classes, transformers itself is left alone), both routes give the same tokens,
outputs and stats, and generate() calls without one of our drafters still run stock code."""

import inspect
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import BartConfig, BartForConditionalGeneration, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

import hf_dspark
from hf_dspark.generation.routing import integration
from hf_dspark.generation.routing.custom_generate import custom_generate_for
from hf_dspark.generation.routing.integration import (
    SUPPORTED_TRANSFORMERS,
    TransformersCompatibilityError,
    hook_signature_problems,
    install_generate_hooks,
    loop_support_problems,
)
from hf_dspark.generation.call.settings import SETTING_NAMES
from hf_dspark.models import UserInputError
from factories import prompts, tiny_drafter, tiny_target
from batch_helpers import left_pad
from hook_checks import with_and_without_hf_dspark
from hook_checks import stock

MAX_NEW = 12

# What the wrappers are written against (transformers 5.24, unchanged since at least 5.17). A transformers release
# that changes one of these fails here first; hf_dspark then refuses the assistant_model= route at import (below).
PINNED_PRIVATE_SIGNATURES = {
    "_assisted_decoding": [
        "self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer",
        "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer", "model_kwargs",
    ],
    "_validate_generation_mode": ["self", "generation_mode", "generation_config", "generation_mode_kwargs"],
    "_extract_generation_mode_kwargs": ["self", "custom_generate", "kwargs", "synced_gpus", "assistant_model",
                                        "streamer"],
}


def test_installed_transformers_keeps_the_private_signatures_the_wrappers_rely_on():
    for name, pinned in PINNED_PRIVATE_SIGNATURES.items():
        found = list(inspect.signature(stock(name)).parameters)
        assert found == pinned, (
            f"transformers {transformers.__version__} changed GenerationMixin.{name}: parameters {found}, the "
            f"wrapper in hf_dspark/transformers_internals/generate_hooks.py is written for {pinned}. Update the wrapper (and this "
            f"pin) or pin {SUPPORTED_TRANSFORMERS}."
        )
    problems = hook_signature_problems() + loop_support_problems(GenerationMixin)
    assert problems == [], integration.incompatibility_message(problems, custom_generate_works=False)
    for name, pinned in PINNED_PRIVATE_SIGNATURES.items():
        wrapper = getattr(GenerationMixin, name)
        assert wrapper is not stock(name), f"import hf_dspark did not install its {name} wrapper"
        # The wrapper's own parameters equal the stock ones, so generate() calls it exactly as the stock method
        # (it passes `inputs_tensor` only to a decoding method that lists it).
        assert list(inspect.signature(wrapper, follow_wrapped=False).parameters) == pinned
    # generate() decides what a callable custom_generate receives by diffing its parameters against `_sample`'s:
    # ours must add only the target (`model`) and the drafting settings, which it hands over exactly as passed.
    decode = custom_generate_for(tiny_drafter(tiny_target("llama")))
    extra = set(inspect.signature(decode).parameters) - set(inspect.signature(GenerationMixin._sample).parameters)
    assert extra == {"model", *SETTING_NAMES}


def test_supported_range_in_messages_is_the_one_pyproject_declares():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert SUPPORTED_TRANSFORMERS in pyproject["project"]["dependencies"]


class DriftedMixin:
    """A transformers release whose `_assisted_decoding` lost `inputs_tensor` and gained a parameter."""

    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, assistant_model=None, assistant_tokenizer=None, tokenizer=None,
                           assistant_processor=None, **model_kwargs):
        return "stock", assistant_model

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        return "stock validation"

    _extract_generation_mode_kwargs = stock("_extract_generation_mode_kwargs")

    def prepare_inputs_for_generation(self, input_ids, cache=None, **kwargs):
        return {}


def test_a_drifted_private_signature_is_refused_with_a_clear_message():
    stock_validate = DriftedMixin._validate_generation_mode
    stock_signature = inspect.signature(DriftedMixin._assisted_decoding)
    with pytest.warns(UserWarning) as record:
        problems = install_generate_hooks(DriftedMixin)
    message = str(record[0].message)
    assert len(record) == 1 and problems
    for part in (f"transformers {transformers.__version__}", "DriftedMixin._assisted_decoding", "lost `inputs_tensor`",
                 "gained `assistant_processor`", SUPPORTED_TRANSFORMERS, "custom_generate=hf_dspark.custom_generate_for"):
        assert part in message, part

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with pytest.raises(TransformersCompatibilityError) as refused:
        DriftedMixin()._assisted_decoding(None, None, None, None, assistant_model=drafter)
    assert str(refused.value) == message
    # Anything but our drafter still reaches the stock method, which generate() sees with its own signature.
    assert DriftedMixin()._assisted_decoding(None, None, None, None, assistant_model=target) == ("stock", target)
    assert inspect.signature(DriftedMixin._assisted_decoding) == stock_signature
    assert DriftedMixin._validate_generation_mode is stock_validate  # not wrapped: its wrapper needs the other one

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second install neither warns nor wraps again
        assert install_generate_hooks(DriftedMixin) == problems


class OldCacheNameMixin:
    """transformers 5.17: the same private methods, but the KV cache travels as `past_key_values`."""

    _assisted_decoding = stock("_assisted_decoding")
    _validate_generation_mode = stock("_validate_generation_mode")
    _extract_generation_mode_kwargs = stock("_extract_generation_mode_kwargs")

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, past_key_values=None, **kwargs):
        return {}


def test_an_old_cache_convention_refuses_both_routes():
    with pytest.warns(UserWarning) as record:
        problems = install_generate_hooks(OldCacheNameMixin)
    message = str(record[0].message)
    assert len(problems) == 1 and "`past_key_values`" in message and SUPPORTED_TRANSFORMERS in message
    assert "custom_generate_for" not in message  # the loop itself cannot run: custom_generate is no way out
    assert OldCacheNameMixin._assisted_decoding is not stock("_assisted_decoding")  # the signatures still fit

    drafter = tiny_drafter(tiny_target("llama"))
    model, ids = OldCacheNameMixin(), torch.tensor([[5, 6, 7]])
    call = (ids, LogitsProcessorList(), StoppingCriteriaList(), GenerationConfig())
    with pytest.raises(TransformersCompatibilityError, match="OldCacheNameMixin.prepare_inputs_for_generation"):
        model._assisted_decoding(*call, assistant_model=drafter)
    with pytest.raises(TransformersCompatibilityError, match="takes no `cache` parameter"):
        custom_generate_for(drafter)(model, *call)


def routes(target, ids, seed: int = 1, **kwargs):
    """(assistant_model= result, its stats, custom_generate= result, its stats), each with a fresh drafter built
    alike, since a drafter carries planning state from one call to the next."""
    results = []
    for route in ("assistant_model", "custom_generate"):
        drafter = tiny_drafter(target, "markov", block_size=4, seed=seed)
        drafter.generation_config.dspark_learn_round_costs = False  # rounds planned alike, whatever the timings
        torch.manual_seed(7)
        if route == "assistant_model":
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=MAX_NEW, **kwargs)
        else:
            out = target.generate(ids, custom_generate=custom_generate_for(drafter), max_new_tokens=MAX_NEW, **kwargs)
        results += [out, drafter.last_generation_stats]
    return results


def same_rounds(first, second) -> bool:
    return (first.draft_lengths, first.accepted, first.sources) == (second.draft_lengths, second.accepted,
                                                                   second.sources)


def test_greedy_custom_generate_equals_plain_greedy_and_the_assistant_route_at_batch_1():
    target = tiny_target("llama")
    ids = prompts(1)[0]
    plain = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
    by_assistant, assistant_stats, by_custom, custom_stats = routes(target, ids, do_sample=False)
    assert torch.equal(by_custom, plain) and torch.equal(by_assistant, plain)
    assert custom_stats.num_rounds > 0 and same_rounds(custom_stats, assistant_stats)

    # return_dict_in_generate: the same output object, field by field.
    options = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    by_assistant, _, by_custom, custom_stats = routes(target, ids, **options)
    assert type(by_custom) is type(by_assistant) is hf_dspark.SpeculativeDecoderOnlyOutput
    assert torch.equal(by_custom.sequences, plain)
    assert len(by_custom.scores) == len(by_custom.logits) == MAX_NEW
    assert all(torch.equal(a, b) for a, b in zip(by_custom.scores, by_assistant.scores))
    assert all(torch.equal(a, b) for a, b in zip(by_custom.logits, by_assistant.logits))
    assert by_custom.speculative_stats is custom_stats


def test_greedy_custom_generate_equals_plain_greedy_and_the_assistant_route_for_a_left_padded_batch():
    target = tiny_target("llama")
    prompt_list = prompts(2)
    ids, mask = left_pad(prompt_list)
    assert not bool(mask.all())  # the prompts differ in length: row 0 is padded
    plain = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompt_list]
    by_assistant, assistant_stats, by_custom, custom_stats = routes(target, ids, attention_mask=mask, do_sample=False)
    assert torch.equal(by_custom, by_assistant)
    assert torch.equal(by_custom[:, : ids.shape[1]], ids)  # stock generate's layout: the prompts as given
    for row, row_mask, expected in zip(by_custom, mask, plain):  # no EOS: every row runs to max_new_tokens
        assert torch.equal(row[int((row_mask == 0).sum()) :], expected)
    assert custom_stats.num_rounds > 0 and same_rounds(custom_stats, assistant_stats)


def test_sampled_custom_generate_records_stats_and_matches_the_assistant_route():
    target = tiny_target("llama")
    ids = prompts(1)[0]
    by_assistant, assistant_stats, by_custom, custom_stats = routes(target, ids, do_sample=True, temperature=0.8)
    assert by_custom.shape[1] - ids.shape[1] == MAX_NEW
    # The prefill emits one token, then every round its accepted drafts plus one target token; the last round
    # reaches max_new_tokens (and may be cut there).
    emitted = [accepted + 1 for accepted in custom_stats.accepted]
    assert custom_stats.num_rounds > 0 and 1 + sum(emitted[:-1]) < MAX_NEW <= 1 + sum(emitted)
    # The same loop under the same seed: the same samples and rounds.
    assert torch.equal(by_custom, by_assistant) and same_rounds(custom_stats, assistant_stats)


def test_custom_generate_refuses_what_assisted_generation_refuses():
    target = tiny_target("llama")
    decode = custom_generate_for(tiny_drafter(target))
    ids = prompts(1)[0]
    with pytest.raises(UserInputError, match="num_beams=2"):
        target.generate(ids, custom_generate=decode, num_beams=2, do_sample=False, max_new_tokens=4)
    with pytest.raises(UserInputError, match="num_return_sequences=2"):
        target.generate(ids, custom_generate=decode, do_sample=True, num_return_sequences=2, max_new_tokens=4)
    with pytest.raises(UserInputError, match="expects an hf_dspark drafter.*LlamaForCausalLM"):
        custom_generate_for(tiny_target("llama", seed=5))
    other = tiny_target("llama", hidden_size=32)
    with pytest.raises(hf_dspark.DrafterTargetMismatchError):
        other.generate(ids, custom_generate=decode, do_sample=False, max_new_tokens=4)


def test_other_assistants_run_stock_transformers_code(monkeypatch):
    def not_ours(*args, **kwargs):
        raise AssertionError("a generate() call without an hf_dspark drafter reached hf_dspark's loop")

    monkeypatch.setattr(integration, "speculative_decoding", not_ours)
    built = []
    stock_generator = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):  # called by the stock `_assisted_decoding` only
        built.append(type(generator := stock_generator(self, *args, **kwargs)).__name__)
        return generator

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    target = tiny_target("llama")
    ids = prompts(1)[0]
    plain = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
    assistant = tiny_target("llama", seed=5)
    calls = {"assisted": ("AssistedCandidateGenerator", lambda: target.generate(
                 ids, assistant_model=assistant, do_sample=False, max_new_tokens=MAX_NEW)),
             "prompt lookup": ("PromptLookupCandidateGenerator", lambda: target.generate(
                 ids, prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=MAX_NEW))}
    for name, (generator, call) in calls.items():
        stock_outcome, hooked = with_and_without_hf_dspark(monkeypatch, call)
        assert built[-2:] == [generator] * 2, built  # stock code built its candidate generator, both times
        assert hooked == stock_outcome, name  # and the wrappers change nothing
        if stock_outcome != ("tokens", plain.tolist()):
            pytest.skip(f"transformers {transformers.__version__} itself: stock greedy {name} decoding of a tiny "
                        f"Llama gives {stock_outcome[:2]}, not plain greedy's tokens, with or without hf_dspark")


def tiny_bart(seed: int):
    torch.manual_seed(seed)
    config = BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        init_std=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                        forced_eos_token_id=None)
    return BartForConditionalGeneration(config).eval()


def test_stock_encoder_decoder_assisted_decoding_still_gets_inputs_tensor(monkeypatch):
    """The stock method runs the assistant's encoder on `inputs_tensor`, which generate() passes only to a decoding
    method whose signature lists it: the wrapper's must. Compared with the wrappers bypassed: the same encoder
    input reaches the stock candidate generator and the call ends the same way (tokens, or the same error)."""
    target, assistant = tiny_bart(0), tiny_bart(5)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    plain = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
    assert len(set(plain[0].tolist())) > 2  # a real continuation, not one repeated token
    encoder_inputs = []
    stock_generator = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        encoder_inputs.append(kwargs["inputs_tensor"])
        return stock_generator(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    call = lambda: target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=MAX_NEW)  # noqa: E731
    stock_outcome, hooked = with_and_without_hf_dspark(monkeypatch, call)
    assert len(encoder_inputs) == 2 and all(given is not None and torch.equal(given, ids)
                                            for given in encoder_inputs)
    assert hooked == stock_outcome  # the wrapper changes nothing, a failure of transformers' own included
    if stock_outcome[0] == "raised":
        pytest.skip(f"transformers {transformers.__version__} itself fails stock assisted decoding with a tiny BART "
                    f"assistant, with or without hf_dspark: {stock_outcome[1]}: {stock_outcome[2]} (in 5.25.0 the "
                    "assistant's prefill indexes past BartLearnedPositionalEmbedding's table)")
    assert stock_outcome == ("tokens", plain.tolist())
