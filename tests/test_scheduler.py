"""The DSpark scheduler: the ranking rule, agreement with the batch-1 draft-length rule, and the paper's Appendix A
(early stop keeps sampling exact; the global best does not)."""

from collections import Counter

import pytest
import torch

from hf_dspark.generation.round.verification import rejection_sample
from hf_dspark.scheduling import DSparkScheduler, VerificationCostTable
from test_sampling_lossless import chi_square, critical_value


def test_admits_highest_survivals_first_until_throughput_stops_rising():
    # SPS(B) = 1 / (1 + 0.1 (B - 1)): B = 2 -> 0.909, 3 -> 0.833, 4 -> 0.769, 5 -> 0.714
    table = VerificationCostTable([1.0 + 0.1 * i for i in range(8)])
    confidences = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.9, 0.9]])
    # survivals: r0 (0.9, 0.81, 0.081), r1 (0.5, 0.45, 0.405). Start: 2 tokens * SPS(2).
    # +0.9 -> 2.9*0.833=2.42 > 1.82; +0.81 -> 3.71*0.769=2.85; +0.5 -> 4.21*0.714=3.01; +0.45 -> 4.66*0.667=3.11;
    # +0.405 -> 5.065*0.625=3.17; +0.081 -> 5.146*0.588=3.03 stops.
    lengths = DSparkScheduler(table).select_lengths(confidences)
    assert lengths.tolist() == [2, 3]


def test_lengths_respect_available_drafts_and_flat_costs_admit_everything():
    table = VerificationCostTable([1.0] * 16)
    confidences = torch.full((3, 4), 0.5)
    lengths = DSparkScheduler(table).select_lengths(confidences, max_lengths=torch.tensor([4, 1, 0]))
    assert lengths.tolist() == [4, 1, 0]


def test_single_request_matches_the_incremental_draft_length_rule():
    generator = torch.Generator().manual_seed(0)
    table = VerificationCostTable([1.0, 1.3, 1.55, 1.9, 2.2, 2.6, 3.0, 3.4])
    for _ in range(200):
        confidences = torch.rand(1, 7, generator=generator) ** 0.3
        batch = int(DSparkScheduler(table).select_lengths(confidences)[0])
        # The batch-1 reading of the rule: admit slot k while E(k) / cost(k + 1) rises (E(k) = 1 + S_1 + ... + S_k).
        expected, rate, length = 1.0, 1.0 / table.padded_round_seconds(1), 0
        for survival in confidences[0].cumprod(0).tolist():
            admitted = (expected + survival) / table.padded_round_seconds(length + 2)
            if admitted <= rate:
                break
            expected, rate, length = expected + survival, admitted, length + 1
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
    from hf_dspark.scheduling import auroc, expected_calibration_error

    assert expected_calibration_error(torch.tensor([0.1, 0.1, 0.9, 0.9]), torch.tensor([0, 1, 1, 1])) == \
        pytest.approx(0.25)
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)


def test_sequential_temperature_scaling_recovers_overconfidence():
    from hf_dspark.generation.round.stats import SpeculativeStats
    from hf_dspark.scheduling import expected_calibration_error, fit_sequential_temperatures
    from hf_dspark.scheduling.calibration import survival_pairs

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
    from conftest import prompts, tiny_drafter, tiny_target

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


# ---------------------------------------------------------------------------------------------------------
# mode="two_steps_ago": the budget K from stored confidences, the top K of this round
# ---------------------------------------------------------------------------------------------------------

# Two rows. SPS(B): B = 2 -> 1, B = 3..5 -> 1 / 1.5, B >= 6 -> 1 / 3: the first admission costs more than it can
# bring, two or three bring more than they cost, a fourth doubles the cost.
STEP_TABLE = VerificationCostTable([1.0, 1.0, 1.5, 1.5, 1.5, 3.0, 3.0, 3.0])
# Survivals r0 (0.9, 0.81, 0.081), r1 (0.5, 0.45, 0.405), ranked 0.9, 0.81, 0.5, 0.45, ...
# E * SPS: n = 0: 2; 1: 2.9 / 1.5 = 1.93; 2: 3.71 / 1.5 = 2.47; 3: 4.21 / 1.5 = 2.81; 4: 4.66 / 3 = 1.55; less after.
# Early stop admits 0; the global best is K = 3.
CONFIDENT = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.9, 0.9]])
# Survivals 0.1, 0.01, 0.001 per row: every admission lowers throughput, K = 0.
DOUBTFUL = torch.full((2, 3), 0.1)
# Survivals r0 (0.3, 0.27, 0.243), r1 (0.8, 0.72, 0.36): the top three are all row 1's.
CURRENT = torch.tensor([[0.3, 0.9, 0.9], [0.8, 0.9, 0.5]])


def test_two_steps_ago_budget_comes_from_the_confidences_two_rounds_earlier():
    scheduler = DSparkScheduler(STEP_TABLE, mode="two_steps_ago")
    assert scheduler.batch_budget(CONFIDENT) == 3 and scheduler.batch_budget(DOUBTFUL) == 0
    assert DSparkScheduler(STEP_TABLE).select_lengths(CONFIDENT).tolist() == [0, 0]  # the early stop admits none
    assert scheduler.select_lengths(CONFIDENT).tolist() == [0, 0]  # round 1: fallback (early stop)
    assert scheduler.select_lengths(DOUBTFUL).tolist() == [0, 0]  # round 2: fallback
    # Round 3: K = 3 from round 1 (not 0 from round 2, nor 0 from this round's early stop); the top three
    # survivals of this round are row 1's 0.8, 0.72, 0.36 (row 0's best is 0.3).
    assert scheduler.select_lengths(CURRENT).tolist() == [0, 3]
    assert scheduler.select_lengths(CONFIDENT).tolist() == [0, 0]  # round 4: K = 0 from round 2
    # Round 5: K from round 3's CURRENT: 0.8, 0.72, 0.36 -> 3.88 / 1.5 = 2.59 is the best; top three of CONFIDENT.
    assert scheduler.batch_budget(CURRENT) == 3
    assert scheduler.select_lengths(CONFIDENT).tolist() == [2, 1]


def test_two_steps_ago_lengths_are_the_top_k_survivals_as_row_prefixes():
    scheduler = DSparkScheduler(STEP_TABLE, mode="two_steps_ago")
    scheduler.select_lengths(CONFIDENT)  # K = 3 for round 3
    scheduler.select_lengths(CONFIDENT)  # K = 3 for round 4
    # All survivals 0.5: ties go to the earlier slot, then the earlier row: (0, 0), (1, 0), (0, 1).
    tied = torch.tensor([[0.5, 1.0, 1.0], [0.5, 1.0, 1.0]])
    assert scheduler.select_lengths(tied).tolist() == [2, 1]
    # Fewer drafts available than K: every available one, never a slot past a row's max length.
    assert scheduler.select_lengths(CURRENT, max_lengths=torch.tensor([1, 1])).tolist() == [1, 1]


def test_two_steps_ago_first_rounds_fall_back_and_reset_forgets():
    table = VerificationCostTable([1.0 + 0.1 * i for i in range(8)])
    confidences = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.9, 0.9]])
    expected = DSparkScheduler(table).select_lengths(confidences).tolist()  # [2, 3], see the first test
    scheduler = DSparkScheduler(table, mode="two_steps_ago")
    doubtful = torch.full((2, 3), 0.01)
    assert scheduler.select_lengths(confidences).tolist() == expected
    assert scheduler.select_lengths(doubtful).tolist() == [0, 0]  # fallback on this round's own confidences
    assert scheduler.select_lengths(doubtful).sum() == 5  # K = 5 from round 1: everything but 0.081
    scheduler.reset()
    assert scheduler.select_lengths(doubtful).tolist() == [0, 0]  # falls back again
    assert scheduler.select_lengths(confidences).tolist() == expected
    with pytest.raises(ValueError, match="mode"):
        DSparkScheduler(table, mode="one_step_ago")


@pytest.mark.slow  # a sampling-distribution test
def test_two_steps_ago_batched_sampling_matches_target_distribution():
    """The batched engine with the stored-budget scheduler keeps the target's distribution.

    With this cost table the first admission never pays (a step from B = 40 to 41 costs 30 %) but many do, so the
    fallback rounds 1 and 2 verify no drafts (x2, x3 come from the target alone) while from round 3 on each batch
    verifies its top K drafts, K taken from the confidences of two rounds before. The test compares the joint of
    (x4, x5, x6), emitted by those rounds, with its exact value: the target's joint of six tokens, marginalised.
    """
    from conftest import tiny_drafter, tiny_target
    from lossless_checks import assert_three_tokens_match
    from test_sampling_lossless import TINY_VOCAB

    from hf_dspark.generation import batched_speculative_generate

    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)
    drafter = tiny_drafter(target, "markov", block_size=3)
    drafter.config.confidence_temperatures = [0.05, 0.15, 0.15]
    drafter.generation_config.dspark_round_planning = False  # the scheduler alone decides which rounds draft
    batch = 40
    table = VerificationCostTable([1.0] * batch + [1.3 + 0.01 * n for n in range(3 * batch)])
    prompt = torch.tensor([[1, 4, 2, 5]])
    temperature, top_p = 0.7, 0.9
    joint = last_three_of_six(target, prompt, temperature, top_p)
    biased = last_three_of_six(target, prompt, temperature * temperature, top_p)

    scheduler = DSparkScheduler(table, mode="two_steps_ago")
    ids = prompt.repeat(batch, 1)
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    third_round = Counter()
    drafted = accepted = 0
    calls = 60
    for _ in range(calls):
        out = batched_speculative_generate(
            target, drafter, ids, torch.ones_like(ids), max_new_tokens=8, do_sample=True, temperature=temperature,
            top_p=top_p, policy="scheduler", policy_arg=scheduler, generator=generator,
        )
        for sequence, stats in zip(out.sequences, out.stats):
            counts[tuple(sequence[7:10].tolist())] += 1
            assert stats.draft_lengths[:2] == [0, 0]
            third_round[stats.draft_lengths[2]] += 1
            drafted += sum(stats.draft_lengths)
            accepted += sum(stats.accepted)
    samples = batch * calls
    assert len(third_round) >= 3  # the top-K round verifies different lengths per row (budget 3 each)
    assert 0.05 * drafted < accepted < 0.95 * drafted  # both accepted and rejected drafts occurred
    assert_three_tokens_match(counts, joint, biased, samples)  # (x4, x5, x6)


def last_three_of_six(target, prompt, temperature, top_p) -> torch.Tensor:
    """P(x4, x5, x6) of plain sampling with these warpers: the exact joint of six new tokens, level by level over
    every prefix (vocabulary 6: 6^5 contexts for the last level), summed over x1..x3."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
    vocab = target.config.vocab_size
    contexts, probs = prompt, torch.ones(1)
    with torch.no_grad():
        for level in range(6):
            if level:  # every context followed by every token, in the order of `probs`
                contexts = torch.cat([contexts.repeat_interleave(vocab, dim=0),
                                      torch.arange(vocab).repeat(contexts.shape[0])[:, None]], dim=1)
            step = warpers(contexts, target(contexts).logits[:, -1]).softmax(-1)  # (N, V)
            probs = (probs[:, None] * step).reshape(-1)
    return probs.reshape(vocab ** 3, vocab, vocab, vocab).sum(0)


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
        with pytest.raises(ValueError, match="positive, finite time"):
            VerificationCostTable(bad)
    with pytest.raises(ValueError, match="draft_seconds"):
        VerificationCostTable([1.0], draft_seconds=-0.5)
    with pytest.raises(ValueError, match="at least 1 token"):
        VerificationCostTable([1.0]).round_seconds(0)
