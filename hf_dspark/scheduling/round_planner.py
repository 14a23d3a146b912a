"""Which proposer a batch-1 round uses, and what rounds learn across calls.

`RoundPlanner` decides, before drafting and from earlier rounds only, whether a round verifies the drafter's block,
a suffix proposal or nothing (a plain step). What it learns (`ProposalStatistics`: suffix acceptance, the drafter's
expected tokens, round costs measured in this loop) lives in a `DraftingState`: the one a `generate()` call is given
(`dspark_state=`), else its drafter's own for that target (`generation.call.remembered_state`), so later calls start
from what earlier ones measured.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..models.config_checks import is_finite_number
from ..models.errors import UserInputError
from ..models.json_files import read_json
from .batch_planner import interpolated
from .cost_table import VerificationCostTable

DRAFTER, SUFFIX, NO_DRAFT = "drafter", "suffix", "none"


class RoundPlanner:
    """Which proposal a batch-1 round verifies, decided before drafting from earlier rounds only.

    Candidates, each priced as expected tokens per second of its round:

    * no draft (a plain decoding step): 1 token for a one-token forward;
    * a suffix proposal of m tokens (`SuffixIndex`): `SuffixAcceptance.expected_tokens(n, m)` for a forward over
      m + 1 tokens, with the best m up to the proposal's length;
    * the drafter's block: the smoothed expected tokens of its recent rounds (from its confidences,
      1 + c_1 + c_1 c_2 + ... over the slots it verified, or its accepted count without a confidence head) over
      the drafting cost plus a forward over their smoothed size (slots + 1).

    Costs come from the `VerificationCostTable`, corrected by what this loop measured (`record_forward`,
    `record_draft`): a profile taken once under other load, context length or sampling settings can misprice a round
    (in bfloat16 on a CPU the drafter's pass costs about twice what the table says), and a round that looks cheap
    but is not makes the main job slower than plain decoding. Without a table the loop prices rounds from what it
    measured alone: the first rounds are plain steps (the price every proposal must beat; a size's first run is not
    counted), forward sizes not timed yet are interpolated between those that were (flat beyond them), the drafter
    costs what its pass took. Where nothing can be timed (`timed` False: an accelerator without
    `dspark_time_phases`) or `learn_costs` is False, every forward costs the same and drafting nothing (a GPU-like
    machine), so the drafter or a suffix proposal always beats a plain step.

    A drafter that has not run for `probe_every` rounds runs once to refresh its estimate; each probe that does not
    win doubles the wait, up to `max_probe_every`, and a drafter chosen on its merits resets it. Whatever is chosen,
    the verifier's rule keeps the output exactly the target's: the choice depends on earlier rounds, never on this
    round's drafts. A proposal is preferred to a plain step only when it promises `margin` times its rate
    (estimates err; the plain step's cost is measured).
    """

    def __init__(self, cost_table: VerificationCostTable | None, has_confidences: bool, statistics: "ProposalStatistics",
                 probe_every: int = 16, max_probe_every: int = 64, smoothing: float = 0.5, margin: float = 1.05,
                 cost_smoothing: float = 0.3, learn_costs: bool = True, timed: bool = True):
        self.cost_table, self.has_confidences, self.statistics = cost_table, has_confidences, statistics
        self.learn_costs = learn_costs and timed
        # Without a table: priced by what is timed alone, or flat (drafting free) where nothing is.
        self.flat = cost_table is None and not self.learn_costs
        self._seen: set = set()  # forward sizes (and "draft") timed once in this call
        self.probe_every, self.max_probe_every = probe_every, max(max_probe_every, probe_every)
        self.smoothing, self.margin = smoothing, margin
        self.cost_smoothing = cost_smoothing

    def _tabled_forward_seconds(self, size: int) -> float:
        return self.cost_table.round_seconds(size) - self.cost_table.draft_seconds

    def forward_seconds(self, num_tokens: int) -> float:
        """Seconds of the target forward verifying `num_tokens` tokens (padded to the table's cheapest size): as
        measured in this loop where that size ran, else the table's figure scaled by how the measured sizes
        compare with theirs (the level moves with load and context length; the table keeps the shape)."""
        measured = self.statistics.forward_seconds
        if self.cost_table is None:
            if self.flat or not measured:
                return 1.0
            return measured.get(num_tokens) or interpolated(measured, num_tokens)
        size = self.cost_table.padded_tokens(num_tokens)
        if size in measured:
            return measured[size]
        tabled = self._tabled_forward_seconds(size)
        if not measured:
            return tabled
        ratios = [seconds / self._tabled_forward_seconds(m) for m, seconds in measured.items()]
        return tabled * sum(ratios) / len(ratios)

    def draft_seconds(self) -> float:
        """Seconds the drafter spends per round: measured when it has run, else the table's."""
        measured = self.statistics.draft_seconds
        if measured is not None and not self.flat:
            return measured
        return self.cost_table.draft_seconds if self.cost_table is not None else 0.0

    def round_rate(self, expected: float, num_tokens: int) -> float:
        """Expected tokens per second of a drafter round verifying `num_tokens` tokens."""
        return expected / (self.draft_seconds() + self.forward_seconds(num_tokens))

    def record_forward(self, num_tokens: int, seconds: float) -> None:
        """A verification forward over `num_tokens` tokens (padding included) took `seconds` of wall time."""
        if not self.learn_costs or (self.cost_table is not None and num_tokens > self.cost_table.max_tokens):
            return  # flat costs are not priced; a prefill is not a round
        if self._warmed_up(num_tokens):
            measured = self.statistics.forward_seconds
            measured[num_tokens] = self._smoothed(measured.get(num_tokens), seconds)

    def record_draft(self, seconds: float) -> None:
        """A drafter round's own pass (backbone, sequential head, sampling; Eagle3's steps) took `seconds`."""
        if not self.learn_costs:
            return
        if self._warmed_up("draft"):
            statistics = self.statistics
            statistics.draft_seconds = self._smoothed(statistics.draft_seconds, seconds)

    def _warmed_up(self, kind) -> bool:
        """False the first time a forward size (or the drafter) runs in this call: that run may compile a graph
        or fill cold caches, seconds that later rounds do not pay."""
        if kind in self._seen:
            return True
        self._seen.add(kind)
        return False

    def _smoothed(self, previous: float | None, seconds: float) -> float:
        """Smooth a timing in, clipped to twice the estimate so far: a burst of other load or a collector pause
        would otherwise price a size out, and a size that is never chosen is never timed again."""
        if previous is None:
            return seconds
        return previous + self.cost_smoothing * (min(seconds, 2.0 * previous) - previous)

    def drafter_rate(self) -> float:
        """Expected tokens per second of the drafter's next round: its recent rounds' smoothed expected tokens and
        size, priced at today's costs (measured ones included, so costs learnt since it last ran count too)."""
        statistics = self.statistics
        if statistics.drafter_expected is None:
            return float("inf")  # never measured: run it
        return self.round_rate(statistics.drafter_expected, round(statistics.drafter_tokens))  # each round >= 1

    def choose(self, proposal: list[int], match_length: int) -> tuple[str, int]:
        """(DRAFTER | SUFFIX | NO_DRAFT, suffix tokens to verify)."""
        statistics = self.statistics
        if self.cost_table is None and not self.flat and 1 not in statistics.forward_seconds:
            statistics.rounds_without_drafter += 1
            return NO_DRAFT, 0  # priced by measures alone: time a plain step first, the price proposals must beat
        # A proposal must beat a plain step by `margin`: its rate is an estimate, and a plain step's is measured.
        best, source, length = self.margin / self.forward_seconds(1), NO_DRAFT, 0
        if self.flat:
            best = 0.0  # flat costs: any proposal is worth verifying
        for m in range(1, len(proposal) + 1):
            rate = self.statistics.suffix.expected_tokens(match_length, m) / self.forward_seconds(m + 1)
            if rate > best:
                best, source, length = rate, SUFFIX, m
        interval = statistics.probe_interval or self.probe_every
        if self.drafter_rate() > best:
            source, length, statistics.probe_interval = DRAFTER, 0, self.probe_every
        elif statistics.rounds_without_drafter + 1 >= interval:
            # A probe costs a round that does not pay; while probes keep finding that, probe half as often.
            source, length = DRAFTER, 0
            statistics.probe_interval = min(2 * interval, self.max_probe_every)
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
        """Smooth the expected tokens and the verified size of the drafter's rounds (the schedule varies it)."""
        statistics = self.statistics
        if statistics.drafter_expected is None:
            statistics.drafter_expected, statistics.drafter_tokens = expected, float(num_tokens)
        else:
            statistics.drafter_expected += self.smoothing * (expected - statistics.drafter_expected)
            statistics.drafter_tokens += self.smoothing * (num_tokens - statistics.drafter_tokens)


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
    """What earlier rounds taught about each proposer (held by a `DraftingState`, which later `generate()` calls
    given the same state start from): suffix acceptance per match length, the drafter's smoothed expected
    tokens and verified tokens per round, the rounds since the drafter last ran and the wait before its next probe
    (so short generations still probe it), and the round costs measured so far (seconds per verification forward
    size and of the drafter's pass, smoothed)."""

    suffix: SuffixAcceptance = field(default_factory=SuffixAcceptance)
    drafter_expected: float | None = None
    drafter_tokens: float | None = None
    rounds_without_drafter: int = 0
    probe_interval: int | None = None
    forward_seconds: dict[int, float] = field(default_factory=dict)
    draft_seconds: float | None = None


@dataclass
class DraftingState:
    """What rounds learn and later calls start from: the batch-1 loop's `statistics`, and the batched engine's
    measured round costs (`engine`, per cost-table setting; in memory only). A `generate()` call without
    `dspark_state=` learns into its drafter's own state for that target, device, dtype and thread count
    (`call.remembered_state`); pass one to choose what calls share.
    `reset()` forgets everything, `save(path)` / `DraftingState.load(path)` keep `statistics` across processes
    (JSON)."""

    statistics: ProposalStatistics = field(default_factory=ProposalStatistics)
    engine: dict = field(default_factory=dict, compare=False, repr=False)

    def reset(self) -> None:
        self.statistics = ProposalStatistics()
        self.engine = {}

    def to_dict(self) -> dict:
        return asdict(self.statistics)

    @classmethod
    def from_dict(cls, saved: dict, source: str = "a saved DraftingState") -> "DraftingState":
        """The inverse of `to_dict` (JSON keeps dict keys as strings: forward sizes and match lengths are ints), every
        field checked for its type and range: a `UserInputError` (a ValueError) naming the field, the value and
        `source` (the file) otherwise, rather than a failure rounds later inside the planner."""
        return cls(_checked_statistics(saved, source))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "DraftingState":
        saved = read_json(path, "drafting state", _STATE_FIX)
        return cls.from_dict(saved, str(path))


_STATE_FIX = "save one with DraftingState.save(path)"


def _checked_statistics(saved, source: str) -> ProposalStatistics:
    """`ProposalStatistics` from their saved fields, each checked (see `DraftingState.from_dict`); a field left out
    keeps its default."""
    saved = _checked_fields(saved, ProposalStatistics, "", source)
    suffix = _checked_fields(saved.pop("suffix", {}), SuffixAcceptance, "suffix.", source)
    check, defaults = _StateCheck(source), SuffixAcceptance()
    for name in ("prior_accepted", "prior_rejected"):
        suffix[name] = check.number(suffix, f"suffix.{name}", 0.0, default=getattr(defaults, name))
    prior = suffix["prior_accepted"] + suffix["prior_rejected"]
    check.require(prior > 0, "suffix.prior_accepted + suffix.prior_rejected", prior, "> 0")
    suffix["decay"] = check.number(suffix, "suffix.decay", 0.0, high=1.0, default=defaults.decay)
    for name in ("accepted", "reached"):
        suffix[name] = check.counts(suffix, f"suffix.{name}", 0, lambda v, n: check.value(v, n, 0.0))
    statistics = {
        "drafter_expected": check.number(saved, "drafter_expected", 1.0, optional=True),
        "drafter_tokens": check.number(saved, "drafter_tokens", 1.0, optional=True),
        "rounds_without_drafter": check.integer(saved, "rounds_without_drafter", 0, default=0),
        "probe_interval": check.integer(saved, "probe_interval", 1, optional=True),
        "forward_seconds": check.counts(saved, "forward_seconds", 1, lambda v, n: check.value(v, n, 0.0, above=True)),
        "draft_seconds": check.number(saved, "draft_seconds", 0.0, optional=True),
    }
    check.require((statistics["drafter_expected"] is None) == (statistics["drafter_tokens"] is None),
                  "drafter_tokens", statistics["drafter_tokens"],
                  "a number when drafter_expected is one and null when it is null")
    return ProposalStatistics(suffix=SuffixAcceptance(**suffix), **statistics)


def _checked_fields(saved, kind, prefix: str, source: str) -> dict:
    """A copy of `saved`, refused unless it is a dict whose keys are fields of the dataclass `kind`."""
    names = [f.name for f in fields(kind)]
    what = prefix.rstrip(".") or "a DraftingState"
    if not isinstance(saved, dict):
        raise UserInputError(f"{source}: {what} is a {type(saved).__name__}, not an object of {', '.join(names)}; "
                             f"{_STATE_FIX}.")
    unknown = sorted(repr(prefix + str(key))[:60] for key in set(saved) - set(names))
    if unknown:
        raise UserInputError(f"{source}: unknown field(s) {', '.join(unknown[:8])} (the "
                             f"fields of {what} are {', '.join(names)}); {_STATE_FIX}.")
    return dict(saved)


class _StateCheck:
    """Checks of saved DraftingState fields; each failure is one `UserInputError` naming field, value and source."""

    def __init__(self, source: str):
        self.source = source

    def require(self, ok: bool, name: str, value, expected: str) -> None:
        if not ok:
            raise UserInputError(f"{self.source}: field {name} is {repr(value)[:80]}, not {expected}; {_STATE_FIX}.")

    def value(self, value, name: str, low: float, above: bool = False, high: float | None = None) -> float:
        """`value` as a float: a finite number >= low (> low when `above`), <= high when given."""
        ok = is_finite_number(value) and (value > low if above else value >= low) and (high is None or value <= high)
        self.require(ok, name, value, f"a finite number {'>' if above else '>='} {low}"
                     + (f" and <= {high}" if high is not None else ""))
        return float(value)

    def number(self, saved: dict, name: str, low: float, high: float | None = None, optional: bool = False,
               default: float | None = None):
        """The float at `saved[name]` (the last part of a dotted name): `default` when left out, None when None
        and `optional`."""
        value = saved.get(name.rsplit(".", 1)[-1], default)
        if value is None and optional:
            return None
        return self.value(value, name, low, high=high)

    def integer(self, saved: dict, name: str, low: int, optional: bool = False, default: int | None = None):
        value = saved.get(name, default)
        if value is None and optional:
            return None
        self.require(isinstance(value, int) and not isinstance(value, bool) and value >= low, name, value,
                     f"an int >= {low}" + (" or null" if optional else ""))
        return value

    def counts(self, saved: dict, name: str, low: int, check) -> dict:
        """`saved[name]` as {int >= low: check(value)}; JSON keeps the int keys as strings of digits."""
        table = saved.get(name.rsplit(".", 1)[-1], {})
        self.require(isinstance(table, dict), name, table, f"an object of int keys >= {low}")
        checked = {}
        for key, value in table.items():
            digits = isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,12}", key)
            number = int(key) if digits else key
            self.require(isinstance(number, int) and not isinstance(number, bool) and number >= low,
                         f"{name} key", key, f"an int >= {low}")
            checked[number] = check(value, f"{name}[{key!r}]")
        return checked
