"""The DSpark scheduler: how many draft tokens each of R concurrent requests gets verified this round.

Every request always verifies its anchor slot (B starts at R, with R expected tokens). Draft positions (r, j) are
ranked by cumulative survival a[r, j] = c[r, 1] * ... * c[r, j] and admitted in that order, each adding one token
to the verification batch B and a[r, j] expected tokens, while the expected throughput E * SPS(B) keeps rising.
The **early stop** (stop at the first admission that does not raise it) is what keeps the rule lossless: whether
(r, j) is verified then depends only on positions ranked above it, never on x[r, j] through later confidences.
Without it, the global best can include (r, j) *because* c[r, j+1], which depends on x[r, j], is high, and the
output is biased (the paper's Appendix A; see tests).

The paper's production variant (``mode="two_steps_ago"``) splits the decision in two. The batch budget K, the
number of draft positions to verify, is the *global* best of the search above, run on the confidences the drafter
produced two rounds earlier (so a serving system can compute it while the current round is still drafting). The
current round then verifies its K highest-ranked positions. That is lossless too: K is fixed before any of this
round's drafts exist, and whether (r, j) is among the top K depends only on the positions ranked above it, exactly
as with the early stop.
"""

from __future__ import annotations

from collections import deque

import torch

from .cost_table import VerificationCostTable

MODES = ("current", "two_steps_ago")


class DSparkScheduler:
    """`select_lengths(confidences, max_lengths)` -> per-request draft lengths to verify this round.

    Args:
        cost_table: SPS(B), the verification steps per second at B tokens in the batch, as a
            `VerificationCostTable` (profiled by `hf-dspark profile`, or given by hand for simulation).
        early_stop: stop at the first admission that does not raise throughput (lossless). `False` takes the
            global best over all prefixes of the ranking (biased; kept for comparison only). In
            ``"two_steps_ago"`` mode it only governs the fallback of the first two rounds.
        mode: ``"current"`` decides from this round's confidences alone (stateless). ``"two_steps_ago"`` takes
            the budget K from the confidences passed two calls earlier (global best, no early stop) and verifies
            the top K positions of this round; the first two calls of a generation, which have no such history,
            fall back to the ``"current"`` rule. Call `reset()` when a new generation starts (the batched engine
            does); the scheduler then remembers the confidences of each call.
        probe_every: ``"two_steps_ago"`` only. When the stored confidences say that no budget beats a plain
            step without any drafting (the table's `draft_seconds` saved), the engine skips drafting for that round
            (`needs_drafts()`), which is where the mode pays off when drafts do not (heavy load, slow
            verification). Every `probe_every`-th such round drafts anyway, so that the stored confidences stay
            current.
    """

    def __init__(self, cost_table: VerificationCostTable, early_stop: bool = True, mode: str = "current",
                 probe_every: int = 8):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        if probe_every < 1:
            raise ValueError(f"probe_every must be at least 1, got {probe_every}.")
        self.cost_table = cost_table
        self.early_stop = early_stop
        self.mode = mode
        self.probe_every = probe_every
        self._history: deque[torch.Tensor] = deque(maxlen=2)  # survivals of the last two calls, oldest first
        self._skipped = 0

    def reset(self) -> None:
        """Forget the confidences of earlier rounds: the next two calls fall back to the ``"current"`` rule."""
        self._history.clear()
        self._skipped = 0

    def needs_drafts(self) -> bool:
        """Whether the coming round needs drafts at all. False only in ``"two_steps_ago"`` mode when, by the
        stored confidences, the best budget's expected throughput (drafting paid) does not beat a plain step that
        skips drafting, and this is not a probing round. The answer depends on earlier rounds only, so skipping
        the drafter keeps decoding lossless: the round is a plain step."""
        if self.mode != "two_steps_ago" or len(self._history) < 2:
            return True
        rows = self._history[0].shape[0]
        _, with_drafts = self._search(self._history[0], early_stop=False)
        plain = rows / (self.cost_table.round_seconds(rows) - self.cost_table.draft_seconds)
        if with_drafts > plain:
            self._skipped = 0
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False

    def select_lengths(self, confidences: torch.Tensor, max_lengths: torch.Tensor | None = None) -> torch.LongTensor:
        """confidences (R, gamma) conditional acceptance probabilities; max_lengths (R,) drafts available."""
        survival = _survival(confidences, max_lengths)
        if self.mode == "current":
            return self._lengths(survival, self._admissions(survival, self.early_stop))
        if len(self._history) < 2:
            budget = self._admissions(survival, self.early_stop)
        else:
            budget = self._admissions(self._history[0], early_stop=False)
        self._history.append(survival)
        return self._lengths(survival, budget)

    def batch_budget(self, confidences: torch.Tensor, max_lengths: torch.Tensor | None = None) -> int:
        """K: how many draft positions of the ranking the throughput search admits (global best, no early
        stop). In ``"two_steps_ago"`` mode this is computed on a round's confidences and used two rounds later."""
        return self._admissions(_survival(confidences, max_lengths), early_stop=False)

    def _admissions(self, survival: torch.Tensor, early_stop: bool) -> int:
        """How many positions of the ranking to admit: the count with the best E * SPS(B), or (early stop) the
        count reached before the first admission that does not raise it."""
        return self._search(survival, early_stop)[0]

    def _search(self, survival: torch.Tensor, early_stop: bool) -> tuple[int, float]:
        """`_admissions` and the expected throughput E * SPS(B) of admitting that many (drafting paid)."""
        rows = survival.shape[0]
        expected, batch = float(rows), rows
        best_throughput = expected * self.cost_table.steps_per_second(batch)
        admitted = best_count = 0
        values = survival.tolist()
        for row, slot in ranking(survival):
            value = values[row][slot]
            if value < 0:
                break
            expected, batch = expected + value, batch + 1
            throughput = expected * self.cost_table.steps_per_second(batch)
            admitted += 1
            if throughput > best_throughput:
                best_throughput, best_count = throughput, admitted
            elif early_stop:
                break
        return best_count, best_throughput

    @staticmethod
    def _lengths(survival: torch.Tensor, count: int) -> torch.LongTensor:
        """Per-row lengths of the top `count` available positions of the ranking (each row gets a prefix)."""
        lengths = torch.zeros(survival.shape[0], dtype=torch.long)
        values = survival.tolist()
        for row, slot in ranking(survival)[:count]:
            if values[row][slot] < 0:
                break
            lengths[row] += 1
        return lengths


def _survival(confidences: torch.Tensor, max_lengths: torch.Tensor | None) -> torch.Tensor:
    """Cumulative survivals (R, gamma) on the CPU, -1 where no draft is available (never admitted)."""
    gamma = confidences.shape[1]
    survival = confidences.detach().float().cpu().clamp(0, 1).cumprod(dim=1)
    if max_lengths is not None:
        survival = survival.masked_fill(torch.arange(gamma)[None, :] >= max_lengths[:, None].cpu(), -1.0)
    return survival


def ranking(survival: torch.Tensor) -> list[tuple[int, int]]:
    """All (row, slot) pairs by survival, highest first; ties go to the earlier slot, then the earlier row, so every
    prefix of the ranking is a prefix of each row's slots (survival never rises along a row)."""
    values = survival.tolist()
    pairs = [(r, j) for r, row in enumerate(values) for j in range(len(row))]
    return sorted(pairs, key=lambda rj: (-values[rj[0]][rj[1]], rj[1], rj[0]))
