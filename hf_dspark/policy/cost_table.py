"""What a verification round costs on this hardware, profiled once and reused by the schedulers."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..models.drafting_config import MAX_TABLE_SECONDS, MIN_TABLE_SECONDS, cost_table_problem
from ..models.errors import UserInputError
from ..models.json_files import SMALL_JSON_BYTES, read_json


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
        Path(path).write_text(json.dumps(asdict(self), indent=2))

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


# How `profile_verification_costs` times (recorded in each table): tables cached by an older way are profiled again.
TIMING = "round-robin medians"


@torch.no_grad()
def profile_verification_costs(target, max_tokens: int = 8, context_length: int = 256, repeats: int = 5,
                               drafter=None, warmup: int = 2, rows: int = 1) -> VerificationCostTable:
    """Time target forwards verifying 1..max_tokens new tokens after a `context_length`-token prefix (median of
    `repeats`), and, with `drafter`, one drafting round of a DSpark/DFlash backbone or an Eagle3 step chain.

    Args:
        rows: the batch size the table is for. `seconds[n - 1]` is then a forward verifying n tokens in total
            spread over the rows, which is how the batched scheduler prices a round (B = the sum of k_r + 1): the
            verification pads every row to the longest, so n tokens over R rows run as a forward of shape
            (R, ceil(n / R)); below R tokens, n rows of one token (only n requests running). The drafter's round
            is timed over R rows too. `rows=1` times single-row forwards (batch 1).
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1 (the batch size the table is profiled for), got {rows!r}.")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}.")
    device = target.get_input_embeddings().weight.device  # where the input ids go (the first device of a device_map)
    devices = {param.device for param in target.parameters()}  # every device a forward runs on, synchronised
    vocab = target.config.get_text_config().vocab_size
    caches, prefixes = {}, {}

    def cache_for(batch: int):
        """A `context_length`-token KV cache with `batch` rows, prefilled once and cropped back after each step."""
        if batch not in caches:
            prefixes[batch] = torch.randint(0, vocab, (batch, context_length), device=device)
            out = target(input_ids=prefixes[batch], use_cache=True)
            caches[batch] = out.cache
        return caches[batch]

    def timed(fns: list) -> list[float]:
        """Median seconds of each function. The repeats go round-robin over the functions, so a burst of other
        load on the machine lands on every size alike instead of inflating the few sizes it happened to meet:
        the table's shape (how much more k tokens cost than one) is what the planner reads."""
        for fn in fns:
            for _ in range(warmup):
                fn()
        times = [[] for _ in fns]
        for _ in range(repeats):
            for fn, measured in zip(fns, times):
                _synchronize(devices)
                start = time.perf_counter()
                fn()
                _synchronize(devices)
                measured.append(time.perf_counter() - start)
        return [sorted(measured)[len(measured) // 2] for measured in times]

    def step(n: int):
        batch, width = verification_shape(n, rows)
        cache = cache_for(batch)

        def run():
            target(input_ids=torch.randint(0, vocab, (batch, width), device=device), cache=cache, use_cache=True)
            cache.crop(-width)
        return run

    runs = [step(n) for n in range(1, max_tokens + 1)]
    if drafter is not None:
        cache_for(rows)
        runs.append(_drafting_round(drafter, target, prefixes[rows]))
    measured = timed(runs)
    seconds, draft_seconds = measured[:max_tokens], (measured[max_tokens] if drafter is not None else 0.0)
    return VerificationCostTable(seconds, draft_seconds, {
        "device": str(device), "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "context_length": context_length, "threads": torch.get_num_threads(), "repeats": repeats, "rows": rows,
        "timing": TIMING})


def verification_shape(num_tokens: int, rows: int) -> tuple[int, int]:
    """(rows, tokens per row) of the forward that verifies `num_tokens` tokens in total over up to `rows` rows, each
    padded to the longest: (rows, ceil(num_tokens / rows)), or (num_tokens, 1) when fewer tokens than rows."""
    batch = min(rows, num_tokens)
    return batch, -(-num_tokens // batch)


def _synchronize(devices) -> None:
    """Wait for the queued work of every accelerator in `devices` (CUDA, XPU, MPS, ...), so the clock reads the
    work itself and not its launch. The CPU runs synchronously."""
    for device in devices:
        if device.type in ("cpu", "meta"):
            continue
        if torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == device.type:
            torch.accelerator.synchronize(device)
            continue
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


def _drafting_round(drafter, target, prefix):
    from ..models.identity import BLOCK_DRAFTER_TYPE, drafter_type
    from ..models.layers import DraftContextCache

    drafter.attach_target(target, follow=True)  # timed as generation runs it: beside the LM head, in its dtype
    width = len(drafter.config.target_layer_ids) * target.config.get_text_config().hidden_size
    dtype = next(drafter.parameters()).dtype
    prefix = prefix.to(drafter.device)
    features = torch.zeros(prefix.shape[0], 1, width, device=drafter.device, dtype=dtype)
    gamma = drafter.config.block_size

    def run():
        cache = DraftContextCache()
        if drafter_type(drafter) == BLOCK_DRAFTER_TYPE:
            block = prefix.new_full((prefix.shape[0], gamma), drafter.config.mask_token_id)
            drafter(input_ids=block, target_hidden_states=features, cache=cache)
        else:
            out = drafter(input_ids=prefix[:, :1], target_hidden_states=features, cache=cache)
            for _ in range(gamma - 1):
                out = drafter(input_ids=prefix[:, :1], hidden_states=out.hidden_states[:, -1:], cache=cache)
    return run
