"""How often proposals are accepted: one Beta posterior per proposer and slot, from decayed counts of what
verification accepted (a slot's conditional acceptance: draft j accepted when the drafts before it were). The policy
reads its mean (what a round is expected to emit) and draws from it (Thompson sampling: a proposer measured seldom is
tried in proportion to the chance that it is better than it looks), from its own random stream, which never sees a
round's drafts: whatever is verified, the verifier keeps the output the target's.
"""

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import numpy
import torch

# The first slot before anything is known: an even chance worth one observation (the drafter is tried early). Each
# later slot's prior is the slot before's posterior mean (with an even chance there, at an acceptance of 0.9, the
# seventh slot, not reached while the plan stopped at six, kept reading 0.5 and the plan never reached it).
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 1.0


@dataclass
class SlotAcceptance:
    """Decayed counts, per draft slot j, of rows that reached slot j (its drafts before it accepted) and of those
    that accepted it, aged by `decay` every round (discounted Thompson sampling: about the last fifty rounds count, so
    it follows a new workload, and a drafter priced out by a few unlucky rounds drifts back to its prior)."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    decay: float = 0.98

    @classmethod
    def empty(cls, slots: int, decay: float = 0.98) -> "SlotAcceptance":
        return cls([0.0] * slots, [0.0] * slots, decay)

    def cover(self, slots: int) -> None:
        """Count at least `slots` slots (a later loop may draft more than earlier ones did)."""
        missing = max(0, slots - len(self.reached))
        self.reached, self.accepted = self.reached + [0.0] * missing, self.accepted + [0.0] * missing

    def age(self) -> None:  # a round went by
        self.reached, self.accepted = [self.decay * c for c in self.reached], [self.decay * c for c in self.accepted]

    def record(self, verified: int, accepted: int) -> None:
        """A row verified `verified` drafts and accepted the first `accepted` of them."""
        self.cover(verified)
        for slot in range(min(accepted + 1, verified)):
            self.reached[slot] += 1.0
            self.accepted[slot] += 1.0 if slot < accepted else 0.0

    def _posterior(self, slots: int):
        """Per slot, the Beta posterior's (accepted, rejected) pseudo-counts."""
        self.cover(slots)
        prior = PRIOR_RATE
        for slot in range(slots):
            accepted = self.accepted[slot] + PRIOR_WEIGHT * prior
            yield accepted, self.reached[slot] + PRIOR_WEIGHT - accepted
            prior = accepted / (self.reached[slot] + PRIOR_WEIGHT)

    def means(self, slots: int) -> list[float]:
        return [a / (a + r) for a, r in self._posterior(slots)]

    def draws(self, slots: int, rng: random.Random) -> list[float]:
        """One Thompson draw of the first `slots` slots' rates."""
        return [rng.betavariate(max(a, 1e-6), max(r, 1e-6)) for a, r in self._posterior(slots)]


@dataclass
class SuffixAcceptance:
    """Per match length (tokens of the text matched before the proposal), a `SlotAcceptance` over the proposal's
    tokens: the first is the hard one (after one matched token accepted 20 % of the time, the next ones 55-77 % once it
    was; one pooled rate read 37 %), and with the drafter's prior and decay the expected accepted tokens of 1,461
    proposals came within 1-2 % (first token) and 4 % (seven). A habit of the workload: later calls start from it."""

    matches: dict[int, SlotAcceptance] = field(default_factory=dict)

    def rates(self, match_length: int, count: int) -> list[float]:
        """The posterior mean rates of the first `count` tokens of a proposal after a match of `match_length`."""
        return self.matches.get(match_length, SlotAcceptance()).means(count)  # a read adds no match length

    def record(self, match_length: int, proposed: int, accepted: int) -> None:
        """A proposal of `proposed` tokens after a match of `match_length` had its first `accepted` accepted."""
        self.matches.setdefault(match_length, SlotAcceptance()).record(proposed, accepted)

    def age(self) -> None:  # a round went by
        for slots in self.matches.values():
            slots.age()


# The calibration fits the last CALIBRATION_WINDOW verified drafts (about 150 rounds at one row). Where confidences
# spread little the slope's standard error is about 16 / sqrt(window): 256 left a 0.1 tilt; 1024 halves it.
CALIBRATION_WINDOW = 1024
# The prior's precision on (slope, shift) around (1, 0), the head read as it is: about four drafts' information (one
# draft's is p (1 - p) <= 1/4), so a few rounds move a head far off, and a right one stays.
CALIBRATION_PRIOR = 1.0
_EPSILON = 1e-4


@dataclass
class ConfidenceShift:
    """The drafter's confidences as this target and workload accept them (a head learns the acceptance of the data it
    was trained on): Platt scaling sigmoid(a logit(c) + d), (a, d) the posterior mode over the last
    `CALIBRATION_WINDOW` verified drafts under a Gaussian prior at (1, 0), refitted by Newton steps before the next
    read. One pair for every slot (late slots are verified only once they read high, so pairs of their own never
    learnt what early slots show: 0.73x verify-all at one row). Lossless: it depends on earlier rounds only."""

    slope: float = 1.0
    shift: float = 0.0
    confidences: deque = field(default_factory=lambda: deque(maxlen=CALIBRATION_WINDOW), repr=False)
    outcomes: deque = field(default_factory=lambda: deque(maxlen=CALIBRATION_WINDOW), repr=False)
    stale: bool = field(default=False, repr=False)

    def record(self, confidences: list[float], accepted: int) -> None:
        """A row's verified slots' confidences and how many of its drafts were accepted."""
        for slot, confidence in enumerate(confidences[: accepted + 1]):  # the slots verification reached
            self.confidences.append(confidence)
            self.outcomes.append(1.0 if slot < accepted else 0.0)
        self.stale = True

    def fit(self) -> None:
        """Newton steps from the last fit to the mode, each halved until the log-posterior climbs (it is concave, but a
        full step from a steep fit, where confidences saturate, overshoots: capped steps stalled at slope 2.1 on
        outcomes that did not depend on the confidences, and the rule then verified one slot of seven at A = 0.9)."""
        self.stale = False
        if not self.confidences:
            return
        x = numpy.fromiter(self.confidences, dtype=numpy.float64).clip(_EPSILON, 1.0 - _EPSILON)  # host values
        x = numpy.log(x / (1.0 - x))
        features, y = numpy.stack([x, numpy.ones_like(x)], 1), numpy.fromiter(self.outcomes, dtype=numpy.float64)
        theta, prior = numpy.array([self.slope, self.shift]), numpy.array([1.0, 0.0])
        value = lambda t: float(y @ (features @ t) - numpy.logaddexp(0.0, features @ t).sum()  # noqa: E731
                                - CALIBRATION_PRIOR / 2 * ((t - prior) ** 2).sum())
        now = value(theta)
        for _ in range(50):
            p = 1.0 / (1.0 + numpy.exp(-features @ theta))
            gradient = features.T @ (y - p) - CALIBRATION_PRIOR * (theta - prior)
            hessian = (features.T * (p * (1.0 - p))) @ features + CALIBRATION_PRIOR * numpy.eye(2)
            step = numpy.linalg.solve(hessian, gradient)
            while (climbed := value(theta + step)) < now and abs(step).max() > 1e-9:
                step = step / 2
            theta, now = theta + step, climbed
            if abs(step).max() < 1e-6:
                break
        self.slope, self.shift = float(theta[0]), float(theta[1])

    def apply(self, confidences: torch.Tensor) -> torch.Tensor:
        """(R, G) confidences as calibrated, on their device."""
        if self.stale:
            self.fit()
        if self.slope == 1.0 and self.shift == 0.0:
            return confidences
        logits = torch.logit(confidences.float().clamp(_EPSILON, 1.0 - _EPSILON))
        return torch.sigmoid(self.slope * logits + self.shift)


def survivals(rates: list[float]) -> list[float]:
    """S_j = c_1 * ... * c_j: the chance that the first j proposed tokens are all accepted."""
    return list(itertools.accumulate(rates, lambda survival, rate: survival * rate))
