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
        cost_table: SPS(B) = 1 / `padded_round_seconds(B)`, the rounds per second with B tokens verified (the
            same price as at batch size 1), as a `VerificationCostTable` (profiled by `hf-dspark profile`, with
            `--rows` at the batch size served, or given by hand for simulation).
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
        self._cost_cache: dict[tuple, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget the confidences of earlier rounds: the next two calls fall back to the ``"current"`` rule."""
        self._history.clear()
        self._skipped = 0

    def needs_drafts(self) -> bool:
        """Whether the coming round needs drafts at all. False only in ``"two_steps_ago"`` mode when, by the
        stored confidences, the best budget's expected throughput (drafting paid) does not beat a plain step that
        skips drafting, and this is not a probing round. The answer depends on earlier rounds only, so skipping
        the drafter keeps decoding lossless: the round is a plain step. (One host read, in that mode only.)"""
        if self.mode != "two_steps_ago" or len(self._history) < 2:
            return True
        survival = self._history[0]
        rows = survival.shape[0]
        throughputs = self._throughputs(survival)[0]
        plain = rows / (self.cost_table.padded_round_seconds(rows) - self.cost_table.draft_seconds)
        if bool(throughputs.max() > plain):
            self._skipped = 0
            return True
        self._skipped += 1
        if self._skipped >= self.probe_every:
            self._skipped = 0
            return True
        return False

    def select_lengths(self, confidences: torch.Tensor, max_lengths: torch.Tensor | None = None) -> torch.LongTensor:
        """confidences (R, gamma) conditional acceptance probabilities; max_lengths (R,) drafts available ->
        lengths (R,) on the confidences' device, computed there (no host round-trip)."""
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
        return int(self._admissions(_survival(confidences, max_lengths), early_stop=False))

    def _admissions(self, survival: torch.Tensor, early_stop: bool) -> torch.LongTensor:
        """How many positions of the ranking to admit (a 0-d tensor): the count with the best E * SPS(B) (the
        first, on ties), or (early stop) the count reached before the first admission that does not raise it."""
        throughputs = self._throughputs(survival)[0]
        if early_stop:
            return (throughputs[1:] > throughputs[:-1]).long().cumprod(0).sum()
        return throughputs.argmax()

    def _throughputs(self, survival: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """E * SPS(B) after admitting the first n positions of the ranking, n = 0..R*gamma (-inf past the available
        ones), and the ranking itself (indices into the slot-major flattening of `survival`)."""
        rows, gamma = survival.shape
        order = ranking(survival)
        values = survival.t().reshape(-1)[order].double()
        expected = torch.cat([values.new_full((1,), float(rows)), rows + values.clamp_min(0).cumsum(0)])
        throughputs = expected / self._costs(rows, rows * gamma, survival.device)
        available = torch.cat([values.new_ones(1, dtype=torch.bool), values >= 0])
        return throughputs.masked_fill(~available, float("-inf")), order

    def _costs(self, rows: int, positions: int, device) -> torch.Tensor:
        """Round seconds at B = rows .. rows + positions verified tokens (one rule at every batch size: the
        table's `padded_round_seconds`, as at batch 1), cached per shape."""
        key = (rows, positions, str(device))
        if key not in self._cost_cache:
            seconds = [self.cost_table.padded_round_seconds(b) for b in range(rows, rows + positions + 1)]
            self._cost_cache[key] = torch.tensor(seconds, dtype=torch.float64, device=device)
        return self._cost_cache[key]

    @staticmethod
    def _lengths(survival: torch.Tensor, count: torch.Tensor) -> torch.LongTensor:
        """Per-row lengths of the top `count` positions of the ranking (each row gets a prefix of its slots)."""
        rows = survival.shape[0]
        order = ranking(survival)
        admitted = torch.arange(order.shape[0], device=survival.device) < count
        admitted &= survival.t().reshape(-1)[order] >= 0  # a budget K from earlier rounds may exceed what is here
        return torch.zeros(rows, dtype=torch.long, device=survival.device).scatter_add_(0, order % rows,
                                                                                      admitted.long())


def _survival(confidences: torch.Tensor, max_lengths: torch.Tensor | None) -> torch.Tensor:
    """Cumulative survivals (R, gamma), -1 where no draft is available (never admitted)."""
    gamma = confidences.shape[1]
    survival = confidences.detach().float().clamp(0, 1).cumprod(dim=1)
    if max_lengths is not None:
        slots = torch.arange(gamma, device=survival.device)
        survival = survival.masked_fill(slots[None, :] >= max_lengths.to(survival.device)[:, None], -1.0)
    return survival


def ranking(survival: torch.Tensor) -> torch.LongTensor:
    """All (row, slot) positions by survival, highest first, as indices j * R + r into the slot-major flattening
    (r = index % R). Ties go to the earlier slot, then the earlier row (a stable sort of that flattening), so
    every prefix of the ranking is a prefix of each row's slots (survival never rises along a row)."""
    return torch.sort(survival.t().reshape(-1), descending=True, stable=True).indices
