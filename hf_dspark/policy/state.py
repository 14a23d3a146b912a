"""What rounds learn and later calls start from (`DraftingState`), and its checked JSON form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..models.json_files import FieldCheck, checked_fields, read_json, write_json
from .acceptance import ConfidenceShift, SlotAcceptance, SuffixAcceptance

# Decayed counts never exceed 1 / (1 - decay); a saved count beyond this is not one this code wrote.
_MAX_COUNT = 1e6

@dataclass
class ProposalStatistics:
    """What later calls and processes start from: suffix proposals' acceptance per match length, the drafter's slots'
    when verified (the rule after drafting looks ahead with it) and as delivered of what the plan allowed."""

    suffix: SuffixAcceptance = field(default_factory=SuffixAcceptance)
    drafter: SlotAcceptance = field(default_factory=SlotAcceptance)
    delivered: SlotAcceptance = field(default_factory=SlotAcceptance)


@dataclass
class DraftingState:
    """What rounds learn and later calls start from: `statistics`, and, in memory only, this machine's round costs
    (`round_costs`: a `CostModel` per cost-table setting) and how the confidences read here (`confidence_shift`).
    Calls and engines without one learn into their drafter's own (`policy.remembered`). `reset()` forgets all;
    `save(path)` / `DraftingState.load(path)` keep `statistics` across processes (JSON)."""

    statistics: ProposalStatistics = field(default_factory=ProposalStatistics)
    round_costs: dict = field(default_factory=dict, compare=False, repr=False)
    confidence_shift: ConfidenceShift = field(default_factory=ConfidenceShift, compare=False, repr=False)

    def reset(self) -> None:
        self.statistics = ProposalStatistics()
        self.round_costs = {}
        self.confidence_shift = ConfidenceShift()

    def to_dict(self) -> dict:
        return asdict(self.statistics)

    @classmethod
    def from_dict(cls, saved: dict, source: str = "a saved DraftingState") -> "DraftingState":
        """The inverse of `to_dict`, every field checked: a `UserInputError` naming the field, the value and `source`
        otherwise, rather than a failure rounds later inside the policy."""
        return cls(_checked_statistics(saved, source))

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "DraftingState":
        saved = read_json(path, "drafting state", _STATE_FIX)
        return cls.from_dict(saved, str(path))


_STATE_FIX = "save one with DraftingState.save(path)"
# Fields of states saved by earlier planners (smoothed estimates, probe pacing, timings): loaded without them.
_RETIRED_FIELDS = ("drafter_expected", "drafter_tokens", "rounds_without_drafter", "probe_interval",
                   "forward_seconds", "draft_seconds")
_RETIRED_SUFFIX_FIELDS = ("prior_accepted", "prior_rejected", "decay", "accepted", "reached")


def _checked_statistics(saved, source: str) -> ProposalStatistics:
    """`ProposalStatistics` from their saved fields, each checked (see `DraftingState.from_dict`); a field left out
    keeps its default."""
    if isinstance(saved, dict):
        saved = {key: value for key, value in saved.items() if key not in _RETIRED_FIELDS}
    saved = checked_fields(saved, ProposalStatistics, "", source, _STATE_FIX, "a DraftingState")
    suffix = saved.pop("suffix", {})
    if isinstance(suffix, dict):  # one rate per match length, pooled over tokens (saved before per-token rates)
        suffix = {key: value for key, value in suffix.items() if key not in _RETIRED_SUFFIX_FIELDS}
    suffix = checked_fields(suffix, SuffixAcceptance, "suffix.", source, _STATE_FIX)
    check = FieldCheck(source, _STATE_FIX)
    matches = check.counts(suffix, "suffix.matches", 0, lambda value, name: _checked_slots(value, name, check, source))
    return ProposalStatistics(SuffixAcceptance(matches), *(_checked_slots(saved.pop(key, {}), key, check, source)
                                                           for key in ("drafter", "delivered")))


def _checked_slots(saved, key: str, check: FieldCheck, source: str) -> SlotAcceptance:
    """A drafter's slot acceptance (`key`): a decay in [0, 1] and two lists of as many counts, none accepted more
    often than reached."""
    slots = checked_fields(saved, SlotAcceptance, f"{key}.", source, _STATE_FIX)
    decay = check.number(slots, f"{key}.decay", 0.0, high=1.0, default=SlotAcceptance().decay)
    counts = {}
    for name in ("reached", "accepted"):
        values = slots.get(name, [])
        check.require(isinstance(values, list) and len(values) <= 4096, f"{key}.{name}", values,
                      "a list of at most 4096 counts")
        counts[name] = [check.value(v, f"{key}.{name}[{i}]", 0.0, _MAX_COUNT) for i, v in enumerate(values)]
    check.require(len(counts["accepted"]) == len(counts["reached"]), f"{key}.accepted", slots.get("accepted"),
                  f"a list as long as {key}.reached")
    for slot, (accepted, reached) in enumerate(zip(counts["accepted"], counts["reached"])):
        check.require(accepted <= reached, f"{key}.accepted[{slot}]", accepted, f"<= {key}.reached[{slot}]")
    return SlotAcceptance(counts["reached"], counts["accepted"], decay)
