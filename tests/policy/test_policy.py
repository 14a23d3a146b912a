"""The verification policy (`hf_dspark.policy`): its cost model, acceptance posteriors and admission rule given the
prices and acceptances they mean (no verdict here depends on this machine's speed), the plans it makes from them, and
the loops it runs in: every row its own plain greedy output, sampling exact at R > 1."""

import math
import random
from collections import Counter

import pytest
import torch

from factories import prompts, tiny_drafter, tiny_target
from hf_dspark import DraftingState
from hf_dspark.generation import batched_speculative_generate
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.policy.acceptance import SlotAcceptance, SuffixAcceptance, survivals
from hf_dspark.models.cost_table import VerificationCostTable
from hf_dspark.policy.costs import LOAD_SMOOTHING, CostModel
from hf_dspark.policy.planner import DRAFTER, NO_DRAFT, SUFFIX, RoundPlan, RoundPolicy
from lossless_checks import assert_three_tokens_match
from batch_helpers import left_pad, plain_greedy, use_oracle
from lossless_checks import TINY_VOCAB, exact_three_token_distribution
from factories import priced, promising_suffix

MAX_NEW = 16


def known(rate: float, slots: int = 8, rounds: int = 200) -> SlotAcceptance:
    """A drafter measured often: every slot accepted at `rate`."""
    acceptance = SlotAcceptance.empty(slots)
    rng = random.Random(0)
    for _ in range(rounds):
        accepted = 0
        while accepted < slots and rng.random() < rate:
            accepted += 1
        acceptance.record(slots, accepted)
    return acceptance


class Text:
    """A request as the policy reads it: its tokens so far."""

    def __init__(self, tokens):
        self.tokens = list(tokens)


# ---------------------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------------------


def test_measured_shapes_are_priced_as_measured_and_others_at_the_least_they_can_cost():
    costs = CostModel()
    assert costs.forward_seconds(3, 4) == 1.0  # nothing measured: every forward alike
    costs.record_forward(1, 1, 1.0)
    costs.record_forward(1, 5, 1.8)
    assert costs.forward_seconds(1, 1) == 1.0 and costs.forward_seconds(1, 5) == 1.8
    # Never measured: at least the dearest shape over as few tokens (more tokens never cost less).
    assert costs.forward_seconds(1, 3) == 1.0 and costs.forward_seconds(2, 2) == 1.0
    assert costs.forward_seconds(2, 3) == 1.8 and costs.forward_seconds(8, 8) == 1.8
    costs.record_forward(2, 1, 0.9)  # below every shape over fewer tokens: nothing bounds it but what it cost
    assert costs.forward_seconds(2, 1) == 0.9
    # A plain step never run: the dearest plain step over fewer rows, not the wider rounds over as many tokens (a
    # round of 1 x 5 tokens may cost more than a plain step over 5 rows); with no plain step below, as above.
    assert costs.forward_seconds(5, 1) == 1.0 and costs.forward_seconds(5, 2) == 1.8
    costs.record_forward(3, 1, 1.2)
    assert costs.forward_seconds(5, 1) == 1.2 and costs.forward_seconds(2, 1) == 0.9
    costs.record_forward(1, 1, 2.0)  # a change of load reprices every shape, measured or not
    load = 2.0 ** LOAD_SMOOTHING
    assert costs.load == pytest.approx(load) and costs.forward_seconds(1, 5) == pytest.approx(1.8 * load)
    assert costs.forward_seconds(1, 1) == pytest.approx((2.0 / load) ** 0.5 * load)  # its base: half the rest


def test_a_burst_of_other_work_measured_on_one_shape_leaves_every_price_as_it_was_once_it_ends():
    """A seven-fold burst while only the plain step runs, then ten quiet rounds of another shape: the plain step, not
    run since, is priced within 15 % of its quiet price, not at the burst's (the ratio of the two shapes decides)."""
    costs = CostModel()
    for _ in range(40):  # quiet: both shapes known
        costs.record_forward(16, 1, 0.10)
        costs.record_forward(16, 2, 0.18)
    for _ in range(8):
        costs.record_forward(16, 1, 0.70)
    assert costs.forward_seconds(16, 2) > 0.18 * 4  # the burst reprices the shape it did not touch too
    for _ in range(10):
        costs.record_forward(16, 2, 0.18)
    assert costs.forward_seconds(16, 2) == pytest.approx(0.18, rel=0.05)
    assert costs.forward_seconds(16, 1) == pytest.approx(0.10, rel=0.12)


def test_a_shape_nothing_bounds_is_tried_next_and_a_table_prices_what_was_not_measured():
    costs = CostModel()
    costs.record_forward(4, 8, 2.0)
    assert costs.forward_seconds(4, 1) < 1e-6  # no shape over as few tokens measured: the next one tried
    table = VerificationCostTable([1.0 + 0.25 * n for n in range(32)])
    costs = CostModel(table)
    assert costs.forward_seconds(2, 2) == pytest.approx(1.75)  # the table's own price before any run
    costs.record_forward(2, 1, 2.0)  # slower than the table says (load): a bound the table cannot go under
    assert costs.forward_seconds(2, 2) == 2.0 and costs.forward_seconds(4, 4) == pytest.approx(4.75)


def test_before_drafting_the_plan_takes_the_best_width_past_a_jump_and_the_rule_after_drafting_crosses_it():
    """One row on a CPU: a jump at four tokens (a kernel change), then 5 % a token. At an acceptance of 0.9 the plan
    verifies six drafts (the jump repaid), at 0.3 two; after drafting, confidences at the estimates admit the
    plan's width, and without the estimates the next slot alone never crosses the jump."""
    from hf_dspark.policy.admission import admitted_width, best_width
    costs = CostModel()
    for width, seconds in enumerate([35.7, 38.4, 40.2, 54.3, 55.8, 59.4, 63.6, 72.2], start=1):
        costs.record_forward(1, width, seconds)
    prices = costs.forward_prices(1, 8)
    widths = {}
    for rate in (0.9, 0.3):
        survival = torch.tensor([[rate ** j for j in range(1, 8)]])
        expected = [1.0 + float(survival[0, :count].sum()) for count in range(8)]
        widths[rate] = best_width(expected, prices)
        assert int(admitted_width(survival, prices, ahead=[rate] * 7)) == widths[rate]
    assert widths == {0.9: 7, 0.3: 3}  # six drafts past the jump at four tokens; two before it
    assert int(admitted_width(torch.tensor([[0.9 ** j for j in range(1, 8)]]), prices)) == 3


def test_confidence_calibration_learns_the_level_and_how_much_the_head_tells():
    from hf_dspark.policy.acceptance import ConfidenceShift
    rng = random.Random(0)
    blind, sharp = ConfidenceShift(), ConfidenceShift()
    for _ in range(3000):
        low = [rng.uniform(0.1, 0.3) for _ in range(3)]  # a head that reads low, drafts accepted 0.9 of the time
        blind.record(low, next((j for j in range(3) if rng.random() > 0.9), 3))
        told = [rng.choice([0.2, 0.8])]  # a head that knows: accepted exactly when it says 0.8
        sharp.record(told, 1 if told[0] == 0.8 else 0)
    calibrated = blind.apply(torch.tensor([[0.1, 0.2, 0.3]]))[0]
    assert calibrated.min() > 0.8 and calibrated.max() - calibrated.min() < 0.05  # its level, not its ranking
    assert sharp.apply(torch.tensor([[0.2, 0.8]])).tolist()[0] == pytest.approx([0, 1], abs=0.1) and sharp.slope > 1.0


def test_confidence_calibration_follows_a_miscalibrated_head_within_a_few_rounds():
    """A cold start: a head that reads 0.1-0.3 where 0.9 of drafts are accepted reads above 0.8 after eight rounds of
    a seven-slot block at one row (the median of twenty workloads; the stochastic-gradient fit it replaced read 0.78
    there), and a head whose confidences are right stays near where it is."""
    import statistics
    from hf_dspark.policy.acceptance import ConfidenceShift
    levels, errors = [], []
    for seed in range(20):
        rng = random.Random(seed)
        low, right = ConfidenceShift(), ConfidenceShift()
        for _ in range(8):
            low.record([rng.uniform(0.1, 0.3) for _ in range(7)], next((j for j in range(7) if rng.random() > 0.9), 7))
            told = [rng.uniform(0.05, 0.95) for _ in range(7)]
            right.record(told, next((j for j, c in enumerate(told) if rng.random() > c), 7))
        levels.append(float(low.apply(torch.tensor([[0.1, 0.2, 0.3]])).min()))
        read = right.apply(torch.tensor([[0.2, 0.5, 0.8]]))[0].tolist()
        errors.append(max(abs(a - b) for a, b in zip(read, [0.2, 0.5, 0.8])))
    assert statistics.median(levels) > 0.8 and statistics.median(errors) < 0.15


def test_confidence_calibration_reaches_the_mode_from_a_steep_fit():
    """Confidences spread over logits -7..7 and outcomes that ignore them (0.9 accepted): refitted from a steep fit
    (slope 2.1, the state a few early rounds left in a simulated run), the fit reaches the mode that a fit from the prior
    finds, slope about 0 and the level 0.9; full Newton steps capped in length stalled at slope 2.1 (the rule then
    verified one slot of seven at A = 0.9)."""
    import numpy
    from hf_dspark.policy.acceptance import ConfidenceShift
    rng = numpy.random.default_rng(0)
    confidences = 1.0 / (1.0 + numpy.exp(-rng.uniform(-7.0, 7.0, 1000)))
    outcomes = (rng.random(1000) < 0.9).astype(float)
    fits = []
    for start in ((1.0, 0.0), (2.12, 0.67)):
        shift = ConfidenceShift(slope=start[0], shift=start[1])
        shift.confidences.extend(confidences.tolist()), shift.outcomes.extend(outcomes.tolist())
        shift.fit()
        fits.append((shift.slope, shift.shift))
    assert fits[0] == pytest.approx(fits[1], abs=1e-4)
    assert abs(fits[0][0]) < 0.1 and 1.0 / (1.0 + math.exp(-fits[0][1])) == pytest.approx(0.9, abs=0.02)


def test_the_drafter_is_free_until_measured_then_priced_by_rows():
    assert CostModel().draft_seconds(3) == 0.0
    assert CostModel(VerificationCostTable([1.0], draft_seconds=0.3)).draft_seconds(3) == 0.3
    costs = CostModel()
    costs.record_draft(2, 0.2)
    costs.record_draft(4, 0.4)
    assert costs.draft_seconds(3) == 0.2 and costs.draft_seconds(4) == 0.4 and costs.draft_seconds(1) == 0.0


def test_a_model_that_does_not_learn_keeps_its_prices():
    costs = priced(lambda r, w: 1.0)
    costs.record_forward(1, 1, 5.0)
    costs.record_draft(1, 5.0)
    assert costs.forward_seconds(1, 1) == 1.0 and costs.draft_seconds(1) == 0.0


# ---------------------------------------------------------------------------------------------------------
# Acceptance posteriors
# ---------------------------------------------------------------------------------------------------------


def test_slot_acceptance_is_a_beta_posterior_per_slot():
    acceptance = SlotAcceptance.empty(3, decay=1.0)
    assert acceptance.means(3) == [0.5, 0.5, 0.5]  # an even chance, one observation's weight
    for _ in range(3):
        acceptance.record(3, 1)  # slot 1 accepted, slot 2 rejected, slot 3 never reached
    assert acceptance.reached == [3.0, 3.0, 0.0] and acceptance.accepted == [3.0, 0.0, 0.0]
    # Each slot's prior is the slot before's posterior mean (the first's an even chance): slot 2 starts from 3.5 / 4,
    # and slot 3, never reached, reads like slot 2.
    assert acceptance.means(3) == pytest.approx([3.5 / 4, 3.5 / 4 / 4, 3.5 / 4 / 4])
    rng = random.Random(1)
    draws = [acceptance.draws(3, rng)[0] for _ in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(3.5 / 4, abs=0.01)
    assert survivals([0.5, 0.5, 0.2]) == [0.5, 0.25, 0.05]


def test_draws_narrow_as_rounds_accumulate():
    rng = random.Random(2)
    spread = []
    for acceptance in (SlotAcceptance.empty(1), known(0.3, slots=1, rounds=300)):
        draws = [acceptance.draws(1, rng)[0] for _ in range(2000)]
        mean = sum(draws) / len(draws)
        spread.append((sum((d - mean) ** 2 for d in draws) / len(draws)) ** 0.5)
    assert spread[1] < spread[0] / 3


# ---------------------------------------------------------------------------------------------------------
# The admission rule before drafting: plans from given prices and acceptances
# ---------------------------------------------------------------------------------------------------------


def plans(policy, rows: int = 3, budget: int = 4, count: int = 300, explore: bool = True, texts=None):
    texts = texts or [Text([2, 3, 4, 5, 6, 7]) for _ in range(rows)]
    return [policy.plan(list(range(rows)), texts, [budget] * rows, explore=explore) for _ in range(count)]


def test_plain_steps_where_no_acceptance_could_pay():
    """Each verified token costs a plain step (a CPU at many rows): even a drafter that is always right cannot pay
    for its pass, whatever its posterior draws."""
    costs = priced(lambda r, w: 0.01 * r * w, draft=0.002)
    for acceptance in (SlotAcceptance.empty(4), known(1.0, slots=4)):
        policy = RoundPolicy(4, planning=True, costs=costs, delivered=acceptance)
        assert all(not p.use_drafter and p.lengths == [0, 0, 0] for p in plans(policy))


def test_a_good_drafter_on_a_flat_machine_verifies_every_slot():
    costs = priced(lambda r, w: 0.02, draft=0.001)
    policy = RoundPolicy(4, planning=True, costs=costs, delivered=known(0.9, slots=4))
    for plan in plans(policy, count=50):
        assert plan.use_drafter and plan.sources == [DRAFTER] * 3 and plan.lengths == [4, 4, 4]


def test_the_width_stops_where_the_next_slot_costs_more_than_it_brings():
    """One row, 0.5 accepted per slot (survivals 0.5, 0.25, 0.125, ...), each token beyond the anchor +30 %: width 2
    emits 1.5 for 1.3 (1.15), width 3 1.75 for 1.6 (1.09): the rule stops at 2, one draft."""
    costs = priced(lambda r, w: 1.0 + 0.3 * (w - 1))
    policy = RoundPolicy(4, planning=True, costs=costs, delivered=known(0.5, slots=4, rounds=10**4))
    assert {tuple(p.lengths) for p in plans(policy, rows=1, explore=False, count=5)} == {(1,)}


def test_the_loops_own_work_between_rounds_is_priced_into_every_round_and_widens_it():
    """O(R), the loop's seconds between two rounds, is paid by every round: with the prices above and O = 2 forwards,
    width 3 emits 1.75 for 3.6 (0.486 a second) against width 2's 1.5 for 3.3 (0.455): two drafts, not one."""
    costs = priced(lambda r, w: 1.0 + 0.3 * (w - 1))
    costs.overheads[1] = 2.0
    assert costs.forward_prices(1, 2) == pytest.approx([3.0, 3.3])
    policy = RoundPolicy(4, planning=True, costs=costs, delivered=known(0.5, slots=4, rounds=10**4))
    assert {tuple(p.lengths) for p in plans(policy, rows=1, explore=False, count=5)} == {(2,)}


def test_the_policy_times_the_loops_work_between_rounds_but_not_a_prefill():
    now = [0.0]
    policy = RoundPolicy(4, planning=True, costs=CostModel(), clock=lambda: now[0])
    text = [Text([2, 3, 4, 5])]
    for start, interrupted in ((0.0, False), (10.0, False), (20.0, True), (30.0, False)):
        now[0] = start
        plan = policy.plan([0], text, [4])
        now[0] = start + 1.0
        started = policy.drafted()
        now[0] = start + 3.0
        policy.record(plan, [0], [0], [0], 1, started)
        if interrupted:
            policy.interrupt()
    # Between rounds: 7 s twice (the first and the second gap), the third gap (a prefill) not counted.
    assert policy.costs.overheads == {1: pytest.approx(7.0)}
    assert policy.costs._runs[id(policy.costs.overheads), 1] == 2


def test_each_row_takes_its_better_proposer_and_a_suffix_round_skips_the_drafter():
    suffix = promising_suffix(rate=1.0, count=100.0)  # suffix matches that are always right
    repeating = Text([5, 6, 7, 8, 5, 6, 7])  # proposes 8 5 6 7 after "5 6 7"
    fresh = Text([2, 3, 4, 9, 10, 11])
    flat = priced(lambda r, w: 0.02, draft=0.001)
    policy = RoundPolicy(4, planning=True, costs=flat, suffix_acceptance=suffix, delivered=known(0.6, 4))
    plan = plans(policy, rows=2, count=1, explore=False, texts=[repeating, fresh])[0]
    assert plan.sources == [SUFFIX, DRAFTER] and plan.lengths == [4, 4] and plan.use_drafter
    assert policy.suffix_rows(plan, [0, 1]) == {0: [8, 5, 6, 7]}
    # A drafter pass that costs more than it brings: the suffix row alone, the drafter does not run.
    dear = priced(lambda r, w: 0.02, draft=0.05)
    policy = RoundPolicy(4, planning=True, costs=dear, suffix_acceptance=suffix, delivered=known(0.6, 4))
    plan = plans(policy, rows=2, count=1, explore=False, texts=[repeating, fresh])[0]
    assert plan.sources == [SUFFIX, NO_DRAFT] and not plan.use_drafter and plan.lengths == [4, 0]


def test_a_draining_batch_values_a_round_by_the_rounds_it_saves():
    """A plain step costs f + c R (f = 1 s, c = 0.01 s a row); a suffix round verifying four tokens costs 1.8x it.
    Three rows propose tokens that are always accepted, the fourth nothing. The round's tokens per second favour the
    suffix round; but a batch ends with its last row, and when the fourth row is last (far more tokens left, or tied
    with the others) the others' tokens save only their rows' c: a plain step. When a proposing row is the one left
    last, or every row proposes, the suffix round."""
    costs = priced(lambda r, w: (1.0 + 0.01 * r) * (1.0 + 0.2 * (w - 1)))
    assert costs.row_seconds(4) == pytest.approx(0.01)
    repeating, fresh = Text([5, 6, 7, 8, 5, 6, 7]), Text([2, 3, 4, 9, 10, 11])
    suffix = promising_suffix(rate=1.0, count=100.0)

    def sources(left, texts=(repeating,) * 3 + (fresh,)):
        policy = RoundPolicy(4, planning=True, costs=costs, suffix_acceptance=suffix)
        return [policy.plan(list(range(4)), list(texts), [4] * 4, drafter_possible=False, left=left).sources
                for _ in range(20)]

    proposing = [SUFFIX, SUFFIX, SUFFIX, NO_DRAFT]
    assert sources(None) == [proposing] * 20
    assert sources([10, 10, 10, 40]) == [[NO_DRAFT] * 4] * 20
    assert sources([20, 20, 20, 20]) == [[NO_DRAFT] * 4] * 20
    assert sources([40, 10, 10, 10]) == [proposing] * 20
    assert sources([20, 20, 20, 20], (repeating,) * 4) == [[SUFFIX] * 4] * 20


def test_a_rows_cost_is_the_slope_the_plain_steps_show_and_zero_where_they_show_none():
    """c, what a row adds to a plain step, values a draining batch's rows that are not last; at its cap the value is
    the round's tokens again. Plain steps at fewer than three row counts, or too noisy to show a slope (session 34's
    real timings at 1-5 rows, whose least-squares slope alone is 22 ms a row): c = 0. A clear line: its slope."""
    def plain(steps, load=1.0):
        costs = CostModel(learn=False)
        costs.forwards.update({(rows, 1): seconds for rows, seconds in steps})
        costs.load = load
        return costs

    assert plain([(2, 0.2), (12, 0.5)]).row_seconds(12) == 0.0
    noisy = [(1, 0.060), (2, 0.226), (3, 0.307), (4, 0.211), (5, 0.179)]
    assert plain(noisy).row_seconds(12) == 0.0
    line = [(rows, 0.2 + 0.01 * rows) for rows in (1, 2, 4, 8)]
    assert plain(line).row_seconds(8) == pytest.approx(0.01)
    assert plain(line, load=2.0).row_seconds(8) == pytest.approx(0.02)
    rng = random.Random(0)  # a line with 2 % noise over 1-16 rows: about its slope, less one standard error
    shaken = [(rows, (0.2 + 0.01 * rows) * (1 + 0.02 * rng.uniform(-1, 1))) for rows in range(1, 17)]
    assert 0.008 < plain(shaken).row_seconds(16) <= 0.0105
    steep = [(rows, -0.05 + 0.1 * rows) for rows in (1, 2, 3)]  # at most the step's seconds per row
    assert plain(steep).row_seconds(2) == pytest.approx(plain(steep).forward_seconds(2, 1) / 2)


def test_thompson_draws_try_an_unknown_drafter_and_seldom_a_known_poor_one():
    """Prices where the drafter pays only if its first slot is accepted well over half the time: one never measured
    is tried in a good share of rounds (its posterior leaves that possible), one measured at 0.2 almost never, and
    without exploration the means decide alone."""
    costs = priced(lambda r, w: 1.0 + 0.1 * (w - 1), draft=0.6)
    unknown = RoundPolicy(4, planning=True, costs=costs, delivered=SlotAcceptance.empty(4))
    tried = sum(p.use_drafter for p in plans(unknown, rows=1, count=400)) / 400
    poor = RoundPolicy(4, planning=True, costs=costs, delivered=known(0.2, slots=4))
    seldom = sum(p.use_drafter for p in plans(poor, rows=1, count=400)) / 400
    assert tried > 0.1 and seldom < 0.01, (tried, seldom)
    assert not any(p.use_drafter for p in plans(unknown, rows=1, count=50, explore=False))


def test_the_same_seed_and_history_make_the_same_plans():
    costs = priced(lambda r, w: 1.0 + 0.1 * (w - 1), draft=0.5)
    first, second = (RoundPolicy(4, planning=True, costs=costs, delivered=SlotAcceptance.empty(4), seed=3)
                     for _ in range(2))
    assert [p.lengths for p in plans(first, count=100)] == [p.lengths for p in plans(second, count=100)]


def test_the_plan_prices_the_drafter_by_what_its_rows_delivered_after_the_rule():
    """The rule after drafting verifies one of four planned slots of every drafter row, and that one is accepted: the
    rule's conditional counts see slot 1 accepted every time (it looks ahead with them), the plan's count slot 2 as
    reached and never accepted, so with prices where only a second accepted slot repays the pass, the plan stops
    drafting, though the conditional rate it would have read is 1."""
    costs = priced(lambda r, w: 1.0 + 0.1 * (w - 1), draft=1.2)  # 1 a second plain, 0.87 at width 2, 1.25 at 3
    policy = RoundPolicy(4, planning=True, costs=costs)
    drafting = RoundPlan(True, [DRAFTER], [4])
    for _ in range(200):
        policy.record(drafting, [0], [1], [1], 2, policy.drafted())
    assert policy.acceptance.means(2)[0] > 0.99 and policy.acceptance.reached[1] == 0.0
    assert policy.delivered.means(2)[0] > 0.99 and policy.delivered.means(2)[1] < 0.05
    assert policy.delivered.reached[1] == pytest.approx(policy.delivered.reached[0])
    assert not any(p.use_drafter for p in plans(policy, rows=1, count=50, explore=False))
    # A plan that reads the conditional rates instead drafts: what the delivered counts are for.
    optimistic = RoundPolicy(4, planning=True, costs=costs, delivered=policy.acceptance)
    assert all(p.use_drafter for p in plans(optimistic, rows=1, count=50, explore=False))


def test_planning_off_drafts_every_budget():
    policy = RoundPolicy(4, planning=False, costs=priced(lambda r, w: 0.01 * r * w, draft=1.0))
    plan = policy.plan([0, 1], [Text([1]), Text([2])], [4, 2])
    assert plan.use_drafter and plan.sources == [DRAFTER, DRAFTER] and plan.lengths == [4, 2]


# ---------------------------------------------------------------------------------------------------------
# The loops: every row is its own plain greedy output, whatever the policy picks
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# The engine: every row is its own plain greedy output, whatever the planner picks
# ---------------------------------------------------------------------------------------------------------


def repetitive_prompts(count: int) -> list[torch.Tensor]:
    """Prompts that repeat themselves, so suffix matches are proposed (and partly accepted)."""
    base = prompts(count, length=5, seed=11)
    return [torch.cat([p, p, p[:, :3]], dim=1) for p in base]


@pytest.mark.parametrize("kind", ["markov", "dflash"])
def test_planned_rounds_mix_proposers_and_every_row_is_its_plain_greedy(monkeypatch, kind):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4)
    # Flat prices (nothing learnt): the choices depend on what rounds accepted, not on this machine's speed.
    drafter.generation_config.update(dspark_suffix_drafting=True, dspark_learn_round_costs=False)
    prompt_list = repetitive_prompts(3) + prompts(2, length=6, seed=5)
    references = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
    use_oracle(monkeypatch, references, block_size=4)  # drafts accepted 0..4 deep
    engine = SpeculativeEngine(target, drafter)
    engine.round_policy.suffix_acceptance = promising_suffix(rate=0.85, count=6.0)  # suffix matches start out promising
    ids = [engine.submit(p[0], MAX_NEW) for p in prompt_list]
    outputs = engine.run_until_done()
    for request, reference in zip(ids, plain_greedy(target, prompt_list)):
        assert torch.equal(outputs[request], reference)
    sources = Counter(s for request in ids for s in engine.returned_stats[request].sources)
    assert sources["drafter"] > 0 and sources["suffix"] > 0, sources


def test_generate_route_plans_rounds_with_greedy_identity_and_stats(monkeypatch):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "markov", block_size=4, suffix_drafting=True)
    # Every row repeats itself: a generate() batch pays for a round only when all its rows would advance, so the
    # drafter's rows must advance too (an untrained drafter's are priced out once its rounds delivered nothing).
    prompt_list = repetitive_prompts(3)
    use_oracle(monkeypatch, [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list],
               block_size=4)
    ids, mask = left_pad(prompt_list)
    state = DraftingState()
    state.statistics.suffix = promising_suffix()  # the call's state: suffix matches start out promising
    # Flat prices (no table, nothing learnt): the choices depend on the statistics alone, not on this machine's speed.
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=MAX_NEW, return_dict_in_generate=True, dspark_state=state,
                          dspark_learn_round_costs=False)
    expected = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompt_list]
    for row, reference in enumerate(expected):
        new = out.sequences[row, ids.shape[1]:]
        assert new[: reference.shape[0] - prompt_list[row].shape[1]].tolist() == reference[prompt_list[row].shape[1]:].tolist()
    assert "suffix" in out.speculative_stats.sources
    # The engine scored its proposals into the call's state: aging alone would keep every slot's count alike.
    assert any(slots.reached[0] > slots.reached[-1] + 1e-9 for slots in state.statistics.suffix.matches.values())


def test_batched_calls_start_from_the_round_costs_earlier_calls_measured(monkeypatch):
    """The engine's measured round costs are kept in the call's state: a batch after another on the same drafter
    (no state given: its own for this target) prices its rounds from what the first measured, and learns on; a
    state given to the call holds them the same way. Each call learns its drafter's acceptance afresh."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "markov", block_size=4, suffix_drafting=True)
    prompt_list = repetitive_prompts(3)
    ids, mask = left_pad(prompt_list)
    expected = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompt_list]
    seen = []
    original = RoundPolicy.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self.costs, dict(self.costs.forwards)))

    monkeypatch.setattr(RoundPolicy, "__init__", recording)
    state = DraftingState()
    for given in (None, None, state, state):
        call = {} if given is None else {"dspark_state": given}
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                              max_new_tokens=MAX_NEW, **call)
        for row, reference in enumerate(expected):
            new = out[row, ids.shape[1]:][: reference.shape[0] - prompt_list[row].shape[1]]
            assert new.tolist() == reference[prompt_list[row].shape[1]:].tolist()
    (own, before_first), (own_again, before_second), (given, before_third), (given_again, before_fourth) = seen
    assert own is own_again and given is given_again and own is not given
    assert before_first == {} and before_third == {}  # fresh costs: the first round is timed
    assert any(r == 3 for r, _ in before_second) and any(r == 3 for r, _ in before_fourth)  # what the first timed
    assert state.round_costs and own.forwards and given.forwards


def test_a_drafters_own_state_is_never_shared_by_two_running_calls():
    """A call that finds the drafter's own state in use (another thread's call) learns into a fresh one."""
    from hf_dspark.policy.remembered import remembered_state
    from hf_dspark.generation.call.plan import DraftingPlan
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    with remembered_state(drafter, target, DraftingPlan.for_call(drafter)) as running:
        with remembered_state(drafter, target, DraftingPlan.for_call(drafter)) as second:
            assert second.state is not running.state
        given = DraftingState()
        with remembered_state(drafter, target, DraftingPlan.for_call(drafter, {"dspark_state": given})) as own:
            assert own.state is given
    with remembered_state(drafter, target, DraftingPlan.for_call(drafter)) as later:
        assert later.state is running.state  # free again: the next call starts from it


def test_an_engine_starts_from_what_earlier_engines_measured_and_holds_it_while_it_lives():
    """An engine built directly learns into its drafter's own state for the target, as a call does: a later engine
    starts from the round costs an earlier one measured; two live engines never share one, and an engine given a
    plan (what generate() passes down) keeps the plan's state."""
    import gc
    import weakref
    from hf_dspark.generation.call.plan import DraftingPlan
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(2)
    expected = plain_greedy(target, prompt_list)

    def served(engine):
        ids = [engine.submit(p[0], max_new_tokens=MAX_NEW) for p in prompt_list]
        outputs = engine.run_until_done()
        for request_id, reference in zip(ids, expected):
            assert outputs[request_id].tolist() == reference.tolist()
        return engine.round_policy.costs

    first = SpeculativeEngine(target, drafter)
    first_costs = served(first)
    assert first_costs.forwards  # it timed its rounds
    beside = SpeculativeEngine(target, drafter)  # the first still lives: a fresh state
    assert beside.round_policy.costs is not first_costs and not beside.round_policy.costs.forwards
    given = DraftingState()
    planned = SpeculativeEngine(target, drafter, plan=DraftingPlan.for_call(drafter, {"dspark_state": given}))
    assert planned.plan.state is given
    gone = weakref.ref(first)
    del first, beside, planned
    gc.collect()
    assert gone() is None
    later = SpeculativeEngine(target, drafter)
    assert later.round_policy.costs is first_costs  # starts from what the first measured
    served(later)


def test_no_drafter_pass_in_rounds_the_planner_makes_plain():
    """Prices at which drafting cannot pay even if every draft were accepted: the drafter never runs (not even a
    probe), and every row is its plain greedy output."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    drafter.generation_config.dspark_suffix_drafting = False
    passes = []
    drafter.register_forward_hook(lambda *args: passes.append(1))
    engine = SpeculativeEngine(target, drafter)
    costs = engine.round_policy.costs
    costs.learn = False  # keep these prices whatever the rounds measure
    for rows in range(1, 4):
        for width in range(1, 6):
            costs.forwards[rows, width] = 0.01 * rows * width  # each verified token costs as much as a plain step
        costs.drafts[rows] = 0.05 * rows
    prompt_list = prompts(3, length=6)
    ids = [engine.submit(p[0], 40) for p in prompt_list]
    outputs = engine.run_until_done()
    for request, prompt in zip(ids, prompt_list):
        assert torch.equal(outputs[request], target.generate(prompt, do_sample=False, max_new_tokens=40)[0])
    rounds = len(engine.verified_tokens_per_round)
    assert rounds > 30 and passes == [], (len(passes), rounds)


@pytest.mark.parametrize("kind", ["markov", "dflash"])
def test_engine_joining_rows_with_planning_match_plain_greedy(monkeypatch, kind):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4, suffix_drafting=True)
    prompt_list = repetitive_prompts(3) + prompts(2, length=9, seed=3)
    references = [target.generate(p, do_sample=False, max_new_tokens=30)[0] for p in prompt_list]
    use_oracle(monkeypatch, references, block_size=4)
    engine = SpeculativeEngine(target, drafter)
    max_new = [14, 6, 20, 9, 12]
    ids, outputs = {}, {}
    for step in range(200):
        if step < len(prompt_list):
            ids[engine.submit(prompt_list[step][0], max_new[step])] = step
        outputs.update(engine.step())
        if len(outputs) == len(prompt_list):
            break
    for request, index in ids.items():
        reference = target.generate(prompt_list[index], do_sample=False, max_new_tokens=max_new[index])[0]
        assert torch.equal(outputs[request], reference), index


# ---------------------------------------------------------------------------------------------------------
# Sampling at R > 1 through the planner: the joint of three new tokens is the target's
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a sampling-distribution test
@pytest.mark.parametrize("kind", ["markov", "dflash"])
def test_planned_batched_sampling_matches_target_distribution(monkeypatch, kind):
    """DSpark and DFlash drafters at R > 1 (Eagle3: test_batched_eagle3.py), rows planned three ways at once."""
    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)
    drafter = tiny_drafter(target, kind, block_size=3, suffix_drafting=True)
    prompt = torch.tensor([[1, 4, 2, 1, 4]])  # "1 4" repeats: suffix proposals ("2 ...") from the first round
    temperature, top_p = 0.7, 0.9
    joint = exact_three_token_distribution(target, prompt, temperature, top_p)
    biased = exact_three_token_distribution(target, prompt, temperature * temperature, top_p)
    # Rows plan differently: each engine's planner is primed so some rows verify suffix proposals, some the
    # drafter's block and some only their anchor, decided from earlier rounds only.
    original_plan = RoundPolicy.plan
    choices: Counter = Counter()

    def varied_plan(self, request_ids, requests, budgets, drafter_possible=True, **kwargs):
        plan = original_plan(self, request_ids, requests, budgets, drafter_possible, **kwargs)
        for row, request_id in enumerate(request_ids):
            kind = ("drafter", "none", "suffix")[request_id % 3]
            proposal = self.proposals[request_id][0]
            if kind == "suffix" and proposal:
                plan.sources[row], plan.lengths[row] = "suffix", min(len(proposal), budgets[row])
            elif kind == "drafter" and drafter_possible and budgets[row] > 0:
                plan.use_drafter = True
                plan.sources[row], plan.lengths[row] = "drafter", budgets[row]
            else:
                plan.sources[row], plan.lengths[row] = "none", 0
        choices.update(plan.sources)
        return plan

    monkeypatch.setattr(RoundPolicy, "plan", varied_plan)
    batch, calls = 48, 50
    ids = prompt.repeat(batch, 1)
    mask = torch.ones_like(ids)
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    for _ in range(calls):
        out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=5, do_sample=True,
                                           temperature=temperature, top_p=top_p, generator=generator)
        for sequence in out.sequences:
            x1, x2, x3 = sequence[5:8].tolist()
            counts[x1, x2, x3] += 1
    assert choices["drafter"] > 0 and choices["suffix"] > 0 and choices["none"] > 0, choices
    assert_three_tokens_match(counts, joint, biased, batch * calls)


def test_a_state_is_saved_whole_or_not_at_all(tmp_path):
    """A save stopped midway (here by a value JSON cannot hold) leaves the file as it was, and no temporary file."""
    path = tmp_path / "state.json"
    state = DraftingState()
    state.statistics.suffix.record(2, proposed=3, accepted=1)
    state.save(path)
    before = path.read_text()
    state.statistics.suffix.matches[2].accepted[1] = object()
    with pytest.raises(TypeError):
        state.save(path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert DraftingState.load(path).statistics.suffix.matches[2].reached == [1.0, 1.0, 0.0]


def test_the_rule_after_drafting_admits_the_plan_when_confidences_read_as_estimated():
    """`best_width` (before drafting, host values) and `admitted_width` (after drafting, on the device, early stop
    looking ahead on the estimates) agree when every row's survivals are the estimates, kernel jumps included: the
    rule after drafting departs from the plan only where the confidences do."""
    from hf_dspark.policy.admission import admitted_width, best_width
    generator = torch.Generator().manual_seed(3)
    for _ in range(300):
        rows, slots = int(torch.randint(1, 5, (1,), generator=generator)), 7
        rates = (torch.rand(slots, generator=generator) ** 0.5).tolist()
        survival = torch.tensor(rates).cumprod(0).expand(rows, slots)
        steps = torch.rand(slots + 1, generator=generator)
        steps[int(torch.randint(1, slots + 1, (1,), generator=generator))] += 2.0  # a jump somewhere
        prices = steps.cumsum(0).tolist()
        expected = [rows + float(survival[:, :count].sum()) for count in range(slots + 1)]
        assert best_width(expected, prices) == int(admitted_width(survival, prices, ahead=rates))
