"""The serving simulator behind the scheduler's GPU-like benchmark: its accounting, and the policies' ordering."""

import math

import torch

from hf_dspark.policy import DSparkScheduler, VerificationCostTable
from hf_dspark.evaluation.simulation import (
    ConfidenceModel,
    expected_tau,
    gpu_like_costs,
    policy_lengths,
    simulate_policy,
)

MODEL = ConfidenceModel([0.9, 0.87, 0.84, 0.81, 0.78, 0.75, 0.72], concentration=4.0)


def test_confidence_model_has_the_requested_means():
    draws = MODEL.sample(20000, torch.Generator().manual_seed(0))
    assert draws.shape == (20000, 7) and bool(((draws >= 0) & (draws <= 1)).all())
    torch.testing.assert_close(draws.mean(0), torch.tensor(MODEL.means), atol=0.01, rtol=0)


def test_tokens_per_round_match_the_expected_tau():
    """Verify-all rounds yield 1 + sum_k prod_{j<=k} c_j tokens on average; verify-1 yields 1 + E[c_1]."""
    flat = VerificationCostTable([1.0] * 64)
    everything = simulate_policy("all", None, requests=8, rounds=3000, confidence_model=MODEL, costs=flat,
                                 draft_seconds=lambda r, g: 0.0)
    assert math.isclose(everything.tokens / (3000 * 8), expected_tau(MODEL.means), rel_tol=0.02)
    one = simulate_policy("fixed", 1, requests=8, rounds=3000, confidence_model=MODEL, costs=flat,
                          draft_seconds=lambda r, g: 0.0)
    assert math.isclose(one.tokens / (3000 * 8), 1 + MODEL.means[0], rel_tol=0.02)
    plain = simulate_policy("plain", None, requests=8, rounds=10, confidence_model=MODEL, costs=flat,
                            draft_seconds=lambda r, g: 5.0)
    assert plain.tokens == 80 and plain.seconds == 10.0  # one token per request, no drafting cost


def test_rounds_are_charged_the_verified_batch_and_the_drafting():
    costs = VerificationCostTable([float(b) for b in range(1, 65)])  # B tokens cost B seconds
    result = simulate_policy("fixed", 2, requests=4, rounds=5, confidence_model=MODEL, costs=costs,
                             draft_seconds=lambda r, g: 0.5)
    assert result.seconds == 5 * (4 * 3 + 0.5) and result.verified_drafts == 2


def test_threshold_lengths_stop_at_the_first_low_survival():
    confidences = torch.tensor([[0.9, 0.9, 0.2, 0.9], [0.4, 0.9, 0.9, 0.9]])
    assert policy_lengths("threshold", 0.5, confidences).tolist() == [2, 0]


def test_scheduler_adapts_to_load_on_a_gpu_like_curve():
    """Light load: it verifies (nearly) everything, like verify-all. Past saturation it verifies fewer drafts
    and beats both fixed policies."""
    table, draft = gpu_like_costs()
    results = {}
    for requests in (4, 128):
        scheduler = DSparkScheduler(VerificationCostTable(table.seconds, draft(requests, 7)))
        for name, policy, arg in (("all", "all", None), ("one", "fixed", 1), ("sched", "scheduler", scheduler)):
            results[name, requests] = simulate_policy(policy, arg, requests=requests, rounds=60,
                                                      confidence_model=MODEL, costs=table, draft_seconds=draft)
    assert results["sched", 4].verified_drafts > 6.5
    assert results["sched", 128].verified_drafts < results["sched", 4].verified_drafts - 2
    best_fixed = max(results["all", 128].aggregate_tokens_per_second, results["one", 128].aggregate_tokens_per_second)
    assert results["sched", 128].aggregate_tokens_per_second > 1.1 * best_fixed


def test_the_defaults_stop_paying_for_drafts_that_never_pay_and_draft_where_they_do():
    """Past saturation (512 requests) drafting costs more than it returns: the policy, deciding before drafting from
    prices it learns, approaches plain decoding, while the admission rule alone pays for a drafting pass every round;
    at light load it drafts as verify-all does."""
    table, draft = gpu_like_costs()
    run = lambda policy, requests, planning: simulate_policy(  # noqa: E731
        policy, None, requests=requests, rounds=200, confidence_model=MODEL, costs=table, draft_seconds=draft,
        planning=planning).aggregate_tokens_per_second
    plain, planned, unplanned = (run("plain", 512, False), run("scheduler", 512, True), run("scheduler", 512, False))
    assert planned > unplanned and planned > 0.9 * plain
    assert run("scheduler", 4, True) > 0.95 * run("all", 4, False) > 2 * run("plain", 4, False)


def test_the_simulated_rule_looks_ahead_as_the_loops_rule_does():
    """A price jump at two tokens (a CPU's, where one draft costs as much as the anchor) repaid by the slots behind it:
    the loops' rule looks ahead at the rates it learnt and verifies the whole block at A = 0.9; the next slot alone
    (the simulation's rule before it was wired as the loops' is) never pays for the jump."""
    table = VerificationCostTable([1.0, 2.0] + [2.0 + 0.02 * k for k in range(1, 62)])
    accepted = lambda confidences: torch.full_like(confidences, 0.9)  # noqa: E731
    result = simulate_policy("scheduler", None, requests=1, rounds=200, confidence_model=MODEL, costs=table,
                             draft_seconds=lambda r, g: 0.1, acceptance=accepted)
    assert result.verified_drafts > 6.0  # of 7 a round
