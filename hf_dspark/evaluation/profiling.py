"""`hf-dspark profile`: time target forwards over 1..N new tokens and the drafter's pass into a
`VerificationCostTable`, the prices the verification policy's cost model starts from."""

from __future__ import annotations

import time

import torch

from ..generation.round.drafting import draft_input_block, drafted_slots, drafting_pass
from ..models.cost_table import VerificationCostTable

# How `profile_verification_costs` times (recorded in each table): tables cached by an older way are profiled again.
TIMING = "round-robin medians, drafted slots' logits"


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
    from ..models.identity import BLOCK_DRAFTER_TYPE, drafting_core
    from ..models.layers import DraftContextCache

    drafter.attach_target(target, follow=True)  # timed as generation runs it: beside the LM head, in its dtype
    width = len(drafter.config.target_layer_ids) * target.config.get_text_config().hidden_size
    dtype = next(drafter.parameters()).dtype
    prefix = prefix.to(drafter.device)
    features = torch.zeros(prefix.shape[0], 1, width, device=drafter.device, dtype=dtype)
    block_size = drafter.config.block_size

    def run():
        cache = DraftContextCache()
        if drafting_core(drafter) == BLOCK_DRAFTER_TYPE:  # the block generation drafts from: anchor, then masks
            block = draft_input_block(prefix[:, -1], drafter.config)
            out = drafter(input_ids=block, target_hidden_states=features, cache=cache,
                          logits_mask=drafting_pass(block.device))
            drafted_slots(drafter, out, drafter.config.num_draft_slots)  # a whole round's slots, as `draft_block`
        else:
            out = drafter(input_ids=prefix[:, :1], target_hidden_states=features, cache=cache)
            for _ in range(block_size - 1):
                out = drafter(input_ids=prefix[:, :1], hidden_states=out.hidden_states[:, -1:], cache=cache)
    return run
