"""Drafting settings the transformers way: defaults in the drafter's `generation_config` (saved and loaded with it),
overridable per `generate()` call, resolved once per call; what rounds learn lives in an explicit `DraftingState`."""

import pytest
import torch
from transformers import GenerationConfig

import hf_dspark
from hf_dspark import DraftingState
from hf_dspark.policy import VerificationCostTable
from factories import prompts, tiny_drafter, tiny_target

COSTS = VerificationCostTable([1.0, 1.1, 1.2, 1.3, 1.4], draft_seconds=0.2, description={"device": "test"})


def looping_target():
    """Small weights: greedy text falls into loops, so suffix drafting and the planner have something to learn."""
    return tiny_target("llama", initializer_range=0.08)


def rounds(out):
    stats = out.speculative_stats
    return list(zip(stats.sources, stats.draft_lengths, stats.accepted))


def test_settings_round_trip_through_save_and_load(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov")
    assert drafter.generation_config.num_assistant_tokens is None  # every slot by default
    drafter.generation_config.update(num_assistant_tokens=2, assistant_confidence_threshold=0.3,
                                     dspark_confidence_threshold_rule="per_slot", dspark_suffix_drafting=True,
                                     dspark_round_planning=False, dspark_cost_table=COSTS,
                                     dspark_learn_round_costs=False, dspark_verification_policy=("fixed", 2),
                                     dspark_time_phases=True)
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").is_file()
    loaded = type(drafter).from_pretrained(tmp_path)
    saved = loaded.generation_config
    assert (saved.num_assistant_tokens, saved.assistant_confidence_threshold) == (2, 0.3)
    assert (saved.dspark_confidence_threshold_rule, saved.dspark_suffix_drafting, saved.dspark_round_planning,
            saved.dspark_learn_round_costs, saved.dspark_time_phases) == ("per_slot", True, False, False, True)
    assert list(saved.dspark_verification_policy) == ["fixed", 2]
    settings = hf_dspark.generation.DraftingSettings.resolve(loaded)
    assert settings.cost_table == COSTS  # saved as its fields, read back as a table
    assert settings.verification_policy == ("fixed", 2)


def test_a_folder_without_generation_config_gets_the_defaults_seeded_by_its_config(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", suffix_drafting=True)
    drafter.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    loaded = type(drafter).from_pretrained(tmp_path)
    assert loaded.generation_config.dspark_suffix_drafting is True  # from config.suffix_drafting
    assert loaded.generation_config.dspark_round_planning is True


def test_a_scheduler_object_is_not_saved_silently(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov")
    drafter.generation_config.dspark_verification_policy = hf_dspark.DSparkScheduler(COSTS)
    with pytest.raises(ValueError, match="dspark_verification_policy"):
        drafter.save_pretrained(tmp_path)


@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
def test_per_call_settings_override_the_drafter_defaults_for_that_call_only(route):
    torch.manual_seed(0)
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    before = drafter.generation_config.to_dict()
    (input_ids,) = prompts(1)

    def generate(**settings):
        how = {"assistant_model": drafter} if route == "assistant_model" else \
            {"custom_generate": hf_dspark.custom_generate_for(drafter)}
        return target.generate(input_ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                               dspark_round_planning=False, dspark_verification_policy="all", **how, **settings)

    plain = target.generate(input_ids, max_new_tokens=24, do_sample=False)
    short = generate(num_assistant_tokens=2)
    assert short.sequences.tolist() == plain.tolist()
    assert max(short.speculative_stats.draft_lengths) == 2
    full = generate()
    assert full.sequences.tolist() == plain.tolist()
    assert max(full.speculative_stats.draft_lengths) == drafter.config.num_draft_slots
    assert drafter.generation_config.to_dict() == before  # a call's settings never land on the drafter
    drafter.generation_config.num_assistant_tokens = 3  # the drafter's own default, used when a call sets none
    assert max(generate().speculative_stats.draft_lengths) == 3


def test_a_generation_config_object_carries_settings_too():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    (input_ids,) = prompts(1)
    config = GenerationConfig(max_new_tokens=16, do_sample=False, num_assistant_tokens=1, dspark_round_planning=False,
                              return_dict_in_generate=True)
    out = target.generate(input_ids, assistant_model=drafter, generation_config=config)
    assert max(out.speculative_stats.draft_lengths) == 1


@pytest.mark.parametrize("settings, message", [
    ({"num_assistant_tokens": 9}, "num_assistant_tokens"),
    ({"num_assistant_tokens": 0}, "num_assistant_tokens"),
    ({"assistant_confidence_threshold": -1}, "assistant_confidence_threshold"),
    ({"dspark_confidence_threshold_rule": "median"}, "dspark_confidence_threshold_rule"),
    ({"dspark_suffix_drafting": "yes"}, "dspark_suffix_drafting"),
    ({"dspark_verification_policy": "greedy"}, "dspark_verification_policy"),
    ({"dspark_verification_policy": ("fixed", -1)}, "fixed"),
    ({"dspark_cost_table": 3}, "dspark_cost_table"),
    ({"dspark_state": {}}, "dspark_state"),
    ({"dspark_not_a_setting": 1}, "dspark_not_a_setting"),
])
def test_bad_settings_are_refused_before_any_token(settings, message, monkeypatch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    (input_ids,) = prompts(1)
    forwards = []
    monkeypatch.setattr(type(target), "forward", lambda *a, **k: forwards.append(1) or pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match=message):
        target.generate(input_ids, assistant_model=drafter, max_new_tokens=8, do_sample=False, **settings)
    assert forwards == []


def test_calls_without_a_state_learn_into_their_drafters_own_and_a_given_state_replaces_it():
    """Round planning with suffix drafting and flat prices (no cost table, no timings) is deterministic but learns
    from every round: a call without `dspark_state` learns into its drafter's own state for this target, which the
    next such call starts from (planning exactly as a call given that state would); a call given a fresh state plans
    as on a fresh drafter."""
    target = looping_target()
    (first,) = prompts(1, seed=3)
    (second,) = prompts(1, seed=4)
    fresh = tiny_drafter(target, "markov", block_size=4)
    used = tiny_drafter(target, "markov", block_size=4)
    call = dict(max_new_tokens=40, do_sample=False, return_dict_in_generate=True, dspark_suffix_drafting=True,
                dspark_learn_round_costs=False)
    alone = target.generate(second, assistant_model=fresh, dspark_state=DraftingState(), **call)
    target.generate(first, assistant_model=used, **call)  # no state given: `used`'s own learns
    assert rounds(target.generate(second, assistant_model=used, dspark_state=DraftingState(), **call)) == rounds(alone)
    mirror = DraftingState()  # what `used`'s own state went through
    target.generate(first, assistant_model=fresh, dspark_state=mirror, **call)
    expected = target.generate(second, assistant_model=fresh, dspark_state=mirror, **call)
    after = target.generate(second, assistant_model=used, **call)
    assert rounds(after) == rounds(expected) != rounds(alone)
    assert after.sequences.tolist() == alone.sequences.tolist()  # lossless whatever was learnt
    twin = looping_target()  # the same weights in another model: the drafter's own state for it starts fresh
    assert rounds(twin.generate(second, assistant_model=used, **call)) == rounds(alone)

    state = DraftingState()
    target.generate(first, assistant_model=used, dspark_state=state, **call)
    learnt = state.to_dict()
    assert learnt["suffix"]["matches"]
    shared = target.generate(second, assistant_model=used, dspark_state=state, **call)
    assert shared.sequences.tolist() == alone.sequences.tolist()  # lossless whatever was learnt
    assert state.to_dict() != learnt  # the second call learnt on top of the first
    replay = DraftingState.from_dict(learnt)  # a saved state replays the same rounds
    again = target.generate(second, assistant_model=fresh, dspark_state=replay, **call)
    assert rounds(again) == rounds(shared)


def test_a_drafting_state_saves_loads_and_resets(tmp_path):
    target = looping_target()
    drafter = tiny_drafter(target, "markov", block_size=4)
    state = DraftingState()
    (input_ids,) = prompts(1, seed=3)
    target.generate(input_ids, assistant_model=drafter, max_new_tokens=32, do_sample=False,
                    dspark_suffix_drafting=True, dspark_cost_table=COSTS, dspark_state=state)
    state.save(tmp_path / "state.json")
    assert DraftingState.load(tmp_path / "state.json") == state
    assert state.statistics.suffix.matches and state.round_costs  # learnt costs are kept (in memory, not saved)
    state.reset()
    assert state == DraftingState()
    with pytest.raises(ValueError, match="DraftingState"):
        DraftingState.from_dict({"bogus": 1})


def test_the_drafter_holds_no_decoding_state():
    target = looping_target()
    drafter = tiny_drafter(target, "markov", block_size=4)
    names = set(vars(drafter))
    (input_ids,) = prompts(1, seed=3)
    target.generate(input_ids, assistant_model=drafter, max_new_tokens=16, do_sample=False,
                    dspark_suffix_drafting=True)
    assert set(vars(drafter)) - names <= {"last_generation_stats"}
    for old in ("num_draft_tokens", "confidence_threshold", "verification_costs", "round_planning",
                "suffix_drafting", "proposal_statistics", "verification_policy", "time_phases", "last_batch_output"):
        assert not hasattr(drafter, old), old


def test_setting_a_former_drafter_attribute_names_the_option_that_replaced_it():
    drafter = tiny_drafter(tiny_target("llama"), "markov")
    with pytest.raises(AttributeError, match="num_assistant_tokens"):
        drafter.num_draft_tokens = 2
    with pytest.raises(AttributeError, match="dspark_cost_table"):
        drafter.verification_costs = COSTS
    with pytest.raises(AttributeError, match="DraftingState"):
        drafter.proposal_statistics = None


def test_settings_reach_a_custom_generate_callable_given_beside_assistant_model():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    (input_ids,) = prompts(1)
    out = target.generate(input_ids, assistant_model=drafter, custom_generate=hf_dspark.custom_generate_for(drafter),
                          max_new_tokens=16, do_sample=False, return_dict_in_generate=True, num_assistant_tokens=1,
                          dspark_round_planning=False)
    assert out.sequences.tolist() == target.generate(input_ids, max_new_tokens=16, do_sample=False).tolist()
    assert max(out.speculative_stats.draft_lengths) == 1


def test_an_engine_built_without_settings_takes_the_drafters_defaults():
    from hf_dspark.generation import SpeculativeEngine

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    drafter.generation_config.update(num_assistant_tokens=2, assistant_confidence_threshold=0.5,
                                     dspark_confidence_threshold_rule="per_slot")
    engine = SpeculativeEngine(target, drafter)
    assert (engine.policy, engine.policy_arg, engine.rule.threshold_rule, engine.draft_length) == \
        ("threshold", 0.5, "per_slot", 2)
    explicit = SpeculativeEngine(target, drafter, "all", threshold_rule="cumulative", draft_length=3)
    assert (explicit.policy, explicit.rule.threshold_rule, explicit.draft_length) == ("all", "cumulative", 3)


def test_a_cost_table_given_as_a_path_is_saved_as_the_table_itself(tmp_path):
    drafter = tiny_drafter(tiny_target("llama"), "markov")
    COSTS.save(tmp_path / "costs.json")
    drafter.generation_config.dspark_cost_table = str(tmp_path / "costs.json")
    drafter.save_pretrained(tmp_path / "drafter")
    (tmp_path / "costs.json").unlink()  # the folder travels alone (push_to_hub)
    loaded = type(drafter).from_pretrained(tmp_path / "drafter")
    assert hf_dspark.generation.DraftingSettings.resolve(loaded).cost_table == COSTS


def test_an_unreadable_generation_config_is_an_error_not_the_defaults(tmp_path):
    drafter = tiny_drafter(tiny_target("llama"), "markov")
    drafter.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(hf_dspark.DrafterLoadError, match="generation_config.json"):
        type(drafter).from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@pytest.mark.parametrize("policy", [("threshold", 0.5), "scheduler-object"])
def test_a_confidence_policy_without_a_confidence_head_is_refused_alike_at_every_batch_size(kind, policy):
    """It was verifying every slot at batch 1 (the rule had no confidences to read) and refused at R > 1."""
    from batch_helpers import left_pad

    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4)
    if policy == "scheduler-object":
        policy = hf_dspark.DSparkScheduler(VerificationCostTable([1e-3] * 5))
    forwards = []
    target.register_forward_hook(lambda *args: forwards.append(1))
    one = prompts(1)[0]
    ids, mask = left_pad(prompts(2, length=5) + prompts(1, length=7, seed=9))
    calls = [lambda: target.generate(one, assistant_model=drafter, max_new_tokens=6,
                                     dspark_verification_policy=policy),
             lambda: target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=6,
                                     dspark_verification_policy=policy)]
    for call in calls:
        with pytest.raises(hf_dspark.UserInputError, match="dspark_verification_policy.*no confidence head"):
            call()
    assert forwards == []


def test_a_fixed_policy_bounds_eagle3_chains_and_stays_exact():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "eagle3", block_size=4)
    for ids in prompts(3):
        expected = target.generate(ids, do_sample=False, max_new_tokens=16)
        for k in (0, 1, 2):
            out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                                  dspark_verification_policy=("fixed", k), dspark_suffix_drafting=False,
                                  dspark_round_planning=False)  # every round drafts: the policy alone bounds it
            assert torch.equal(out, expected)
            lengths = drafter.last_generation_stats.draft_lengths
            assert max(lengths) == k, (k, lengths)
