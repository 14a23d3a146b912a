"""The chi-square check shared by the lossless-sampling tests that count three consecutive sampled tokens."""

import torch

from test_sampling_lossless import assert_matches


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
