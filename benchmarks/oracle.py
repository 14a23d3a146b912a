"""An acceptance oracle on a real target: where drafting pays, without a drafter that is good.

A forward hook on the causal LM sees each forward's `input_ids` t_0..t_k (a verification: the anchor and the
proposed tokens) and its logits. Position i < k is *forced* with probability p[i]: the logit of t_{i+1} is raised just
above the row's maximum, so greedy verification accepts it; otherwise the logits are left as they are, unless the
target already agrees with the proposal there, in which case that logit is lowered below the row's minimum (so a
position that is not forced is rejected). Greedy verification then accepts each proposed token with conditional
probability exactly p[i], and the decoding loop around it runs its real code.

p is `acceptance` for every position (the *independent* form), or, when the drafter's confidences of the round were
handed over (`stash`, which the benchmark wires to the drafting pass), `confidence_map(c)` of each slot's confidence
(the *confidence-informed* form: the head's ranking then says which drafts survive, and the schedule has something
to find). A plain step (one token) has no position to force, so plain decoding is the target's own.

Common random numbers: whether the proposal for a position is forced is a fixed function of the oracle's seed and that
position in the text (a table of coins drawn once per seed, not a stream), whatever is proposed there and in which
round. Every method run with one seed then meets the same coin at every position: a method that verifies k drafts from
an anchor accepts the run of forced positions after it, up to k, so methods differ by what they verify and what it
costs, not by their luck (with one stream a forcing method's rate swung by half between repeats at R = 4). Rows whose
prompts have equal lengths share their coins; that correlates them, and changes no row's acceptance probabilities.

`never_end`: the end-of-sequence tokens' logits are lowered below every row's minimum at every position, and a
proposed end token is never forced, so every method emits exactly `max_new_tokens` per row. The target is then
"the target that never ends", the same for plain decoding and every policy; without it, where a forced draft ends
a row early decides a run's tokens per second as much as the policy does (a row of four ended at 9 tokens leaves
its batch three rows wide).
"""

from __future__ import annotations

import time

import torch

POSITIONS = 1 << 16  # coins drawn per seed; a longer text reuses them from the start


class AcceptanceOracle:
    def __init__(self, target, acceptance: float, seed: int = 0, confidence_map=None, never_end: bool = False):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be a probability in [0, 1], got {acceptance}")
        self.target, self.acceptance, self.confidence_map = target, acceptance, confidence_map
        # One coin per position of a text (common random numbers, above), drawn once for this seed.
        generator = torch.Generator(device=target.device).manual_seed(seed)
        self.coins = torch.rand(POSITIONS, generator=generator, device=target.device)
        self.clock = None  # when set (benchmarks/gpu/check.py), the rewrite's seconds go to its "oracle" phase
        self._handle = None
        ends = target.generation_config.eos_token_id if never_end else None
        ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
        self._ends = torch.tensor(ends, dtype=torch.long, device=target.device) if ends else None
        self._stashed: torch.Tensor | None = None
        self._positions, self._forced, self._undone = [], [], []  # device tensors, read once at the end

    def stash(self, confidences: torch.Tensor | None) -> None:
        """The confidences (R, G) of the round about to be verified (None: the independent form this round)."""
        self._stashed = None if confidences is None or self.confidence_map is None else confidences.detach()

    def counts(self) -> dict[str, int]:
        total = lambda values: int(sum(v.sum() for v in values)) if values else 0  # noqa: E731
        return {"positions": sum(self._positions), "forced": total(self._forced),
                "natural_agreements_undone": total(self._undone)}

    def __enter__(self) -> "AcceptanceOracle":
        self._handle = self.target.register_forward_hook(self._rewrite, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _probabilities(self, shape) -> torch.Tensor:
        rows, forceable = shape
        stashed, self._stashed = self._stashed, None
        probabilities = torch.full(shape, self.acceptance, device=self.target.device)
        if stashed is not None and stashed.shape[0] == rows:
            slots = min(forceable, stashed.shape[1])
            probabilities[:, :slots] = self.confidence_map(stashed[:, :slots].float().to(probabilities.device))
        return probabilities

    @torch.no_grad()
    def _rewrite(self, module, args, kwargs, output):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if input_ids is None or logits is None:
            return None
        started = time.perf_counter()
        if self._ends is not None:
            logits[..., self._ends] = logits.amin(dim=-1, keepdim=True) - 1.0
        length, kept = input_ids.shape[1], logits.shape[1]
        first = length - kept  # input position of the first kept logit
        forceable = length - 1 - first  # kept positions that have a next input token
        if forceable > 0:
            rows = logits[:, :forceable]
            following = input_ids[:, first + 1 :][..., None]
            chance = self._probabilities(following.shape[:2])
            positions = _positions(kwargs, input_ids)[:, first + 1 :]
            hit = self.coins[positions % POSITIONS] < chance
            if self._ends is not None:
                hit &= ~torch.isin(following[..., 0], self._ends)
            top = rows.amax(dim=-1)
            current = rows.gather(-1, following).squeeze(-1)
            agrees = current >= top  # the target's own argmax is already the draft (ties included)
            value = torch.where(hit, top + 1.0, torch.where(agrees, rows.amin(dim=-1) - 1.0, current))
            rows.scatter_(-1, following, value[..., None])
            self._positions.append(hit.numel())
            self._forced.append(hit.sum())
            self._undone.append((agrees & ~hit).sum())
        if self.clock is not None:
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            self.clock.add("oracle", time.perf_counter() - started)
        return None


def _positions(kwargs, input_ids) -> torch.Tensor:
    """Each input token's position in its text: the forward's `position_ids` (the batched engine passes them), else
    (one prompt on a cropped cache) counted from the cache's length, which already holds this forward's tokens."""
    given = kwargs.get("position_ids")
    if given is not None:
        return given.expand_as(input_ids)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    length = input_ids.shape[1]
    start = cache.get_seq_length() - length if cache is not None else 0
    return (start + torch.arange(length, device=input_ids.device)).expand_as(input_ids)
