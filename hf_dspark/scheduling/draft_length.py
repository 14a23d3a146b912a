"""Confidence-scheduled draft length for one request: the DSpark scheduler's rule at batch size 1.

Slot k is admitted while the expected throughput still rises:

    E(k) = 1 + S_1 + ... + S_k            (expected tokens of a round with k drafts; the 1 is the bonus token)
    T(k) = E(k) / cost(k + 1)             (cost of verifying k drafts + 1, from a profiled cost table, where the
                                          verification may be padded to a cheaper larger size: `padded_tokens`)

with S_j = c_1 * ... * c_j the predicted survival of the first j drafts. Drafting stops at the first slot whose
admission would not raise T (the DSpark scheduler's early stop, `DSparkScheduler` at R = 1). The decision uses c_1..c_k only, never the drafted tokens' verification, so the output
distribution is untouched: it only changes how many drafts are verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost_table import VerificationCostTable


class ThroughputDraftLength:
    """Call `start()` at the beginning of a round, then `admit(survival)` for each slot in order."""

    def __init__(self, cost_table: VerificationCostTable):
        self.cost_table = cost_table
        self.start()

    def start(self) -> None:
        self.expected, self.length = 1.0, 0
        self.rate = self.expected / self.cost_table.padded_round_seconds(1)

    def admit(self, survival: float) -> bool:
        expected = self.expected + survival
        rate = expected / self.cost_table.padded_round_seconds(self.length + 2)
        if rate <= self.rate:
            return False
        self.expected, self.rate, self.length = expected, rate, self.length + 1
        return True


DRAFTER, SUFFIX, NO_DRAFT = "drafter", "suffix", "none"


class RoundPlanner:
    """Which proposal a batch-1 round verifies, decided before drafting from earlier rounds only.

    Candidates, each priced as expected tokens per second of its round:

    * no draft (a plain decoding step): 1 token for a one-token forward;
    * a suffix proposal of m tokens (`SuffixIndex`): `SuffixAcceptance.expected_tokens(n, m)` for a forward over
      m + 1 tokens, with the best m up to the proposal's length;
    * the drafter's block: the smoothed rate of its recent rounds, each its expected tokens (from its confidences,
      1 + c_1 + c_1 c_2 + ... over the slots it verified, or its accepted count without a confidence head) over
      the drafting cost plus a forward over those slots + 1.

    Costs come from the `VerificationCostTable`; without one every forward costs the same and drafting nothing (a
    GPU-like machine), so the drafter or a suffix proposal always beats a plain step. A drafter that has not run
    for `probe_every` rounds runs once to refresh its estimate. Whatever is chosen, the verifier's rule keeps the
    output exactly the target's: the choice depends on earlier rounds, never on this round's drafts. A proposal is
    preferred to a plain step only when it promises `margin` times its rate (estimates err; the plain step's cost
    is measured).
    """

    def __init__(self, cost_table: VerificationCostTable | None, has_confidences: bool, statistics: "ProposalStatistics",
                 probe_every: int = 16, smoothing: float = 0.5, margin: float = 1.05):
        self.cost_table, self.has_confidences, self.statistics = cost_table, has_confidences, statistics
        self.probe_every, self.smoothing, self.margin = probe_every, smoothing, margin

    def forward_seconds(self, num_tokens: int) -> float:
        if self.cost_table is None:
            return 1.0
        return self.cost_table.padded_round_seconds(num_tokens) - self.cost_table.draft_seconds

    def round_rate(self, expected: float, num_tokens: int) -> float:
        """Expected tokens per second of a drafter round verifying `num_tokens` tokens."""
        draft_seconds = self.cost_table.draft_seconds if self.cost_table is not None else 0.0
        return expected / (draft_seconds + self.forward_seconds(num_tokens))

    def drafter_rate(self) -> float:
        rate = self.statistics.drafter_rate
        return float("inf") if rate is None else rate  # never measured: run it

    def choose(self, proposal: list[int], match_length: int) -> tuple[str, int]:
        """(DRAFTER | SUFFIX | NO_DRAFT, suffix tokens to verify)."""
        # A proposal must beat a plain step by `margin`: its rate is an estimate, and a plain step's is measured.
        best, source, length = self.margin / self.forward_seconds(1), NO_DRAFT, 0
        if self.cost_table is None:
            best = 0.0  # flat costs: any proposal is worth verifying
        for m in range(1, len(proposal) + 1):
            rate = self.statistics.suffix.expected_tokens(match_length, m) / self.forward_seconds(m + 1)
            if rate > best:
                best, source, length = rate, SUFFIX, m
        statistics = self.statistics
        if self.drafter_rate() > best or statistics.rounds_without_drafter + 1 >= self.probe_every:
            source, length = DRAFTER, 0
        statistics.rounds_without_drafter = 0 if source == DRAFTER else statistics.rounds_without_drafter + 1
        return source, length

    def record_drafter(self, confidences: list[float]) -> None:
        """A drafter round drafted with these conditional confidences (empty without a confidence head)."""
        if self.has_confidences:
            survival, expected = 1.0, 1.0
            for confidence in confidences:
                survival *= confidence
                expected += survival
            self._smooth(expected, len(confidences) + 1)

    def record_drafter_accepted(self, num_accepted: int, num_drafted: int) -> None:
        """Without a confidence head the drafter is priced by what its rounds actually emitted."""
        if not self.has_confidences:
            self._smooth(1.0 + num_accepted, num_drafted + 1)

    def _smooth(self, expected: float, num_tokens: int) -> None:
        """Smooth the rate of the drafter's rounds (each priced at its own size: the schedule varies it)."""
        statistics, rate = self.statistics, self.round_rate(expected, num_tokens)
        if statistics.drafter_rate is None:
            statistics.drafter_rate = rate
        else:
            statistics.drafter_rate += self.smoothing * (rate - statistics.drafter_rate)


@dataclass
class SuffixAcceptance:
    """Accepted / reached counts of proposed suffix tokens per match length, decayed so that the text being
    written now weighs most, on top of a Beta(prior) start.

    `rate(n)` is the estimated probability that a proposed token is accepted given that the tokens before it in
    the same proposal were; `expected_tokens(n, m)` the expected tokens a round verifying m proposed tokens emits
    (the target's own token included). Statistics only steer which drafts are verified, never what is emitted.
    """

    prior_accepted: float = 1.0
    prior_rejected: float = 3.0
    decay: float = 0.9
    accepted: dict[int, float] = field(default_factory=dict)
    reached: dict[int, float] = field(default_factory=dict)

    def rate(self, match_length: int) -> float:
        accepted = self.accepted.get(match_length, 0.0) + self.prior_accepted
        reached = self.reached.get(match_length, 0.0) + self.prior_accepted + self.prior_rejected
        return accepted / reached

    def expected_tokens(self, match_length: int, num_tokens: int) -> float:
        rate = self.rate(match_length)
        return 1.0 + sum(rate**j for j in range(1, num_tokens + 1))

    def record(self, match_length: int, proposed: int, accepted: int) -> None:
        """A proposal of `proposed` tokens after a match of `match_length` had its first `accepted` accepted."""
        reached = min(accepted + 1, proposed)  # the first rejected token was reached too
        self.accepted[match_length] = self.decay * self.accepted.get(match_length, 0.0) + accepted
        self.reached[match_length] = self.decay * self.reached.get(match_length, 0.0) + reached


@dataclass
class ProposalStatistics:
    """What earlier rounds taught about each proposer, kept on the drafter (`drafter.proposal_statistics`) so that
    later `generate()` calls start from it: suffix acceptance per match length, the drafter's smoothed expected
    tokens per second, and the rounds since the drafter last ran (so short generations still probe it)."""

    suffix: SuffixAcceptance = field(default_factory=SuffixAcceptance)
    drafter_rate: float | None = None
    rounds_without_drafter: int = 0
