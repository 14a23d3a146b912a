"""`target.generate(left-padded batch, assistant_model=drafter)` runs the batched engine: each row equals the prompt's
own plain greedy output, laid out as stock `generate` lays out a batch; the `dspark_verification_policy` setting decides
how many drafts are verified; options the engine cannot honour fail loudly instead of being ignored."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_dspark.generation import DraftingPlan
from hf_dspark.policy import DSparkScheduler, VerificationCostTable
from factories import prompts, tiny_drafter, tiny_target
from batch_helpers import left_pad
from batch_helpers import unpadded_rows

MAX_NEW = 12


def plain_outputs(target, prompt_list, **kwargs) -> list[list[int]]:
    return [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW, **kwargs)[0].tolist() for p in prompt_list]


@pytest.mark.parametrize("kind", ["markov", "dflash", "dflash2"])
def test_greedy_batch_matches_plain_greedy_per_prompt(kind):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4)
    prompt_list = prompts(3)
    ids, mask = left_pad(prompt_list)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=MAX_NEW, return_dict_in_generate=True)
    result = out.sequences
    assert result.shape == (3, ids.shape[1] + MAX_NEW)
    assert torch.equal(result[:, : ids.shape[1]], ids)  # prompts as given, left padding included
    assert unpadded_rows(result, mask, pad=0) == plain_outputs(target, prompt_list)  # each request's own sequence

    stats = drafter.last_generation_stats
    assert len(out.request_stats) == 3 and stats.num_rounds == sum(s.num_rounds for s in out.request_stats) > 0
    assert 0 < max(stats.draft_lengths) <= 4  # the round planner drafts (a first round, probes), within the block


def test_rows_that_stop_at_eos_are_padded_on_the_right():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(3)
    free = plain_outputs(target, prompt_list)
    first = free[0][prompt_list[0].shape[1] :]
    eos = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i])  # row 0 stops mid-way
    ids, mask = left_pad(prompt_list)
    pad = 95
    result = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                             max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=pad)
    expected = plain_outputs(target, prompt_list, eos_token_id=eos)
    assert len(expected[0]) < len(free[0])
    assert unpadded_rows(result, mask, pad) == expected
    longest = max(len(e) - p.shape[1] for e, p in zip(expected, prompt_list))
    assert result.shape[1] == ids.shape[1] + longest
    assert result[0, ids.shape[1] + len(expected[0]) - prompt_list[0].shape[1] :].eq(pad).all()


def test_sampling_with_top_k_one_is_greedy():
    """do_sample with top_k=1 reaches the engine as a sampled request whose every distribution is one-hot."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(3)
    ids, mask = left_pad(prompt_list)
    result = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True, top_k=1,
                             temperature=0.6, max_new_tokens=MAX_NEW)
    assert unpadded_rows(result, mask, pad=0) == plain_outputs(target, prompt_list)


def test_return_dict_carries_the_merged_stats():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    ids, mask = left_pad(prompts(2))
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=MAX_NEW, return_dict_in_generate=True)
    assert out.sequences.shape == (2, ids.shape[1] + MAX_NEW)
    assert out.speculative_stats is drafter.last_generation_stats and out.speculative_stats.num_rounds > 0


# ---------------------------------------------------------------------------------------------------------
# The drafter's verification policy
# ---------------------------------------------------------------------------------------------------------


def test_verification_policy_is_honoured():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(3)
    ids, mask = left_pad(prompt_list)
    expected = plain_outputs(target, prompt_list)

    drafter.generation_config.dspark_round_planning = False  # every round drafts: the policy alone decides
    def run(policy):
        drafter.generation_config.dspark_verification_policy = policy
        result = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                                 max_new_tokens=MAX_NEW)
        assert unpadded_rows(result, mask, pad=0) == expected
        return drafter.last_generation_stats

    assert sum(run(("threshold", 1.5)).draft_lengths) == 0  # no survival reaches 1.5
    assert max(run(("fixed", 1)).draft_lengths) == 1
    assert max(run("all").draft_lengths) == 4
    scheduler = DSparkScheduler(VerificationCostTable([1.0 + 0.15 * i for i in range(40)]))
    calls = []
    original = scheduler.select_lengths
    scheduler.select_lengths = lambda *a, **k: calls.append(1) or original(*a, **k)
    stats = run(scheduler)
    assert calls and max(stats.draft_lengths) < 4  # the engine called it, and it verified less than every slot


def test_default_policy_follows_the_batch_one_attributes():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    settings = drafter.generation_config
    plan = DraftingPlan.for_call(drafter)
    # A confidence head: the admission rule on the loop's own cost model (a table, when set, its starting prices).
    assert (plan.policy, plan.policy_arg) == ("scheduler", None)
    settings.dspark_cost_table = VerificationCostTable([1.0, 1.2, 1.4])
    plan = DraftingPlan.for_call(drafter)
    rule = plan.length_rule(plan.cost_model())
    assert rule.policy_arg.costs.table is settings.dspark_cost_table
    settings.assistant_confidence_threshold = 0.4  # a threshold the user set is the rule
    plan = DraftingPlan.for_call(drafter)
    assert (plan.policy, plan.policy_arg) == ("threshold", 0.4)
    dflash = tiny_drafter(target, "dflash")
    dflash.generation_config.update(assistant_confidence_threshold=0.4, dspark_cost_table=settings.dspark_cost_table)
    plan = DraftingPlan.for_call(dflash)
    assert (plan.policy, plan.policy_arg) == ("all", None)  # no confidence head: both are ignored, as at R=1

    settings.assistant_confidence_threshold = 1.5  # and generate() uses it
    ids, mask = left_pad(prompts(2))
    settings.dspark_cost_table = None
    target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=6)
    assert sum(drafter.last_generation_stats.draft_lengths) == 0


# ---------------------------------------------------------------------------------------------------------
# What a batch cannot do
# ---------------------------------------------------------------------------------------------------------


class StopNever(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class Collect(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize("options,message", [
    (dict(repetition_penalty=1.3), "repetition_penalty"),
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
    (dict(min_new_tokens=3, eos_token_id=5), "min_new_tokens"),
    (dict(do_sample=True, min_p=0.1), "min_p"),
    (dict(logits_processor=[RepetitionPenaltyLogitsProcessor(1.2)]), "repetition_penalty"),
    (dict(stopping_criteria=StoppingCriteriaList([StopNever()])), "custom stopping criterion StopNever"),
    (dict(max_time=5.0), "max_time"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
    (dict(streamer=Collect()), "streamer"),
])
def test_unsupported_options_raise(options, message):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    ids, mask = left_pad(prompts(2))
    with pytest.raises(ValueError, match=message) as error:
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, **options)
    assert "one prompt at a time" in str(error.value)


def test_right_padding_raises():
    target = tiny_target("llama")
    ids, mask = left_pad(prompts(2))
    with pytest.raises(ValueError, match="left-padded"):
        target.generate(ids.flip(1), attention_mask=mask.flip(1), assistant_model=tiny_drafter(target, "markov"),
                        max_new_tokens=4)
