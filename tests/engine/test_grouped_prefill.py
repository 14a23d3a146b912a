"""Prompts of very different lengths are prefilled in groups of similar lengths (one left-padded forward each, the
groups' rows merged with holes) instead of one forward padded to the longest: the split is the cheapest one, and
every row is still its prompt's own plain greedy output, for every drafter kind, plain decoding and every kind of
target layer (full, sliding-window, recurrent and convolution)."""

import itertools

import pytest
import torch

import hf_dspark.generation.engine.passes as passes
from hf_dspark.generation.engine.passes import prefill_groups
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.transformers_internals.recurrent_states import keeps_states_per_position
from factories import VOCAB, tiny_drafter, tiny_target
from batch_helpers import left_pad
from batch_helpers import unpadded_rows

MAX_NEW = 10
LENGTHS = (3, 5, 90, 101)  # on a CPU two groups are cheaper than one forward over 4 x 101 slots


def partitions(items: list[int]):
    """Every way to split `items` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        for index in range(len(smaller)):
            yield smaller[:index] + [[first, *smaller[index]]] + smaller[index + 1 :]
        yield [[first], *smaller]


def cost(lengths: list[int], groups: list[list[int]], overhead: int) -> int:
    return sum(len(group) * max(lengths[i] for i in group) + overhead for group in groups)


@pytest.mark.parametrize("overhead", [0, 7, 64, 1000])
def test_the_split_is_the_cheapest_of_all_partitions(overhead):
    generator = torch.Generator().manual_seed(overhead)
    for _ in range(25):
        lengths = torch.randint(1, 200, (int(torch.randint(1, 7, (1,), generator=generator)),),
                                generator=generator).tolist()
        groups = prefill_groups(lengths, overhead)
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(len(lengths)))
        best = min(cost(lengths, p, overhead) for p in partitions(list(range(len(lengths)))))
        assert cost(lengths, groups, overhead) == best, (lengths, groups)


def test_equal_lengths_share_one_forward_and_far_apart_ones_do_not():
    assert prefill_groups([40] * 8, 64) == [list(range(8))]
    assert sorted(map(sorted, prefill_groups([5, 300, 6, 310], 64))) == [[0, 2], [1, 3]]
    assert prefill_groups([5, 300, 6, 310], 10**6) == [[0, 2, 1, 3]]  # a forward dearer than all the padding
    assert prefill_groups([], 64) == []


def spaced_prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(2, VOCAB, (1, length), generator=generator) for length in LENGTHS]


def counted_prefills(monkeypatch) -> list[int]:
    """The real `prefill`, recording how many rows each forward took."""
    calls, original = [], passes.prefill

    def counting(target, input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return original(target, input_ids, *args, **kwargs)

    monkeypatch.setattr(passes, "prefill", counting)
    return calls


FAMILIES = ["llama", "gemma3", *(["qwen3_5", "lfm2"] if keeps_states_per_position() else [])]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["markov", "dflash", "eagle3", None])
def test_rows_prefilled_in_groups_are_each_prompts_own_greedy_output(monkeypatch, family, kind):
    target = tiny_target(family)
    prompt_list = spaced_prompts()
    references = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0].tolist() for p in prompt_list]
    calls = counted_prefills(monkeypatch)
    if kind is None:  # plain continuous batching
        engine = SpeculativeEngine(target)
        ids = [engine.submit(p[0], max_new_tokens=MAX_NEW) for p in prompt_list]
        outputs = engine.run_until_done()
        rows = [outputs[i].tolist() for i in ids]
    else:
        drafter = tiny_drafter(target, kind, block_size=4)
        drafter.generation_config.dspark_round_planning = False  # every round drafts: the drafter reads the merge
        ids, mask = left_pad(prompt_list)
        rows = unpadded_rows(target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                                             max_new_tokens=MAX_NEW), mask, target.config.pad_token_id)
    assert sorted(calls) == [2, 2]  # the short prompts together, the long ones together
    assert rows == references
