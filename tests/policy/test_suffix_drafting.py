"""Suffix drafting and round planning at batch 1: lossless, used when it pays, skipped when it does not (the planner
itself, the same at every batch size, is tested in test_batch_round_planning.py)."""

import pytest
import torch

from hf_dspark.models.suffix import SuffixIndex
from hf_dspark.policy import VerificationCostTable
from hf_dspark import DraftingState
from hf_dspark.policy.acceptance import SuffixAcceptance
from hf_dspark.policy.costs import CostModel
from hf_dspark.policy.planner import NO_DRAFT, RoundPlan, RoundPolicy
from factories import prompts, tiny_drafter, tiny_target

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


def test_suffix_acceptance_learns_per_match_length_and_token_and_ages_by_rounds():
    acceptance = SuffixAcceptance()
    acceptance.record(2, proposed=4, accepted=4)  # every token reached and accepted
    acceptance.age()  # a round went by
    acceptance.record(2, proposed=4, accepted=1)  # tokens 1 and 2 reached (the rejected one too), token 1 accepted
    acceptance.record(2, proposed=3, accepted=0)  # the same round's other row: token 1 reached, not accepted
    decay = acceptance.matches[2].decay
    assert acceptance.matches[2].reached == pytest.approx([decay + 2, decay + 1, decay, decay])
    assert acceptance.matches[2].accepted == pytest.approx([decay + 1, decay, decay, decay])
    assert acceptance.rates(2, 4) == pytest.approx(acceptance.matches[2].means(4))  # the drafter's posterior form
    assert acceptance.rates(1, 2) == pytest.approx([0.5, 0.5])  # other match lengths keep their own counts


def test_suffix_rates_per_token_tell_a_hard_first_token_from_the_easy_ones_after_it():
    """The first proposed token is accepted a fifth of the time, the later ones always once it was: pooled over the
    tokens that reads about a half, which prices a one-token proposal high and a long one low."""
    acceptance = SuffixAcceptance()
    for proposal in range(200):
        acceptance.record(1, proposed=4, accepted=4 if proposal % 5 == 0 else 0)
        acceptance.age()
    first, *later = acceptance.rates(1, 4)
    assert first == pytest.approx(0.2, abs=0.06) and min(later) > 0.85, (first, later)


def test_a_round_ages_the_suffix_counts_once_whatever_its_rows():
    """Many rows score many proposals a round; the counts age by rounds, so sixteen rows keep sixteen times the
    evidence of one rather than the same last few proposals."""
    for rows in (1, 16):
        acceptance = SuffixAcceptance()
        acceptance.record(3, proposed=2, accepted=2)
        policy = RoundPolicy(4, planning=True, costs=CostModel(), suffix_acceptance=acceptance)
        plan = RoundPlan(False, [NO_DRAFT] * rows, [0] * rows)
        policy.record(plan, list(range(rows)), [0] * rows, [0] * rows, 1, policy.drafted())
        decay = acceptance.matches[3].decay
        assert acceptance.matches[3].reached == pytest.approx([decay] * 2) == acceptance.matches[3].accepted


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
        # Verifying two tokens costs three plain steps, six no more: a round pays only by emitting three tokens or
        # more, which the random drafter never does; it runs in few rounds (those its posterior's draws try).
        assert sources.count("drafter") < 0.3 * len(sources)
        assert len(drafter_calls) < 0.3 * len(sources)
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
    """A table that underprices drafting (profiled elsewhere) would draft whenever drafts are expected to pay; timed
    in the loop, the drafter's real cost (here 40 ms a pass on the loop's clock, beside 1 ms target forwards) turns
    most rounds into plain steps, and greedy output is unchanged either way."""
    from hf_dspark.policy import planner as planning_module
    from hf_dspark.generation.round import stats as stats_module

    clock = SimulatedClock()
    monkeypatch.setattr(stats_module, "time", clock)
    monkeypatch.setattr(planning_module, "time", clock)
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
        if learn:  # measured on the loop's clock: a plain step takes 1 ms, the drafter's pass 40
            (measured,) = state.round_costs.values()
            assert measured.forwards[1, 1] == pytest.approx(1e-3)
            assert measured.drafts[1] == pytest.approx(0.04)
    # Priced by the table, the drafter runs whenever its drafts are expected to pay at all (most rounds: its pass is
    # free there); priced by its measured pass, a fifth as often at most (the rounds its posterior draws try it).
    assert sources[False].count("drafter") > 0.25 * len(sources[False])
    assert 5 * sources[True].count("drafter") < sources[False].count("drafter")
