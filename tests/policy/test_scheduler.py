"""The admission rule after drafting (`DSparkScheduler`): widths admitted while throughput rises, agreement with the
batch-1 reading of the rule, and the paper's Appendix A (early stop keeps sampling exact; the global best does
not)."""

import pytest
import torch

from hf_dspark.generation.round.verification import rejection_sample
from hf_dspark.policy import CostModel, DSparkScheduler, VerificationCostTable
from hf_dspark.policy.acceptance import SlotAcceptance
from lossless_checks import chi_square, critical_value


def test_admits_widths_while_throughput_rises_and_stops_at_the_first_drop():
    # Two rows padded to the widest: a round of width W is a forward over 2W tokens, F = 1 + 0.1 (2W - 1).
    table = VerificationCostTable([1.0 + 0.1 * i for i in range(8)])
    confidences = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.9, 0.9]])
    # survivals: r0 (0.9, 0.81, 0.081), r1 (0.5, 0.45, 0.405). W = 1: 2 / 1.1 = 1.82; W = 2: 3.4 / 1.3 = 2.62;
    # W = 3: 4.66 / 1.5 = 3.11; W = 4: 5.146 / 1.7 = 3.03 stops.
    lengths = DSparkScheduler(table).select_lengths(confidences)
    assert lengths.tolist() == [2, 2]
    # A price that jumps (a kernel change) and then stays: two rows, F(2, 1) = 1, F(2, 2..4) = 1.5. The next slot alone
    # never repays the jump (W = 2: 2.4 / 1.5 < 2); where earlier rounds accepted every later slot, the slots behind
    # it do (2.4 + 0.4 * 2 over 1.5 > 2), and the rule crosses it; a first slot that reads 0.05 stays below.
    step = VerificationCostTable([1.0, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5])
    sure = SlotAcceptance([100.0] * 3, [100.0] * 3)
    crossing = torch.tensor([[0.2, 1.0, 1.0], [0.2, 1.0, 1.0]])
    assert DSparkScheduler(step).select_lengths(crossing).tolist() == [0, 0]
    assert DSparkScheduler(step, acceptance=sure).select_lengths(crossing).tolist() == [3, 3]
    assert DSparkScheduler(step, acceptance=sure).select_lengths(torch.tensor([[0.05, 1.0, 1.0]] * 2)).tolist() == [0, 0]


def test_lengths_respect_available_drafts_and_flat_costs_admit_everything():
    table = VerificationCostTable([1.0] * 16)
    confidences = torch.full((3, 4), 0.5)
    lengths = DSparkScheduler(table).select_lengths(confidences, max_lengths=torch.tensor([4, 1, 0]))
    assert lengths.tolist() == [4, 1, 0]


def test_single_request_matches_the_incremental_draft_length_rule():
    """The device's reading of the rule against a plain one at batch 1: admit slot k + 1 while some width, the slots
    past k + 1 expected at the earlier rounds' rates, beats the current one."""
    generator = torch.Generator().manual_seed(0)
    table = VerificationCostTable([1.0, 1.3, 1.55, 2.4, 2.5, 2.6, 3.0, 3.4])  # a jump at four tokens
    prices = CostModel(table, learn=False).forward_prices(1, 8)
    for _ in range(300):
        confidences = torch.rand(1, 7, generator=generator) ** 0.3
        rates = (torch.rand(7, generator=generator) ** 0.3).tolist()
        acceptance = SlotAcceptance([1e6] * 7, [1e6 * r for r in rates])
        rates = acceptance.means(7)
        batch = int(DSparkScheduler(table, acceptance=acceptance).select_lengths(confidences)[0])
        survivals = [1.0] + confidences[0].cumprod(0).tolist()
        expected, length = 1.0, 0
        while length < 7:
            known = expected + survivals[length + 1]  # slot length + 1 admitted
            best, projected, survival = known / prices[length + 1], known, survivals[length + 1]
            for later in range(length + 2, 8):
                survival *= rates[later - 1]
                projected += survival
                best = max(best, projected / prices[later])
            if best <= expected / prices[length]:
                break
            expected, length = known, length + 1
        assert batch == length


def appendix_a_first_token_counts(early_stop: bool, samples: int = 40000, seed: int = 0) -> torch.Tensor:
    """One request, gamma 2, SPS(1..3) = (1.0, 0.5, 0.45); c1 = 0.8, c2 = 0.9 after A and 0 after B;
    p_target = (0.7, 0.3) and p_draft = (0.5, 0.5) at the first slot. Returns counts of the first emitted token."""
    generator = torch.Generator().manual_seed(seed)
    scheduler = DSparkScheduler(VerificationCostTable.from_steps_per_second([1.0, 0.5, 0.45]), early_stop=early_stop)
    p_target, p_draft = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])
    first_draft = torch.multinomial(p_draft, samples, replacement=True, generator=generator)
    lengths = torch.empty(samples, dtype=torch.long)
    for token in (0, 1):  # the length depends on the draft only through c2(x1)
        c2 = 0.9 if token == 0 else 0.0
        lengths[first_draft == token] = int(scheduler.select_lengths(torch.tensor([[0.8, c2]]))[0].clamp(max=1))
    # Only the first emitted token matters: verify at most the first slot.
    accepted, next_token = rejection_sample(first_draft[:, None], p_draft.expand(samples, 1, 2),
                                            p_target.expand(samples, 2, 2), draft_lengths=lengths,
                                            generator=generator)
    first = torch.where(accepted > 0, first_draft, next_token)
    return torch.bincount(first, minlength=2).float()


def test_appendix_a_early_stop_is_exact():
    counts = appendix_a_first_token_counts(early_stop=True)
    assert chi_square(counts, torch.tensor([0.7, 0.3])) < critical_value(1)


def test_appendix_a_global_best_is_biased_to_085():
    counts = appendix_a_first_token_counts(early_stop=False)
    assert chi_square(counts, torch.tensor([0.85, 0.15])) < critical_value(1)
    assert chi_square(counts, torch.tensor([0.7, 0.3])) > 100 * critical_value(1)


def test_calibration_metrics_match_hand_values():
    from hf_dspark.evaluation.calibration import auroc, expected_calibration_error

    assert expected_calibration_error(torch.tensor([0.1, 0.1, 0.9, 0.9]), torch.tensor([0, 1, 1, 1])) == \
        pytest.approx(0.25)
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)


def test_sequential_temperature_scaling_recovers_overconfidence():
    from hf_dspark.generation.round.stats import SpeculativeStats
    from hf_dspark.evaluation.calibration import expected_calibration_error, fit_sequential_temperatures
    from hf_dspark.evaluation.calibration import survival_pairs

    generator = torch.Generator().manual_seed(0)
    stats = SpeculativeStats()
    for _ in range(6000):  # true acceptance is sigmoid(l / 2); the head reports sigmoid(l): overconfident
        logits = torch.randn(3, generator=generator) * 3 + 1
        true = torch.sigmoid(logits / 2)
        accepted = 0
        while accepted < 3 and torch.rand(1, generator=generator) < true[accepted]:
            accepted += 1
        stats.record(3, accepted, torch.sigmoid(logits).tolist())
    temperatures = fit_sequential_temperatures(stats, block_size=3)
    assert all(1.6 < t < 2.5 for t in temperatures), temperatures
    logits, outcome = survival_pairs(stats, 2)
    raw = torch.sigmoid(logits).prod(1)
    scaled = torch.sigmoid(logits / torch.tensor(temperatures, dtype=torch.float64)).prod(1)
    assert expected_calibration_error(scaled, outcome) < 0.5 * expected_calibration_error(raw, outcome)


def test_generation_applies_the_stored_temperatures():
    from factories import prompts, tiny_drafter, tiny_target

    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4, confidence_temperatures=[1000.0] * 4)
    ids = prompts(1)[0]
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=10)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=10))
    flat = [c for round_ in drafter.last_generation_stats.confidences for c in round_]
    assert flat and all(abs(c - 0.5) < 0.01 for c in flat)
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises((ValueError, StrictDataclassClassValidationError), match="one per drafted slot"):
        tiny_drafter(target, "markov", block_size=4, confidence_temperatures=[1.0])

@pytest.mark.parametrize("seconds", [
    [5.0, 4.0, 3.0, 2.0, 1.0],  # falling: the old straight line reached 0 s at B = 6 (ZeroDivisionError)
    [1.0 + 0.002 * (-1) ** i - 0.001 * i for i in range(8)],  # noisy flat GPU profile: negative at B = 400
    [1.0, 1.2, 1.1, 1.3, 1.25, 1.4, 1.35, 1.5],  # rising with noise
    [2.0],
])
def test_cost_extrapolation_never_falls_below_the_largest_measured_cost(seconds):
    table = VerificationCostTable(seconds, draft_seconds=0.25)
    beyond = [table.round_seconds(n) for n in range(table.max_tokens + 1, 1000, 7)]
    assert min(beyond) >= max(seconds) + 0.25
    assert all(b <= a for a, b in zip(beyond[1:], beyond))  # monotone: more tokens never cost less
    assert all(0 < table.steps_per_second(n) <= 1 / (max(seconds) + 0.25) for n in range(len(seconds) + 1, 500))
    if seconds[-1] > seconds[0]:  # a rising table keeps rising past its end
        assert beyond[-1] > beyond[0]
    # The scheduler's choice at a large batch is defined (no zero or negative price of a round).
    scheduler = DSparkScheduler(table)
    lengths = scheduler.select_lengths(torch.full((400, 4), 0.9))
    assert lengths.shape == (400,) and bool((lengths >= 0).all())


def test_cost_table_refuses_impossible_times():
    for bad in ([], [0.0], [1.0, -1.0], [1.0, float("nan")], [float("inf")], ["fast"]):
        with pytest.raises(ValueError, match="time from"):
            VerificationCostTable(bad)
    with pytest.raises(ValueError, match="draft_seconds"):
        VerificationCostTable([1.0], draft_seconds=-0.5)
    with pytest.raises(ValueError, match="at least 1 token"):
        VerificationCostTable([1.0]).round_seconds(0)
