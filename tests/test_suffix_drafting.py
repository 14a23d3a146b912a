"""Suffix drafting and the per-round planner at batch 1: lossless, used when it pays, skipped when it does not."""

import pytest
import torch

from hf_dspark.generation.round.suffix import SuffixIndex
from hf_dspark.scheduling import VerificationCostTable
from hf_dspark import DraftingState
from hf_dspark.scheduling.round_planner import ProposalStatistics, RoundPlanner, SuffixAcceptance
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
    assert planner.drafter_rate() == pytest.approx(1.36 / 2.5)
    assert planner.choose([], 0) == ("none", 0)
    # 7 tokens at 0.9 each: 1 + 0.9 + ... + 0.9^7 = 5.7 tokens for 2 seconds beats one token per second.
    assert planner.choose([4, 5, 6, 7, 8, 9, 10], 3) == ("suffix", 7)
    assert planner.choose([], 0) == ("none", 0)
    assert planner.choose([], 0) == ("drafter", 0)  # after three rounds without the drafter, probe it
    planner.record_drafter([0.3, 0.2])  # the probe found the drafter still not paying: wait twice as long
    assert [planner.choose([], 0)[0] for _ in range(8)] == ["none"] * 7 + ["drafter"]
    assert statistics.probe_interval == 16
    statistics.suffix = SuffixAcceptance(prior_accepted=1, prior_rejected=9)  # rate 0.1: 1.11 tokens for 2 s
    assert planner.choose([4, 5], 1) == ("none", 0)
    for untimed in (dict(learn_costs=False), dict(timed=False)):  # nothing measured: flat costs
        flat = RoundPlanner(None, has_confidences=False, statistics=ProposalStatistics(), **untimed)
        flat.record_drafter_accepted(0, 3)
        flat.record_forward(1, 5.0)
        flat.record_forward(1, 5.0)
        assert flat.choose([], 0) == ("drafter", 0)  # flat costs: a draft is always worth verifying


@pytest.mark.synthetic_timings
def test_without_a_table_the_planner_prices_rounds_from_its_own_timings():
    """No cost table (a library user's default): plain steps first, timed; then each proposal is priced with the
    forward sizes and drafter passes this loop measured, so a drafter that does not pay for its pass brakes."""
    statistics = ProposalStatistics(suffix=SuffixAcceptance(prior_accepted=9, prior_rejected=1))  # rate 0.9
    planner = RoundPlanner(None, has_confidences=True, statistics=statistics, probe_every=4)
    assert planner.choose([4, 5, 6], 3) == ("none", 0)  # no plain step timed yet: time one first
    planner.record_forward(1, 9.0)  # a size's first run (cold caches) is not counted
    assert planner.choose([4, 5, 6], 3) == ("none", 0)
    planner.record_forward(1, 1.0)
    assert statistics.forward_seconds == {1: 1.0}
    assert planner.choose([], 0) == ("drafter", 0)  # never measured: run it
    planner.record_draft(5.0)
    planner.record_draft(1.0)  # the drafter's pass costs a plain step
    planner.record_forward(4, 5.0)
    planner.record_forward(4, 1.5)
    assert planner.forward_seconds(4) == 1.5 and planner.forward_seconds(3) == pytest.approx(4 / 3)
    planner.record_drafter([0.6, 0.5, 0.5])  # 1 + 0.6 + 0.3 + 0.15 = 2.05 tokens for 1 + 1.5 s: below a plain step
    assert planner.drafter_rate() == pytest.approx(2.05 / 2.5)
    assert planner.choose([], 0) == ("none", 0)
    # the suffix's 3 tokens at 0.9: 1 + 0.9 + 0.81 + 0.73 = 3.44 tokens for 1.5 s beat a plain step
    assert planner.choose([7, 8, 9], 2) == ("suffix", 3)
    for _ in range(3):  # the pass got cheap (load fell; smoothed): 2.05 tokens for under 1.95 s beat a plain step
        planner.record_draft(0.1)
    assert planner.choose([], 0) == ("drafter", 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("costs", [None, [1.0, 1.3, 1.3, 1.4, 1.4, 1.5], [1.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
def test_suffix_drafting_and_planning_match_plain_greedy(kind, costs):
    target = looping_target()
    drafter = tiny_drafter(target, kind, block_size=5)
    drafter.generation_config.dspark_suffix_drafting = True
    if costs is not None:
        drafter.generation_config.dspark_cost_table = VerificationCostTable(costs, draft_seconds=0.2)
        drafter.generation_config.dspark_learn_round_costs = False  # the table is the truth, not the tiny models' cost
    sources, drafter_calls = [], []
    state = DraftingState()  # the planner learns over all four prompts
    hook = drafter.register_forward_hook(lambda *args: drafter_calls.append(1))
    for ids in prompts(4):
        expected = target.generate(ids, do_sample=False, max_new_tokens=24)
        actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, dspark_state=state)
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
    drafter.generation_config.dspark_suffix_drafting = False
    drafter_rounds = 0
    for ids in prompts(3):
        expected = target.generate(ids, do_sample=False, max_new_tokens=16)
        assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16), expected)
        assert set(drafter.last_generation_stats.sources) <= {"drafter", "none"}
        drafter_rounds += drafter.last_generation_stats.count("drafter")
    assert drafter_rounds >= 1  # the first call runs the drafter once it has timed a plain step (never measured)


def test_shipped_style_configs_turn_suffix_drafting_on(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", suffix_drafting=True)
    drafter.save_pretrained(tmp_path)
    import hf_dspark

    loaded = hf_dspark.DSparkDraftModel.from_pretrained(tmp_path)
    assert loaded.generation_config.dspark_suffix_drafting is True
    assert tiny_drafter(target, "eagle3").generation_config.dspark_suffix_drafting is False


@pytest.mark.synthetic_timings
def test_planner_prices_rounds_with_the_costs_measured_in_the_loop():
    # The table says drafting is nearly free and a 4-token forward costs 1.2 plain steps.
    costs = VerificationCostTable([1.0, 1.2, 1.2, 1.2], draft_seconds=0.01)
    statistics = ProposalStatistics()
    planner = RoundPlanner(costs, has_confidences=True, statistics=statistics)
    assert planner.forward_seconds(1) == pytest.approx(1.0) and planner.draft_seconds() == pytest.approx(0.01)
    planner.record_drafter([0.4, 0.3, 0.2])  # 1.55 expected tokens for 0.01 + 1.2 s: beats a plain step
    assert planner.choose([], 0) == ("drafter", 0)
    # The first run of each size (and of the drafter) in a call may compile or warm caches: not counted.
    planner.record_forward(1, 30.0)
    planner.record_draft(30.0)
    assert statistics.forward_seconds == {} and statistics.draft_seconds is None
    # Measured here: plain steps cost 2 s (the machine is busier than when profiled), the drafter's pass 1.5 s.
    planner.record_forward(1, 2.0)
    planner.record_draft(1.5)
    assert planner.forward_seconds(1) == pytest.approx(2.0) and planner.draft_seconds() == pytest.approx(1.5)
    assert planner.forward_seconds(4) == pytest.approx(1.2 * 2.0)  # not run yet: the table's shape, measured level
    planner.record_forward(4, 5.0)  # warm-up, ignored
    planner.record_forward(4, 2.2)
    planner.record_forward(4, 3.2)  # smoothed
    assert planner.forward_seconds(4) == pytest.approx(2.2 + planner.cost_smoothing * 1.0)
    estimate = planner.forward_seconds(4)
    planner.record_forward(4, 1000.0)  # a burst of other load: clipped to twice the estimate
    assert planner.forward_seconds(4) == pytest.approx(estimate * (1 + planner.cost_smoothing))
    planner.record_forward(9, 50.0)  # beyond the table (a long proposal or a prefill): not a priced round size
    assert 9 not in statistics.forward_seconds
    planner.record_drafter([0.4, 0.3, 0.2])  # 1.55 tokens now cost 1.5 + about 3 s: a plain step pays more
    assert planner.choose([], 0) == ("none", 0)
    # Switched off, the table alone prices rounds.
    table_only = RoundPlanner(costs, has_confidences=True, statistics=ProposalStatistics(), learn_costs=False)
    for _ in range(3):
        table_only.record_forward(1, 2.0)
        table_only.record_draft(1.5)
    assert table_only.statistics.forward_seconds == {} and table_only.draft_seconds() == pytest.approx(0.01)


class SimulatedClock:
    """The loop's clock (`PhaseClock` reads `time.perf_counter`), advanced only by the forwards themselves: the
    rounds' costs are what the test says, whatever the machine's speed or load."""

    def __init__(self):
        self.seconds = 0.0

    def perf_counter(self) -> float:
        return self.seconds

    def costs(self, seconds: float):
        def advance(*args):
            self.seconds += seconds

        return advance


@pytest.mark.synthetic_timings
def test_a_drafter_slower_than_its_table_says_is_skipped_and_output_stays_exact(monkeypatch):
    """A table that underprices drafting (profiled elsewhere) would draft every round; timed in the loop, the
    drafter's real cost (here 40 ms a pass on the loop's clock, beside 1 ms target forwards) turns most rounds into
    plain steps or suffix proposals, and greedy output is unchanged either way."""
    from hf_dspark.generation.round import stats as stats_module

    clock = SimulatedClock()
    monkeypatch.setattr(stats_module, "time", clock)
    target = looping_target()
    target.register_forward_hook(clock.costs(1e-3))
    sources = {}
    for learn in (False, True):
        drafter = tiny_drafter(target, "markov", block_size=4)
        drafter.generation_config.update(dspark_suffix_drafting=False, dspark_learn_round_costs=learn,
                                         dspark_cost_table=VerificationCostTable([1e-3] * 5, draft_seconds=0.0))
        state = DraftingState()  # measured costs carry from the first prompt to the second
        drafter.register_forward_hook(clock.costs(0.04))
        sources[learn] = []
        for ids in prompts(2):
            expected = target.generate(ids, do_sample=False, max_new_tokens=32)
            assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=32,
                                               dspark_state=state), expected)
            sources[learn] += drafter.last_generation_stats.sources
        if learn:
            measured = state.statistics
            assert measured.draft_seconds >= 0.04 and set(measured.forward_seconds) <= set(range(1, 6))
    assert sources[False].count("drafter") > 0.8 * len(sources[False])
    assert sources[True].count("drafter") < 0.3 * len(sources[True])
