"""The block drafter's pass at R rows: the LM head over every block slot (what drafting computed before) against the
LM head over the drafted slots only (`round.drafting.draft_block`), interleaved, per rows and drafted slots.

    python benchmarks/drafting_pass.py --rows 1,4,8,16 --slots 1,2,4,7 --context 200 --threads 1 --repeats 5 \
        --output benchmarks/drafting-pass/results.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from serving_common import command_line, environment, git_state, load_models, md_table, provenance_lines, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--slots", default="1,2,4,7")
    parser.add_argument("--context", type=int, default=200, help="context columns already in the drafter's cache")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved pairs per cell (each a median of 9 passes)")
    parser.add_argument("--output", default="benchmarks/drafting-pass/results.json")
    args = parser.parse_args()

    from hf_dspark.generation.round.drafting import draft_input_block, drafting_pass
    from hf_dspark.models.layers import DraftContextCache

    target, _, drafter = load_models(args.drafter, args.threads)
    drafter.attach_target(target, follow=True)
    config = drafter.config
    width = len(config.target_layer_ids) * target.config.get_text_config().hidden_size
    first = config.first_draft_slot

    @torch.no_grad()
    def seconds(rows: int, slots: int, whole_block: bool) -> float:
        context = DraftContextCache()
        drafter.cache_context(torch.randn(rows, args.context, width), torch.arange(args.context).expand(rows, -1),
                              context)
        block, newest = draft_input_block(torch.ones(rows, dtype=torch.long), config), torch.randn(rows, 1, width)
        times = []
        for _ in range(9):
            cache = DraftContextCache()
            cache.keys, cache.values = list(context.keys), list(context.values)
            start = time.perf_counter()
            if whole_block:
                drafter(input_ids=block, target_hidden_states=newest, cache=cache)
            else:
                out = drafter(input_ids=block, target_hidden_states=newest, cache=cache,
                              logits_mask=drafting_pass(block.device))
                drafter.compute_logits(out.last_hidden_state[:, first : first + slots].contiguous())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    cells = []
    for rows in map(int, args.rows.split(",")):
        for slots in map(int, args.slots.split(",")):
            pairs = []
            for repeat in range(args.repeats):
                order = (True, False) if repeat % 2 == 0 else (False, True)
                measured = {whole: seconds(rows, slots, whole) for whole in order}
                pairs.append((measured[True], measured[False]))
            ratios = [drafted / whole for whole, drafted in pairs]
            cells.append({"rows": rows, "slots": slots, "whole_block_ms": [1e3 * w for w, _ in pairs],
                          "drafted_only_ms": [1e3 * d for _, d in pairs], "ratios": ratios})
            print(f"R={rows:3d} slots={slots}: whole block {1e3 * statistics.median(w for w, _ in pairs):6.2f} ms, "
                  f"drafted slots {1e3 * statistics.median(d for _, d in pairs):6.2f} ms, ratio "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)

    results = {"command": command_line(), "git": git_state(), "environment": environment(args.threads),
               "drafter": args.drafter, "context": args.context, "block_size": config.block_size, "cells": cells}
    rows = [[c["rows"], c["slots"], f"{statistics.median(c['whole_block_ms']):.2f}",
             f"{statistics.median(c['drafted_only_ms']):.2f}",
             f"{statistics.median(c['ratios']):.2f}x ({min(c['ratios']):.2f}-{max(c['ratios']):.2f})"] for c in cells]
    lines = ["# The block drafter's pass: LM head over the drafted slots only", "", *provenance_lines(results), "",
             f"Drafter `{args.drafter}` (block {config.block_size}), {args.context} context columns cached, one new "
             f"context row per pass; {args.repeats} interleaved pairs per cell, each a median of 9 passes.", "",
             *md_table(["R", "drafted slots", "whole block ms", "drafted slots ms", "drafted / whole (pairs' range)"],
                       rows)]
    write_report(Path(args.output), results, lines)


if __name__ == "__main__":
    main()
