"""The chi-square checks shared by the lossless-sampling tests: statistics and critical values, the exact joint of
three consecutive tokens, and the check that the sampled counts follow it while a biased sampler would fail."""

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper


def assert_three_tokens_match(counts: torch.Tensor, joint: torch.Tensor, biased: torch.Tensor, samples: int) -> None:
    """Sampled counts of three consecutive tokens (a, b, c) follow the exact joint `joint`, on (a, b), on (b, c) and
    on the whole joint; and the same bound would reject the double-temperature sampler `biased` (power > 3), so
    the check is strong enough to catch that classic bug."""
    power = [
        assert_matches(counts.sum(2), joint.sum(2), biased.sum(2), samples),  # (a, b)
        assert_matches(counts.sum(0), joint.sum(0), biased.sum(0), samples),  # (b, c)
        assert_matches(counts, joint, biased, samples),  # (a, b, c)
    ]
    assert max(power) > 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic over the cells the target can produce; any sample outside them is infinitely wrong."""
    total = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return float("inf")
    expected = probs[support] * total
    return float(((counts[support] - expected) ** 2 / expected).sum())


def critical_value(dof: int) -> float:
    """Chi-square quantile at p = 1e-4 (Wilson-Hilferty), so a correct sampler fails ~1 run in 10^4."""
    z = 3.719
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def expected_statistic(biased: torch.Tensor, probs: torch.Tensor, samples: int) -> float:
    support = probs > 0
    off_support = biased[~support].sum()
    if off_support > 0:
        return float("inf")
    return float(samples * ((biased[support] - probs[support]) ** 2 / probs[support]).sum())


TINY_VOCAB = 6


def exact_three_token_distribution(target, ids, temperature, top_p):
    """P(x1, x2, x3) of plain sampling with the same warpers, computed from the target's logits."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])

    def next_probs(prefix):
        with torch.no_grad():
            return warpers(prefix, target(prefix).logits[:, -1]).softmax(-1)[0]

    joint = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB, device=ids.device)
    p1 = next_probs(ids)
    for x1 in range(TINY_VOCAB):
        prefix1 = torch.cat([ids, ids.new_tensor([[x1]])], dim=-1)
        p2 = next_probs(prefix1)
        for x2 in range(TINY_VOCAB):
            if p1[x1] * p2[x2] > 0:
                joint[x1, x2] = p1[x1] * p2[x2] * next_probs(torch.cat([prefix1, ids.new_tensor([[x2]])], dim=-1))
    return joint.cpu()  # compared with sample counts kept on the CPU


def assert_matches(counts: torch.Tensor, probs: torch.Tensor, biased: torch.Tensor, samples: int):
    counts, probs, biased = counts.reshape(-1), probs.reshape(-1), biased.reshape(-1)
    bound = critical_value(int((probs > 0).sum()) - 1)
    assert chi_square(counts, probs) < bound
    return expected_statistic(biased, probs, samples) / bound
