"""Suffix drafting and the per-round planner at batch 1: lossless, used when it pays, skipped when it does not."""

import pytest
import torch

from hf_dspark.generation.suffix import SuffixIndex
from hf_dspark.scheduling import VerificationCostTable
from hf_dspark.scheduling.draft_length import ProposalStatistics, RoundPlanner, SuffixAcceptance
from conftest import prompts, tiny_drafter, tiny_target

KINDS = ["markov", "dflash", "eagle3"]


def looping_target(family: str = "llama"):
    """A tiny target with small weights: like small real models, its greedy text falls into loops and repeats
    ("84 43 84 43 ..."), which is what suffix drafting continues."""
    return tiny_target(family, initializer_range=0.08)


def test_suffix_index_proposes_what_followed_the_latest_longest_match():
    index = SuffixIndex(max_ngram=3, max_tokens=4)
    index.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # "6 7" occurred twice before; the longest matching suffix is "6 7" (3-gram "2 6 7" never occurred) and the
    # latest earlier occurrence is followed by 9, 2, 6, 7.
    assert index.propose() == ([9, 2, 6, 7], 2)
    assert index.propose(limit=2) == ([9, 2], 2)
    index.extend([9])  # "6 7 9" now matches as a 3-gram
    assert index.propose() == ([2, 6, 7, 9], 3)
    assert SuffixIndex().propose() == ([], 0)
    lone = SuffixIndex()
    lone.extend([3, 4])
    assert lone.propose() == ([], 0)  # the suffix itself is never its own match


def test_suffix_acceptance_learns_per_match_length():
    acceptance = SuffixAcceptance(prior_accepted=1, prior_rejected=1, decay=0.5)
    assert acceptance.rate(2) == pytest.approx(0.5)
    acceptance.record(2, proposed=4, accepted=4)  # 4 reached, 4 accepted
    acceptance.record(2, proposed=4, accepted=1)  # 2 reached (the rejected one too), 1 accepted; older halved
    assert acceptance.rate(2) == pytest.approx((0.5 * 4 + 1 + 1) / (0.5 * 4 + 2 + 2))
    assert acceptance.rate(1) == pytest.approx(0.5)  # other match lengths keep their own counts
    rate = acceptance.rate(2)
    assert acceptance.expected_tokens(2, 3) == pytest.approx(1 + rate + rate**2 + rate**3)


def test_planner_prices_plain_steps_suffix_proposals_and_the_drafter():
    costs = VerificationCostTable([1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0], draft_seconds=0.5)
    statistics = ProposalStatistics(suffix=SuffixAcceptance(prior_accepted=9, prior_rejected=1))  # rate 0.9
    planner = RoundPlanner(costs, has_confidences=True, statistics=statistics, probe_every=4)
    assert planner.choose([], 0) == ("drafter", 0)  # never measured: run it
    planner.record_drafter([0.3, 0.2])  # expected 1.36 tokens for 0.5 + 2.0 seconds: worse than a plain step
    assert statistics.drafter_rate == pytest.approx(1.36 / 2.5)
    assert planner.choose([], 0) == ("none", 0)
    # 7 tokens at 0.9 each: 1 + 0.9 + ... + 0.9^7 = 5.7 tokens for 2 seconds beats one token per second.
    assert planner.choose([4, 5, 6, 7, 8, 9, 10], 3) == ("suffix", 7)
    assert planner.choose([], 0) == ("none", 0)
    assert planner.choose([], 0) == ("drafter", 0)  # after three rounds without the drafter, probe it
    statistics.suffix = SuffixAcceptance(prior_accepted=1, prior_rejected=9)  # rate 0.1: 1.11 tokens for 2 s
    assert planner.choose([4, 5], 1) == ("none", 0)
    flat = RoundPlanner(None, has_confidences=False, statistics=ProposalStatistics())
    flat.record_drafter_accepted(0, 3)
    assert flat.choose([], 0) == ("drafter", 0)  # flat costs: a draft is always worth verifying


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("costs", [None, [1.0, 1.3, 1.3, 1.4, 1.4, 1.5], [1.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
def test_suffix_drafting_and_planning_match_plain_greedy(kind, costs):
    target = looping_target()
    drafter = tiny_drafter(target, kind, block_size=5)
    drafter.suffix_drafting = True
    if costs is not None:
        drafter.verification_costs = VerificationCostTable(costs, draft_seconds=0.2)
    sources, drafter_calls = [], []
    hook = drafter.register_forward_hook(lambda *args: drafter_calls.append(1))
    for ids in prompts(4):
        expected = target.generate(ids, do_sample=False, max_new_tokens=24)
        actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24)
        assert torch.equal(actual, expected)
        stats = drafter.last_generation_stats
        sources += stats.sources
        for source, length, accepted in zip(stats.sources, stats.draft_lengths, stats.accepted):
            assert (source == "none") == (length == 0) and accepted <= length
    if costs is not None and costs[1] == 3.0:
        # Verifying two tokens costs three plain steps: most rounds run without drafts and without the drafter,
        # which is still probed now and then.
        assert sources.count("none") > 0.8 * len(sources)
        assert 0 < len(drafter_calls) < 0.3 * len(sources)
    else:
        assert "suffix" in sources  # loops get continued by the suffix drafter
    hook.remove()


def test_suffix_drafting_off_measures_the_drafter_alone():
    target = looping_target("qwen3")
    drafter = tiny_drafter(target, "markov", block_size=4)
    drafter.suffix_drafting = False
    for ids in prompts(3):
        expected = target.generate(ids, do_sample=False, max_new_tokens=16)
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16), expected)
        assert set(drafter.last_generation_stats.sources) <= {"drafter", "none"}
        assert drafter.last_generation_stats.count("drafter") >= 1


def test_shipped_style_configs_turn_suffix_drafting_on(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", suffix_drafting=True)
    drafter.save_pretrained(tmp_path)
    import hf_dspark

    loaded = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path)
    assert loaded.suffix_drafting is True
    assert tiny_drafter(target, "eagle3").suffix_drafting is False
