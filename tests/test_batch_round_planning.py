"""Round planning at every batch size: the engine's planner (drafter block, suffix match or plain step per row, the
batch's verification width from measured costs) and its losslessness at R > 1."""

import math
import random
from collections import Counter

import pytest
import torch

from conftest import prompts, tiny_drafter, tiny_target
from hf_dspark import DraftingState
from hf_dspark.generation.engine import speculative_engine as batched
from hf_dspark.generation import batched_speculative_generate
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.generation.round.planning import RoundPlanning
from hf_dspark.scheduling.round_costs import RoundCosts
from hf_dspark.scheduling.round_planner import (DRAFTER, NO_DRAFT, SUFFIX, RoundCalibration, RoundPlan, RoundPlanner,
                                                RowOptions, SlotAcceptance,
                                                expected_tokens, finishing_value, shortening, steady_shortening)
from hf_dspark.scheduling.cost_table import VerificationCostTable
from lossless_checks import assert_three_tokens_match
from test_batched import assert_rows_equal, left_pad, plain_greedy, use_oracle
from test_sampling_lossless import TINY_VOCAB, exact_three_token_distribution

MAX_NEW = 16


def cpu_like_costs(rows_widths=((2, 1), (2, 5), (3, 1), (3, 5))) -> RoundCosts:
    """Measured costs of a machine where each token a row verifies beyond its first adds 40% (a CPU)."""
    costs = RoundCosts()
    for _ in range(2):  # a shape's first run is a warm-up: provisional until the second replaces it
        for rows, width in rows_widths:
            costs.record_forward(rows, width, rows * (0.01 + 0.004 * (width - 1)))
        costs.record_draft(2, 0.005)
        costs.record_draft(3, 0.006)
    return costs


# ---------------------------------------------------------------------------------------------------------
# The planner's choices (host arithmetic only)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.synthetic_timings
def test_round_costs_are_a_plain_step_and_ratios_to_it():
    costs = RoundCosts()
    assert not costs.knows_plain() and not costs.knows_widths()
    costs.record_forward(2, 4, 0.8)
    costs.record_forward(2, 4, 0.8)  # nothing to relate a wide forward to yet: not learnt from
    assert not costs.widening
    costs.record_forward(2, 1, 5.0)  # a shape's first run may warm caches: it prices the shape until the second
    assert costs.knows_plain() and costs.forward_seconds(2, 1) == 5.0
    costs.record_forward(2, 1, 0.2)  # which replaces it
    assert costs.forward_seconds(2, 1) == 0.2
    costs.record_forward(4, 1, 0.3)
    costs.record_forward(4, 1, 0.3)
    assert costs.knows_plain() and costs.forward_seconds(2, 1) == 0.2
    assert costs.forward_seconds(3, 1) == pytest.approx(0.25)  # between row counts: linear
    assert costs.forward_seconds(8, 1) == 0.3  # beyond: flat
    assert costs.forward_seconds(2, 4) == 0.2  # no wider forward timed: flat, and the planner keeps rounds narrow
    costs.record_forward(2, 4, 0.8)  # 4x the plain step at 3 extra tokens per row: each adds 100%
    assert costs.widening == {(2, 4): pytest.approx(4.0)} and costs.forward_seconds(4, 3) == pytest.approx(0.9)
    # Beyond the widest width measured at several rows, a power through it and the one before (here W = 1: 4x at
    # W = 4 is a rise in proportion to the width, so it goes on so).
    assert costs.forward_seconds(4, 6) == pytest.approx(0.3 * 6.0)
    costs.record_forward(2, 5, 0.9)
    costs.record_forward(2, 5, 0.9)  # a second wide width (4.5x): beyond it, the power through the two widest
    assert costs.forward_seconds(2, 7) == pytest.approx(0.2 * 4.5 * 1.4 ** (math.log(4.5 / 4.0) / math.log(5 / 4)))
    assert 0.2 * 4.5 < costs.forward_seconds(2, 7) < 0.2 * 5.5  # above holding, below the rise continued
    costs.record_forward(4, 2, 0.48)
    costs.record_forward(4, 2, 0.48)  # at 4 rows the second token per row costs 60 %: the nearest row count's
    power = math.log(1.6) / math.log(2)
    assert costs.forward_seconds(4, 2) == pytest.approx(0.3 * 1.6)
    assert costs.forward_seconds(4, 3) == pytest.approx(0.3 * 1.6 * 1.5**power)
    assert costs.forward_seconds(5, 3) == pytest.approx(0.3 * 1.6 * 1.5**power)
    assert costs.forward_seconds(3, 4) == pytest.approx(0.25 * 4.0)  # as near to 2 rows as to 4: the fewer's
    assert costs.forward_seconds(2, 3) == pytest.approx(0.2 * 3.0)  # at 2 rows its own widths: 1, 4 at W = 4, ...
    costs.record_draft(4, 0.15)
    costs.record_draft(4, 0.15)
    assert costs.draft_seconds(4) == pytest.approx(0.15) and costs.draft_seconds(2) == pytest.approx(0.1)
    costs.record_forward(2, 1, 100.0)  # a burst of other load moves the estimate at most to twice it, smoothed
    assert 0.2 < costs.forward_seconds(2, 1) < 0.4
    costs.record_forward(2, 2, 0.1)
    costs.record_forward(2, 2, 0.1)  # a wider forward that ran faster than the plain estimate lowers it
    assert costs.forward_seconds(2, 1) == 0.1
    table = VerificationCostTable([1.0, 2.0, 3.0, 4.0], draft_seconds=0.5)
    tabled = RoundCosts(table)
    assert tabled.forward_seconds(1, 3) == 3.0 and tabled.draft_seconds(2) == 0.5 and tabled.knows_widths()
    tabled.record_forward(1, 1, 2.0)
    tabled.record_forward(1, 1, 2.0)  # this machine runs at twice the table's times
    assert tabled.forward_seconds(1, 3) == pytest.approx(6.0)
    frozen = RoundCosts(table, learn=False)
    frozen.record_forward(1, 1, 2.0)
    frozen.record_forward(1, 1, 2.0)
    assert frozen.forward_seconds(1, 1) == 1.0
    flat = RoundCosts(learn=False)  # no table, nothing learnt: every forward costs the same, drafting is free
    assert flat.knows_plain() and flat.forward_seconds(4, 8) == flat.forward_seconds(4, 1) and not flat.draft_seconds(4)


def test_the_first_round_is_plain_and_the_next_stay_narrow_until_a_wide_one_is_timed():
    planner = RoundPlanner(RoundCosts(), probe_width=3)
    sure = [RowOptions(6, [1.0], expected_tokens([1.0] * 6, 6))] * 2
    assert planner.plan(sure).width == 1
    planner.costs.record_forward(2, 1, 0.02)
    planner.costs.record_forward(2, 1, 0.02)
    assert planner.plan(sure).width == 3
    planner.costs.record_forward(2, 3, 0.02)
    planner.costs.record_forward(2, 3, 0.02)  # a flat machine: wider is free
    assert planner.plan(sure).width == 7


@pytest.mark.synthetic_timings
def test_a_row_count_timed_once_takes_a_plain_step_before_a_cold_price_makes_wide_rounds_look_cheap():
    costs = RoundCosts()
    likely = [RowOptions(3, [1.0], expected_tokens([0.5] * 3, 3))] * 12
    planner = RoundPlanner(costs)
    assert planner.plan(likely).width == 1  # nothing timed: a plain step
    costs.record_forward(12, 1, 0.19)  # a cold first step, nearly twice what later ones cost
    costs.record_forward(12, 3, 0.20)  # beside it a round of 3 tokens per row would look free: not learnt
    assert costs.plain_provisional(12) and not costs.knows_widths()
    assert planner.plan(likely).width == 1
    costs.record_forward(12, 1, 0.10)
    assert not costs.plain_provisional(12) and costs.plain_seconds(12) == pytest.approx(0.10)
    for _ in range(2):
        costs.record_forward(12, 3, 0.20)
    assert costs.forward_seconds(12, 3) == pytest.approx(0.20)
    assert planner.plan(likely).width == 1  # 3 tokens a row cost 2x a plain step: 1.75 expected tokens do not pay
    assert not RoundCosts(learn=False).plain_provisional(12)


def test_a_width_not_measured_at_its_row_count_costs_at_least_plain_steps_of_as_many_tokens():
    costs = RoundCosts()
    for _ in range(2):
        for rows, seconds in ((1, 0.06), (2, 0.10), (4, 0.11), (8, 0.14)):
            costs.record_forward(rows, 1, seconds)
        costs.record_forward(4, 2, 0.121)  # nearly free to widen at 4 rows (a CPU reading its weights)
    assert costs.forward_seconds(4, 2) == pytest.approx(0.121)  # measured there: as measured
    # 8 x 8 tokens: borrowed from 4 rows it would be 0.154 s; plain steps of 2..8 rows rise 0.0068 s a row
    # (least squares; one row, another kernel path, left out), continued to 64 rows.
    rise = ((2 - 14 / 3) * (0.10 - 0.35 / 3) + (4 - 14 / 3) * (0.11 - 0.35 / 3) + (8 - 14 / 3) * (0.14 - 0.35 / 3)) / (
        (2 - 14 / 3) ** 2 + (4 - 14 / 3) ** 2 + (8 - 14 / 3) ** 2)
    assert costs.tokens_seconds(64) == pytest.approx(0.14 + rise * 56)
    assert costs.forward_seconds(8, 8) == pytest.approx(0.14 + rise * 56)
    assert costs.forward_seconds(8, 8) > 0.154
    power = math.log(1.1) / math.log(2)  # beyond W = 2, the power through 1x at W = 1 and 1.1x at W = 2
    assert costs.forward_seconds(2, 3) == pytest.approx(max(0.10 * 1.1 * 1.5**power, costs.tokens_seconds(6)))
    few = RoundCosts()
    for _ in range(2):
        few.record_forward(1, 1, 0.06), few.record_forward(4, 1, 0.11), few.record_forward(4, 2, 0.121)
    assert few.tokens_seconds(64) == 0.0  # no curve: borrowed from 4 rows, and extended there
    assert few.forward_seconds(8, 8) == pytest.approx(0.11 * 1.1 * 4**power)


@pytest.mark.synthetic_timings
def test_wider_than_measured_costs_more_at_several_rows_and_holds_at_one():
    """Twelve requests at once on a 2-core CPU: a plain step took 0.095 s and 3 tokens a row 0.19 s; 8 tokens a row
    then took 0.30 s, which held at 0.19 s priced a round of suffix proposals as a win it was not."""
    costs = RoundCosts()
    for _ in range(2):
        costs.record_forward(12, 1, 0.095)
        costs.record_forward(12, 3, 0.19)
    assert 0.30 <= costs.forward_seconds(12, 8) <= 0.40  # 2x (8 / 3) ** (log 2 / log 3) of a plain step
    assert costs.forward_seconds(12, 8) < 0.095 + (0.19 - 0.095) / 2 * 7  # below the rise per width continued
    proposals = [RowOptions(7, expected_tokens([0.85] * 7, 7) if row % 2 else [1.0, 1.5, 1.6, 1.63])
                 for row in range(12)]  # half the rows with long suffix matches likely to hold, as in that burst
    assert RoundPlanner(costs).plan(proposals, drafter_possible=False).width < 8
    one = RoundCosts()
    for _ in range(2):
        one.record_forward(1, 1, 0.04)
        one.record_forward(1, 2, 0.06)  # one row: the step to a second token is mostly fixed, later tokens cheap
    assert one.forward_seconds(1, 8) == pytest.approx(0.06)


def test_slot_acceptance_and_expected_tokens():
    acceptance = SlotAcceptance.empty(3, decay=1.0)
    acceptance.record(verified=3, accepted=1)  # slot 1 accepted, slot 2 rejected, slot 3 never reached
    acceptance.record(verified=3, accepted=3)
    assert acceptance.reached == [2.0, 2.0, 1.0] and acceptance.accepted == [2.0, 1.0, 1.0]
    rates = acceptance.rates([0.5, 0.5, 0.5], prior_weight=2.0)
    assert rates == pytest.approx([3 / 4, 2 / 4, 2 / 3])
    assert expected_tokens(rates, 2) == pytest.approx([1.0, 1.75, 1.75 + 0.375])


def test_calibration_is_a_brake_kept_per_row_count_band_and_proposer():
    calibration = RoundCalibration()
    assert calibration.tokens_factor(3, SUFFIX) == 1.0 and calibration.seconds_factor(3) == 1.0  # nothing seen
    for _ in range(6):
        calibration.record_tokens(3, SUFFIX, 2.0, 0)  # priced at two extra tokens, none accepted
        calibration.record_seconds(3, 0.1, 0.2)  # priced at 0.1 s, took twice that
    assert 0.0 < calibration.tokens_factor(3, SUFFIX) < 0.5 and 1.5 < calibration.seconds_factor(3) < 2.0
    assert calibration.tokens_factor(2, SUFFIX) == calibration.tokens_factor(3, SUFFIX)  # 2-3 rows: one band
    assert calibration.tokens_factor(3, DRAFTER) == 1.0  # another proposer
    assert calibration.tokens_factor(4, SUFFIX) == 1.0 and calibration.seconds_factor(4) == 1.0  # another band
    for _ in range(6):
        calibration.record_tokens(8, DRAFTER, 1.0, 4)  # delivered more than priced, faster than priced
        calibration.record_seconds(8, 0.2, 0.1)
    assert calibration.tokens_factor(8, DRAFTER) == 1.0 and calibration.seconds_factor(8) == 1.0  # never a spur
    for _ in range(40):  # rounds that deliver as priced bring a braked band back
        calibration.record_tokens(3, SUFFIX, 2.0, 2)
        calibration.record_seconds(3, 0.1, 0.1)
    assert calibration.tokens_factor(3, SUFFIX) > 0.99 and calibration.seconds_factor(3) < 1.01


@pytest.mark.synthetic_timings
def test_rounds_that_deliver_less_than_priced_brake_the_planner_to_plain_steps():
    """Suffix rounds priced above the plain step's rate by more than the margin: chosen while they deliver what they
    were priced at, and no longer once they deliver a fraction of it (the picked estimates erred high)."""
    def planner_after(accepted: int) -> RoundPlanner:
        planner = RoundPlanner(cpu_like_costs())
        for _ in range(8):
            planner.calibration.record_tokens(3, SUFFIX, 1.2, accepted)
        return planner

    options = [RowOptions(4, expected_tokens([0.6] * 4, 4), [1.0])] * 3
    assert RoundPlanner(cpu_like_costs()).plan(options).sources == [SUFFIX] * 3
    assert planner_after(1).plan(options).sources == [SUFFIX] * 3  # about as priced
    assert planner_after(0).plan(options).width == 1  # nothing of what was priced: plain steps
    slow = RoundPlanner(cpu_like_costs())
    for _ in range(8):
        slow.calibration.record_seconds(3, 0.01, 0.03)  # rounds took three times their price
    assert slow.plan(options).width == 1


def test_a_loop_prices_the_drafter_from_what_earlier_loops_of_it_measured():
    """Each loop learns the drafter's acceptance afresh, from what earlier loops on the same state measured as its
    prior (not an even chance per slot), and never counts its own rounds twice."""
    class Request:
        tokens, max_new_tokens, emitted = [5, 6, 7], 64, 0

    def loop(remembered: SlotAcceptance | None, rejected_rounds: int = 0) -> list[float]:
        """A loop whose drafter's first slot is always rejected: its estimate after `rejected_rounds` rounds."""
        planning = RoundPlanning(3, planning=True, suffix_drafting=False, learn_costs=False,
                                 drafter_acceptance=remembered)
        for _ in range(rejected_rounds):
            planning.plan([0], [Request()], [3], drafter_possible=True)
            planning.record(RoundPlan(True, [DRAFTER], [3]), [0], [3], [0], 4, planning.drafted())
        planning.plan([0], [Request()], [3], drafter_possible=True)
        return planning._options[0].drafter_expected

    assert loop(None) == pytest.approx(expected_tokens([0.5] * 3, 3))  # nothing measured: even chances
    remembered = SlotAcceptance(decay=0.98)
    # The first loop on a state learns as a loop without one does: its own rounds are not its prior too.
    assert loop(remembered, 30) == pytest.approx(loop(None, 30))
    assert len(remembered.reached) == 3 and remembered.reached[0] > 20 and remembered.accepted == [0.0] * 3
    later = loop(remembered)
    assert later[1] < 1.1 < expected_tokens([0.5], 1)[1]  # started from what the first loop saw
    wider = RoundPlanning(5, planning=True, suffix_drafting=False, learn_costs=False, drafter_acceptance=remembered)
    assert len(remembered.reached) == 5 and wider.remembered_pool is remembered  # a loop drafting more slots


@pytest.mark.synthetic_timings
def test_plain_steps_when_drafts_do_not_pay_on_a_cpu_like_machine():
    planner = RoundPlanner(cpu_like_costs())
    poor = expected_tokens([0.2] * 4, 4)
    plan = planner.plan([RowOptions(4, [1.0], poor), RowOptions(4, [1.0], poor)])
    assert not plan.use_drafter and plan.sources == [NO_DRAFT, NO_DRAFT] and plan.width == 1
    # A drafter whose drafts are all accepted pays even when a forward costs in proportion to its tokens.
    good = expected_tokens([1.0] * 4, 4)
    plan = planner.plan([RowOptions(4, [1.0], good), RowOptions(4, [1.0], good)])
    assert plan.use_drafter and plan.sources == [DRAFTER, DRAFTER] and plan.lengths == [4, 4]


def test_a_round_of_a_generate_batch_is_worth_the_steps_it_takes_off_the_longest_row():
    one_draft = expected_tokens([0.5], 1)  # [1, 1.5]: a second token with chance 1/2
    assert shortening([10, 10], [[1.0], [1.0]]) == 1.0  # a plain step
    assert shortening([10, 10], [one_draft, one_draft]) == pytest.approx(1.25)  # both rows must gain: 1 + 1/4
    assert shortening([10, 10], [one_draft, [1.0]]) == 1.0  # one row gaining shortens nothing
    assert shortening([10, 9], [[1.0], one_draft]) == 1.0  # the row ahead gains nothing that counts
    assert shortening([10, 9], [one_draft, [1.0]]) == pytest.approx(1.5)  # the longest row alone must gain
    sure = expected_tokens([1.0] * 3, 3)  # [1, 2, 3, 4]
    assert shortening([10, 8], [sure, sure]) == pytest.approx(4.0)
    assert shortening([10, 8], [sure, [1.0]]) == pytest.approx(3.0)  # then the second row is the longest


def rounds_until_done(left: list[int], rates: list[float], width: int, trials: int, seed: int) -> float:
    """Monte Carlo: the mean rounds a batch needs when every round verifies up to width - 1 proposed tokens per row,
    row r's each accepted with chance rates[r] given the ones before it were (and never past the row's end)."""
    draw, total = random.Random(seed), 0
    for _ in range(trials):
        remaining, rounds = list(left), 0
        while max(remaining) > 0:
            rounds += 1
            for row, rate in enumerate(rates):
                if remaining[row] > 0:
                    proposed, emitted = min(width - 1, remaining[row] - 1), 1
                    while emitted <= proposed and draw.random() < rate:
                        emitted += 1
                    remaining[row] -= emitted
        total += rounds
    return total / trials


@pytest.mark.parametrize("rows,rate,width", [(2, 0.3, 2), (4, 0.5, 2), (4, 0.5, 4), (8, 0.3, 3), (16, 0.6, 2)])
def test_steady_shortening_is_what_rounds_like_this_one_take_off_until_the_batch_is_done(rows, rate, width):
    left = [48] * rows
    expected = [expected_tokens([rate] * (width - 1), width - 1)] * rows
    simulated = max(left) / rounds_until_done(left, [rate] * rows, width, trials=400, seed=rows)
    assert steady_shortening(left, expected) == pytest.approx(simulated, rel=0.03)
    # One round then plain steps, with the rows tied: only a round where every row gains shortens the batch.
    assert shortening(left, expected) < 0.9 * simulated


def test_steady_shortening_errs_low_for_unlike_rows_and_one_row_that_cannot_gain_holds_the_batch():
    rates, left = [0.1, 0.3, 0.6, 0.6], [40, 38, 40, 35]
    expected = [expected_tokens([rate] * 3, 3) for rate in rates]
    simulated = max(left) / rounds_until_done(left, rates, 4, trials=400, seed=3)
    assert 1.0 < steady_shortening(left, expected) <= simulated * 1.01
    stuck = [expected_tokens([0.0] * 3, 3)] + expected[1:]
    assert steady_shortening([40] * 4, stuck) == pytest.approx(1.0)
    assert finishing_value([40] * 4, stuck) == pytest.approx(1.0)


def test_finishing_value_is_the_better_future_and_a_single_row_is_worth_its_expected_tokens():
    likely = expected_tokens([0.8] * 3, 3)
    assert finishing_value([30], [likely]) == pytest.approx(likely[-1])  # batch 1: its tokens, as before
    tied, ahead = [20, 20, 20], [20, 12, 12]
    some = [expected_tokens([0.5] * 2, 2)] * 3
    assert finishing_value(tied, some) == pytest.approx(steady_shortening(tied, some))
    assert steady_shortening(tied, some) > shortening(tied, some)
    # Rows far ahead: this round is the longest row's alone, and one round of it is worth more than the spread's
    # estimate of rounds like it until every row is done.
    assert finishing_value(ahead, some) == pytest.approx(shortening(ahead, some))
    assert shortening(ahead, some) > steady_shortening(ahead, some)


@pytest.mark.synthetic_timings
def test_a_generate_batch_drafts_when_rows_gain_in_turn_though_one_round_rarely_moves_them_all():
    costs = RoundCosts(learn=False)  # a flat machine: a wide forward costs a plain step, drafting is free
    modest = [RowOptions(2, [1.0], expected_tokens([0.3] * 2, 2), left=40)] * 8
    assert shortening([40] * 8, [row.drafter_expected for row in modest]) < RoundPlanner(costs).margin
    plan = RoundPlanner(costs).plan(modest)
    assert plan.use_drafter and plan.sources == [DRAFTER] * 8


def test_a_generate_batch_drafts_only_when_every_row_would_advance():
    costs = RoundCosts(learn=False)  # a flat machine: a wide forward costs a plain step, drafting is free
    planner = RoundPlanner(costs)
    likely = expected_tokens([0.9] * 4, 4)
    server = [RowOptions(4, [1.0], likely), RowOptions(4, [1.0], [1.0])]
    assert planner.plan(server).use_drafter  # a server's row that gains is worth its tokens
    one_gains = [RowOptions(4, [1.0], likely, left=20), RowOptions(4, [1.0], expected_tokens([0.0] * 4, 4), left=20)]
    assert not planner.plan(one_gains).use_drafter  # the other row sets when the batch returns: no gain
    both_gain = [RowOptions(4, [1.0], likely, left=20)] * 2
    plan = planner.plan(both_gain)
    assert plan.use_drafter and plan.sources == [DRAFTER, DRAFTER]


def test_each_row_takes_its_best_proposal_within_the_batch_width():
    planner = RoundPlanner(cpu_like_costs())
    sure_suffix = [1.0, 2.0, 3.0, 4.0, 5.0]  # a suffix proposal whose 4 tokens are surely accepted
    plan = planner.plan([RowOptions(4, sure_suffix, [1.0] * 5), RowOptions(4, [1.0], expected_tokens([0.0] * 4, 4)),
                         RowOptions(4, sure_suffix[:3], [1.0] * 5)])
    # Width 3 (E = 7 for 3 rows x 3 tokens) beats width 5 (E = 9 for 3 rows x 5): the batch verifies two each.
    assert plan.sources == [SUFFIX, NO_DRAFT, SUFFIX] and plan.lengths == [2, 0, 2]
    assert not plan.use_drafter  # no row drafts: the drafter does not run


@pytest.mark.synthetic_timings
def test_a_flat_machine_drafts_and_a_plain_winner_still_probes_the_drafter():
    flat = RoundPlanner(RoundCosts(learn=False))  # no table, not learning: a flat machine, drafting is free
    assert flat.plan([RowOptions(3, [1.0], expected_tokens([0.1] * 3, 3))] * 2).use_drafter
    planner = RoundPlanner(cpu_like_costs(), probe_every=4, max_probe_every=8)
    measured_poor = [RowOptions(4, [1.0], expected_tokens([0.1] * 4, 4))] * 2  # its optimistic estimate is as poor
    assert not any(planner.plan(measured_poor).use_drafter for _ in range(30))  # nothing left to find: no probe
    planner = RoundPlanner(cpu_like_costs(), probe_every=4, max_probe_every=8)
    poor = [RowOptions(4, [1.0], expected_tokens([0.1] * 4, 4), drafter_optimistic=expected_tokens([1.0] * 4, 4))] * 2
    drafted = [planner.plan(poor).use_drafter for _ in range(30)]
    # Every 4th round probes, then every 8th once probes keep losing.
    assert drafted[:4] == [False, False, False, True]
    gaps = [b - a for a, b in zip([i for i, d in enumerate(drafted) if d], [i for i, d in enumerate(drafted) if d][1:])]
    assert gaps and gaps[-1] == 8
    assert not planner.plan(poor, drafter_possible=False).use_drafter
    # A pass that would catch up on whole prompts is no probe's to spend: none however long the drafter was idle.
    assert not any(planner.plan(poor, probe_allowed=False).use_drafter for _ in range(30))
    assert any(planner.plan(poor).use_drafter for _ in range(30))


def test_the_optimistic_estimate_weighs_what_earlier_loops_measured_but_stays_optimistic():
    remembered = SlotAcceptance(decay=0.98)
    for _ in range(40):
        remembered.cover(3)
        remembered.record(3, 0)  # a drafter whose first slot was always rejected
    fresh = RoundPlanning(3, planning=True, suffix_drafting=False, learn_costs=False)
    known = RoundPlanning(3, planning=True, suffix_drafting=False, learn_costs=False, drafter_acceptance=remembered)
    assert fresh._optimistic_rates() == pytest.approx([1.0] * 3)  # nothing measured: anything could be found
    first = known._optimistic_rates()[0]
    assert 0.1 < first < 0.3  # eight remembered rejections beside two optimistic acceptances
    assert first > known._slot_priors[0]  # still above what was measured


def test_rows_know_whether_their_queue_holds_prompts_no_drafter_pass_took():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    engine = SpeculativeEngine(target, drafter)
    first, second = prompts(2)
    engine.submit(first[0], max_new_tokens=MAX_NEW)
    engine.step()  # prefilled into an empty batch: the prompt's context stays queued
    assert engine._rows.prompts_queued
    engine.submit(second[0], max_new_tokens=MAX_NEW)
    engine.step()  # a join moves both blocks' queues into the drafter's cache first
    assert not engine._rows.prompts_queued


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
    suffix = engine.planning.suffix_acceptance
    suffix.prior_accepted, suffix.prior_rejected = 6.0, 1.0  # suffix matches start out promising
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
    state.statistics.suffix.prior_accepted = 20.0  # the call's state: suffix matches start out promising
    # Flat prices (no table, nothing learnt): the choices depend on the statistics alone, not on this machine's speed.
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=MAX_NEW, return_dict_in_generate=True, dspark_state=state,
                          dspark_learn_round_costs=False)
    expected = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0] for p in prompt_list]
    for row, reference in enumerate(expected):
        new = out.sequences[row, ids.shape[1]:]
        assert new[: reference.shape[0] - prompt_list[row].shape[1]].tolist() == reference[prompt_list[row].shape[1]:].tolist()
    assert "suffix" in out.speculative_stats.sources
    assert sum(state.statistics.suffix.reached.values()) > 0  # the engine scored its proposals into the call's state


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
    original = RoundPlanning.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self.costs, dict(self.costs.plain)))

    monkeypatch.setattr(RoundPlanning, "__init__", recording)
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
    assert before_first == {} and before_third == {}  # fresh costs: the first plain step is timed
    assert 3 in before_second and 3 in before_fourth  # the second call starts from the plain step the first timed
    assert state.round_costs and own.plain and given.plain


def test_a_drafters_own_state_is_never_shared_by_two_running_calls():
    """A call that finds the drafter's own state in use (another thread's call) learns into a fresh one."""
    from hf_dspark.generation.call.remembered_state import remembered_state
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
        return engine.planning.costs

    first = SpeculativeEngine(target, drafter)
    first_costs = served(first)
    assert first_costs.plain  # it timed its plain steps
    beside = SpeculativeEngine(target, drafter)  # the first still lives: a fresh state
    assert beside.planning.costs is not first_costs and not beside.planning.costs.plain
    given = DraftingState()
    planned = SpeculativeEngine(target, drafter, plan=DraftingPlan.for_call(drafter, {"dspark_state": given}))
    assert planned.plan.state is given
    gone = weakref.ref(first)
    del first, beside, planned
    gc.collect()
    assert gone() is None
    later = SpeculativeEngine(target, drafter)
    assert later.planning.costs is first_costs and later.planning.costs.plain  # starts from what the first measured
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
    costs = engine.planning.costs
    costs.learn = False  # keep these prices whatever the rounds measure
    for rows in range(1, 4):
        costs.widening[rows, 2] = 2.0  # each verified token costs as much as a plain step
        costs.plain[rows] = 0.01 * rows
        costs.draft_ratio[rows] = 5.0
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
    original_plan = RoundPlanning.plan
    choices: Counter = Counter()

    def varied_plan(self, request_ids, requests, budgets, drafter_possible, **kwargs):
        plan = original_plan(self, request_ids, requests, budgets, drafter_possible, **kwargs)
        for row, request_id in enumerate(request_ids):
            kind = ("drafter", "none", "suffix")[request_id % 3]
            proposal = self.requests[request_id].proposal
            if kind == "suffix" and proposal:
                plan.sources[row], plan.lengths[row] = "suffix", min(len(proposal), budgets[row])
            elif kind == "drafter" and drafter_possible and budgets[row] > 0:
                plan.use_drafter = True
                plan.sources[row], plan.lengths[row] = "drafter", budgets[row]
            else:
                plan.sources[row], plan.lengths[row] = "none", 0
        choices.update(plan.sources)
        return plan

    monkeypatch.setattr(RoundPlanning, "plan", varied_plan)
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
