"""Sampled speculative output must follow the target distribution exactly.

Each test also computes how a biased sampler would score against the same bound, so a test that passes
proves the bound is tight enough to catch real bias. The verifier and end-to-end tests run on every device (the
`device` fixture: the CPU, and CUDA when present).
"""


import pytest
import torch

from hf_dspark.policy import DSparkScheduler, VerificationCostTable

from hf_dspark import DraftingState, rejection_sample
from factories import tiny_drafter, tiny_target
from lossless_checks import TINY_VOCAB, assert_matches, chi_square, critical_value, exact_three_token_distribution, expected_statistic


# ---------------------------------------------------------------------------------------------------------
# The verifier alone, on fixed distributions
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_length", [1, 3])
def test_rejection_sampling_emits_target_distribution(draft_length, device):
    torch.manual_seed(0)
    vocab, rows = 5, 40000
    p = torch.softmax(torch.randn(draft_length + 1, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(draft_length, vocab) * 1.5, dim=-1)
    q[0, 0] = 0.0  # a token the draft never proposes must still be produced at the target's rate
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[i], rows, replacement=True) for i in range(draft_length)], dim=1)
    p, q, drafts = p.to(device), q.to(device), drafts.to(device)  # drawn on the CPU: the same inputs everywhere
    num_accepted, next_token = rejection_sample(
        drafts, q.expand(rows, -1, -1), p.expand(rows, -1, -1), generator=torch.Generator(device=device).manual_seed(1)
    )
    first = torch.where(num_accepted > 0, drafts[:, 0], next_token)
    counts = torch.bincount(first, minlength=vocab).float()
    bound = critical_value(vocab - 1)
    assert chi_square(counts, p[0]) < bound
    # Power: accepting drafts unconditionally would emit q; accepting with probability p/q unclipped... both fail.
    assert expected_statistic(q[0], p[0], rows) > 5 * bound

    # Given the first draft was accepted, the second emitted token must follow p_2 as well.
    if draft_length > 1:
        second = torch.where(num_accepted > 1, drafts[:, 1], next_token)[num_accepted > 0]
        counts = torch.bincount(second, minlength=vocab).float()
        assert chi_square(counts, p[1]) < bound
    # All-accepted rows emit the bonus token from the last target distribution.
    bonus = next_token[num_accepted == draft_length]
    assert chi_square(torch.bincount(bonus, minlength=vocab).float(), p[-1]) < bound


def test_per_row_draft_lengths_are_respected():
    p = torch.full((3, 4, 6), 1 / 6)
    q = torch.full((3, 3, 6), 1 / 6)
    drafts = torch.zeros(3, 3, dtype=torch.long)
    num_accepted, _ = rejection_sample(drafts, q, p, draft_lengths=torch.tensor([0, 2, 3]))
    assert num_accepted.tolist() == [0, 2, 3]  # p == q: every drafted slot is accepted, no slot past the length


# ---------------------------------------------------------------------------------------------------------
# End to end through target.generate on a tiny-vocabulary target
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["markov", "eagle3", "dflash2", "markov-scheduled", "markov-suffix", "eagle3-suffix",
                                  "markov-slot0unused"])
@pytest.mark.slow  # a sampling-distribution test
def test_generate_sampling_matches_target_distribution(kind, device):
    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None,
                         bos_token_id=None).to(device)
    # slot0unused: the speculators / z-lab convention (slot j predicts anchor + j), drafting from block slot 1.
    drafter = tiny_drafter(target, kind.split("-")[0], block_size=3,
                           **({"sample_from_anchor": False} if kind.endswith("slot0unused") else {})).to(device)
    if kind.endswith("scheduled"):
        # The first slot is drafted only when its predicted survival is at least 0.515, a choice that differs
        # between anchors: the length varies with c_1 and must not bias what is emitted.
        drafter.generation_config.dspark_cost_table = VerificationCostTable([1.0, 1.515])
        # This checks the confidence schedule's length, drafted every round, at the table's prices and on the
        # confidences as the head gives them (a scheduler of the test's own: no calibration moves the threshold).
        drafter.generation_config.update(dspark_round_planning=False,
                                         dspark_verification_policy=DSparkScheduler(VerificationCostTable([1.0, 1.515])))
    # Suffix drafting: with drafting priced far above a verification forward, x2 is drafted by a one-hot suffix
    # proposal whenever x1 occurred in the prompt, and otherwise not drafted at all (a plain step).
    drafter.generation_config.dspark_suffix_drafting = kind.endswith("suffix")
    if not kind.endswith(("scheduled", "suffix")):
        drafter.generation_config.dspark_learn_round_costs = False  # flat prices: every round drafts
    if kind.endswith("suffix"):
        drafter.generation_config.dspark_cost_table = VerificationCostTable([1.0, 1.0], draft_seconds=5.0)
        drafter.generation_config.dspark_learn_round_costs = False  # the table is the truth, not the tiny models' cost
    state = DraftingState()  # what rounds learn carries across the samples
    ids = torch.tensor([[1, 4, 2, 5]], device=device)
    temperature, top_p = 0.7, 0.9
    joint = exact_three_token_distribution(target, ids, temperature, top_p)
    # Temperature applied twice (0.49), the classic assisted-decoding bug.
    biased = exact_three_token_distribution(target, ids, temperature * temperature, top_p)

    torch.manual_seed(2024)
    samples = 2500
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    rounds_with_accepts, drafted_rounds, suffix_rounds = 0, 0, 0
    for _ in range(samples):
        # x1 comes from the prefill; x2 is a drafted slot (accepted or resampled); x3 a correction or bonus.
        out = target.generate(
            ids, assistant_model=drafter, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
            max_new_tokens=3, dspark_state=state,
        )
        x1, x2, x3 = out[0, -3:].tolist()
        counts[x1, x2, x3] += 1
        stats = drafter.last_generation_stats
        assert stats.draft_lengths[0] == 1 or kind.endswith(("scheduled", "suffix"))
        drafted_rounds += stats.draft_lengths[0]
        rounds_with_accepts += stats.accepted[0]
        suffix_rounds += stats.sources[0] == "suffix"
    assert 0.05 * drafted_rounds < rounds_with_accepts < 0.95 * drafted_rounds  # both accept and reject paths ran
    if kind.endswith("scheduled"):
        assert 0.05 * samples < drafted_rounds < 0.95 * samples  # the schedule both drafted and declined
    if kind.endswith("suffix"):
        assert 0.05 * samples < suffix_rounds < 0.95 * samples  # suffix and drafter proposals both ran
    else:
        assert suffix_rounds == 0

    power = [
        assert_matches(counts.sum(2), joint.sum(2), biased.sum(2), samples),  # (x1, x2)
        assert_matches(counts.sum(0), joint.sum(0), biased.sum(0), samples),  # (x2, x3)
        assert_matches(counts.sum((0, 1)), joint.sum((0, 1)), biased.sum((0, 1)), samples),  # x3
    ]
    # The same bound rejects the biased sampler by a wide margin on the joint tables.
    assert max(power) > 3
