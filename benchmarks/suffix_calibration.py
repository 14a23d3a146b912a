"""How well the suffix acceptance estimate predicts what suffix proposals deliver: the target's own greedy answers to
the serving mix, replayed R at a time, every proposal priced before its outcome is known (the expected accepted
tokens among its first k) and then scored. Two estimates over the same proposals: the policy's
(`policy.acceptance.SuffixAcceptance`: per match length and token, the drafter's posterior form, aged a round) and the
one it replaced (per match length one rate pooled over the tokens, decayed a proposal, over a Beta(1, 3) start).

    python benchmarks/suffix_calibration.py --requests 32 --max-new-tokens 64 --rows 1,4,16 \
        --output benchmarks/suffix-calibration/results.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from serving_common import (add_prompt_arguments, command_line, draw_sequences, environment, git_state, load_models,
                            md_table, prompt_ids, prompt_pools, provenance_lines, write_report)

KS = (1, 2, 4, 7)


class PooledRate:
    """The estimate before per-token rates: per match length one rate over every proposed token, decayed by 0.9 a
    proposal, over a Beta(1, 3) start (kept here as the reference it is compared with)."""

    def __init__(self):
        self.accepted, self.reached = {}, {}

    def rates(self, match: int, count: int) -> list[float]:
        return [(self.accepted.get(match, 0.0) + 1.0) / (self.reached.get(match, 0.0) + 4.0)] * count

    def record(self, match: int, proposed: int, accepted: int) -> None:
        self.accepted[match] = 0.9 * self.accepted.get(match, 0.0) + accepted
        self.reached[match] = 0.9 * self.reached.get(match, 0.0) + min(accepted + 1, proposed)

    def age(self) -> None:
        pass


def replay(answers: list[tuple[int, list[int]]], rows: int, estimate) -> dict:
    """Decode the answers R at a time, one token a round: each row proposes, is priced, then scored."""
    from hf_dspark.models.suffix import SuffixIndex
    from hf_dspark.policy.acceptance import survivals

    expected, delivered, proposals = {k: 0.0 for k in KS}, {k: 0.0 for k in KS}, 0
    for first in range(0, len(answers) - rows + 1, rows):
        group = answers[first : first + rows]
        indexes = []
        for start, tokens in group:
            index = SuffixIndex()
            index.extend(tokens[:start])
            indexes.append(index)
        for position in range(min(start for start, _ in group), max(len(tokens) for _, tokens in group)):
            outcomes = []
            for (start, tokens), index in zip(group, indexes):
                if not start <= position < len(tokens):
                    continue
                proposal, match = index.propose(7)
                if proposal:
                    accepted = 0
                    while accepted < len(proposal) and position + accepted < len(tokens) and \
                            tokens[position + accepted] == proposal[accepted]:
                        accepted += 1
                    survival = survivals(estimate.rates(match, len(proposal)))
                    for k in KS:
                        expected[k] += sum(survival[:k])
                        delivered[k] += min(accepted, k)
                    proposals += 1
                    outcomes.append((match, len(proposal), accepted))
                index.extend([tokens[position]])
            for outcome in outcomes:
                estimate.record(*outcome)
            estimate.age()
    return {"proposals": proposals, "expected": {k: v / max(proposals, 1) for k, v in expected.items()},
            "delivered": {k: v / max(proposals, 1) for k, v in delivered.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default="benchmarks/suffix-calibration/results.json")
    add_prompt_arguments(parser)
    args = parser.parse_args()

    from hf_dspark import SpeculativeEngine
    from hf_dspark.policy.acceptance import SuffixAcceptance

    target, tokenizer, _ = load_models(None, args.threads)
    prompts = [prompt_ids(tokenizer, p.text) for p in draw_sequences(prompt_pools(args, tokenizer), 1, args.requests,
                                                                     args.seed)[0]]
    engine = SpeculativeEngine(target, None)
    ids = [engine.submit(torch.tensor(p), args.max_new_tokens) for p in prompts]
    outputs = engine.run_until_done()
    answers = [(len(p), outputs[i].tolist()) for p, i in zip(prompts, ids)]

    cells = []
    for rows in map(int, args.rows.split(",")):
        for name, make in (("per token (the policy's)", SuffixAcceptance), ("pooled (before)", PooledRate)):
            cell = {"rows": rows, "estimate": name, **replay(answers, rows, make())}
            cells.append(cell)
            print(f"R={rows:2d} {name:25s} " + " ".join(
                f"k{k} {cell['expected'][k]:.3f}/{cell['delivered'][k]:.3f}" for k in KS), flush=True)

    results = {"command": command_line(), "git": git_state(), "environment": environment(args.threads),
               "requests": args.requests, "max_new_tokens": args.max_new_tokens, "cells": cells}
    table = [[c["rows"], c["estimate"], c["proposals"],
              *(f"{c['expected'][k]:.3f} / {c['delivered'][k]:.3f} ({c['expected'][k] / c['delivered'][k]:.2f}x)"
                for k in KS)] for c in cells]
    lines = ["# Suffix acceptance: expected against delivered accepted tokens", "", *provenance_lines(results), "",
             f"The target's greedy answers ({args.max_new_tokens} new tokens) to {args.requests} prompts of the "
             "serving mix, replayed R at a time (one token a round, the estimate aged each round); per proposal, "
             "before its outcome, the expected accepted tokens among its first k, then what it delivered. Mean per "
             "proposal, expected / delivered (ratio).", "",
             *md_table(["R", "estimate", "proposals", *(f"first {k}" for k in KS)], table)]
    write_report(Path(args.output), results, lines)


if __name__ == "__main__":
    main()
