"""A profiled table of what a verification round costs on this hardware (`hf-dspark profile`): the prices the
policy's cost model starts from, saved as JSON or inline in a drafter's `generation_config.json`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .drafting_config import MAX_TABLE_SECONDS, MIN_TABLE_SECONDS, cost_table_problem
from .errors import UserInputError
from .json_files import SMALL_JSON_BYTES, read_json, write_json


def _is_time(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


@dataclass
class VerificationCostTable:
    """Measured seconds of one target forward over n new tokens (`seconds[n - 1]`, n = 1..len), plus the drafter's
    seconds per round. On a GPU n tokens cost about as much as one; on a CPU without fast bf16 they can cost n times
    as much, which is why the draft length that maximises throughput depends on the machine.

    Args:
        seconds: forward seconds for 1, 2, ... tokens at a typical context length; in a table profiled for a batch
            (`description["rows"]` = R > 1), n tokens in total over the R rows (`profile_verification_costs`).
        draft_seconds: seconds the drafter spends per round (paid whatever the draft length).
        description: where and how it was measured (device, dtype, context length, rows).
    """

    seconds: list[float]
    draft_seconds: float = 0.0
    description: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.seconds or not all(_is_time(s) and MIN_TABLE_SECONDS <= s <= MAX_TABLE_SECONDS
                                       for s in self.seconds):
            raise ValueError(f"a cost table needs a time from {MIN_TABLE_SECONDS} to {MAX_TABLE_SECONDS} seconds for "
                             f"every token count from 1 up; got {list(self.seconds)[:8]}. Profile it again "
                             "(`hf-dspark profile`).")
        if not (_is_time(self.draft_seconds) and 0 <= self.draft_seconds <= MAX_TABLE_SECONDS):
            raise ValueError(f"draft_seconds must be a time from 0 to {MAX_TABLE_SECONDS} seconds, got "
                             f"{self.draft_seconds!r}.")

    @property
    def max_tokens(self) -> int:
        return len(self.seconds)

    def round_seconds(self, num_tokens: int) -> float:
        """Seconds of a round that verifies `num_tokens` tokens (drafts + 1); beyond the table, extrapolated.

        The extrapolation never falls: it starts from the largest measured time and grows by the table's mean
        slope per token when that slope is positive (a table that falls or is flat, as noisy GPU profiles are,
        extrapolates flat). A forward over more tokens is never assumed cheaper than any measured one."""
        if not num_tokens >= 1:
            raise ValueError(f"a verification round checks at least 1 token, got num_tokens={num_tokens!r}.")
        if num_tokens <= self.max_tokens:
            return self.seconds[num_tokens - 1] + self.draft_seconds
        slope = max((self.seconds[-1] - self.seconds[0]) / max(self.max_tokens - 1, 1), 0.0)
        return max(self.seconds) + slope * (num_tokens - self.max_tokens) + self.draft_seconds

    def padded_tokens(self, num_tokens: int) -> int:
        """The cheapest forward size m >= num_tokens in the table. On CPUs the cost is not monotone in the token
        count (matrix kernels change with the shape), and a single request can always pad its verification with
        dummy tokens after its real ones: causal attention keeps the real positions' logits unchanged."""
        if num_tokens >= self.max_tokens:
            return num_tokens
        candidates = range(num_tokens, self.max_tokens + 1)
        return min(candidates, key=lambda m: (self.seconds[m - 1], m))

    def padded_round_seconds(self, num_tokens: int) -> float:
        """Round cost when the verification may be padded to `padded_tokens(num_tokens)` (batch size 1)."""
        return self.round_seconds(self.padded_tokens(num_tokens))

    def steps_per_second(self, num_tokens: int) -> float:
        """SPS(B): verification rounds per second with B tokens in the target forward."""
        return 1.0 / self.round_seconds(num_tokens)

    @classmethod
    def from_steps_per_second(cls, steps_per_second: list[float], **kwargs) -> "VerificationCostTable":
        """A table given as SPS(1), SPS(2), ... (e.g. by hand, for simulation)."""
        return cls([1.0 / s for s in steps_per_second], **kwargs)

    def save(self, path: str | Path) -> None:
        write_json(path, asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> "VerificationCostTable":
        """The table saved at `path` (the user's own path, resolved against the working directory): a regular file
        of at most 1 MiB. A missing, unreadable or malformed file is a `CostTableError` naming it and the field."""
        fix = f"write one with `hf-dspark profile --output {path}`"
        stored = read_json(path, "cost table", fix, CostTableError, SMALL_JSON_BYTES)
        return cls.from_dict(stored, str(path), fix)

    @classmethod
    def from_dict(cls, stored, source: str, fix: str = "profile one with `hf-dspark profile --output PATH`"
                  ) -> "VerificationCostTable":
        """The table whose fields (`asdict(table)`, as saved) are `stored`, checked first: an unknown field or a
        wrong-typed or out-of-range value is a `CostTableError` naming the field and `source` (the file, or e.g.
        "generation_config.dspark_cost_table") with `fix`."""
        problem = cost_table_problem(stored)
        if problem is not None:
            raise CostTableError(f"{source} is not a cost table: {problem}; {fix}.")
        return cls([float(s) for s in stored["seconds"]], float(stored.get("draft_seconds", 0.0)),
                   dict(stored.get("description", {})))


class CostTableError(UserInputError):
    """A cost table file that is missing, unreadable or not a cost table (the message names it and the fix)."""
