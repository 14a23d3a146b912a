"""What the batched tests share: left-padded batches, plain greedy references, staggered arrivals into an engine,
rows compared one by one, and the oracle that makes the engine's drafts the target's own continuation."""

import torch

import hf_dspark.generation.engine.speculative_engine as batched
from factories import VOCAB


MAX_NEW = 16


def left_pad(prompt_list: list[torch.Tensor], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompt_list)
    ids = torch.full((len(prompt_list), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompt_list):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask


def plain_greedy(target, prompt_list, **kwargs) -> list[torch.Tensor]:
    return [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW, **kwargs)[0] for p in prompt_list]


def assert_rows_equal(out, expected):
    assert len(out.sequences) == len(expected)
    for row, (actual, reference) in enumerate(zip(out.sequences, expected)):
        assert torch.equal(actual, reference), f"row {row}: {actual.tolist()} != {reference.tolist()}"


def use_oracle(monkeypatch, references: list[torch.Tensor], block_size: int) -> list[tuple[int, int, int]]:
    """Replace each row's drafted tokens by the target's own greedy continuation, corrupted from a slot that varies
    by row and round, so rows accept different numbers of drafts (the holes the engine must get right). Returns the
    (request, verified, expected accepted) of every row and round, filled in as the engine runs."""
    original = batched._draft
    expected: list[tuple[int, int, int]] = []
    rounds = iter(range(10**6))

    def oracle_draft(drafter, rows, budget, *args):
        drafts = original(drafter, rows, budget, *args)
        round_index = next(rounds)
        for row, request in enumerate(rows.request.tolist()):
            start = int(rows.target_length[row]) + 1  # the anchor sits at target_length
            correct = (request + round_index) % (block_size + 1)
            length = int(drafts.lengths[row])
            for slot in range(length):
                token = int(references[request][start + slot])
                drafts.tokens[row, slot] = token if slot < correct else (token + 1) % VOCAB
            expected.append((request, length, min(correct, length)))
        return drafts

    monkeypatch.setattr(batched, "_draft", oracle_draft)
    return expected


def run_staggered(engine, prompt_list, arrivals: dict[int, int], max_new: dict[int, int], **submit_kwargs):
    """Submit prompt i before step arrivals[i]; step until everything is done. Returns {prompt index: output}
    and checks after every step that no cache column is a hole in every running row, and that newcomers share the
    drafter cache's columns (its width stays within the target cache's) instead of widening it by their prompts."""
    outputs, ids = {}, {}
    step = 0
    while len(ids) < len(prompt_list) or engine.num_waiting or engine.num_running:
        for index, arrival in arrivals.items():
            if arrival == step:
                ids[engine.submit(prompt_list[index][0], max_new[index], **submit_kwargs)] = index
        outputs.update(engine.step())
        rows = engine._rows
        if rows is not None:
            assert bool(rows.target_valid.any(dim=0).all()) and bool(rows.draft_valid.any(dim=0).all())
            assert rows.draft_valid.shape[1] <= rows.target_valid.shape[1]
        step += 1
    return {ids[request]: sequence for request, sequence in outputs.items()}


def unpadded_rows(result: torch.Tensor, mask: torch.Tensor, pad: int) -> list[list[int]]:
    """Each row without its left padding, and without the right padding of a row that stopped early."""
    rows = []
    for row, row_mask in zip(result.tolist(), mask):
        row = row[int((row_mask == 0).sum()) :]
        while len(row) > int(row_mask.sum()) and row[-1] == pad:
            row.pop()
        rows.append(row)
    return rows
