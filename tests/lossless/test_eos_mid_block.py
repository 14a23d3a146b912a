"""An EOS accepted inside a drafted block ends its row there, exactly like plain `generate` (transformers fixed block
drafters emitting the accepted drafts past such an EOS: "Fix EOS for candidate generators").

Nothing is left to luck: every round's drafts are the target's own greedy continuation (or, for suffix proposals, a
loop the prompt already holds), so whole blocks are accepted, and the EOS is a token that a run without EOS emitted
as an accepted draft with a later draft of the same block accepted too. With that EOS the row must stop at it (a
batch row then padded on the right, as stock `generate` pads it) although the verification accepted drafts past it:
at R = 1 (the batch-1 loop) and R = 3, 5 (the engine; rows stopping in different rounds while others go on), for
every drafter kind, and for suffix proposals."""

import itertools

import pytest
import torch

import hf_dspark.generation.engine.speculative_engine as engine_module
import hf_dspark.generation.round.skeleton as skeleton
from hf_dspark import DraftingState
from hf_dspark.generation.engine.eagle3 import row_drafter_for
from hf_dspark.generation.one_prompt.prompt_rows import OnePromptRows
from hf_dspark.policy import VerificationCostTable
from hf_dspark.policy.costs import CostModel
from factories import promising_suffix, prompts, tiny_drafter, tiny_target
from batch_helpers import left_pad

KINDS = ["markov", "gated", "rnn", "dflash", "dflash2", "eagle3"]
BATCHES = [1, 3, 5]
BLOCK = 4  # every kind drafts 4 slots a round here
MAX_NEW = 16
PAD = 0


# ---------------------------------------------------------------------------------------------------------
# Rigging and recording
# ---------------------------------------------------------------------------------------------------------


def accept_every_block(monkeypatch, references: list[torch.Tensor]) -> None:
    """Every drafted slot becomes the target's own greedy token there (`references`: each prompt followed by its
    greedy continuation, no EOS), in the batch-1 loop and the engine, for every drafter kind: verification accepts
    whole blocks. The drafter still runs; only its tokens are replaced (greedy verification compares tokens)."""
    draft = OnePromptRows.draft

    def batch_one(self, budget, *args):  # R = 1: the only prompt
        drafts = draft(self, budget, *args)
        start = self.sequence.shape[1]
        for slot in range(int(budget[0])):
            drafts.tokens[0, slot] = references[0][start + slot]
        return drafts

    def engine_pass(drafting_pass):
        def rigged(drafter, rows, budget, *args):
            drafts = drafting_pass(drafter, rows, budget, *args)
            for row, request in enumerate(rows.request.tolist()):  # requests are numbered in submission order
                start = int(rows.target_length[row]) + 1  # the anchor sits at target_length
                for slot in range(int(drafts.lengths[row])):
                    drafts.tokens[row, slot] = references[request][start + slot]
            return drafts
        return rigged

    monkeypatch.setattr(OnePromptRows, "draft", batch_one)
    monkeypatch.setattr(engine_module, "row_drafter_for",
                        lambda drafter: engine_pass(row_drafter_for(drafter) or engine_module._draft))


def record_verifications(monkeypatch) -> list[tuple[list[int], int]]:
    """Every verified row of every round, as (its drafted tokens, how many the verification accepted), before any
    stop is applied: what a loop would emit if it ignored the EOS."""
    records = []

    def recording(verify):
        def verify_and_record(sampling, target_logits, drafts, *args):
            result = verify(sampling, target_logits, drafts, *args)
            for row, (length, accepted) in enumerate(zip(drafts.lengths.tolist(), result[0].tolist())):
                records.append((drafts.tokens[row, :length].tolist(), accepted))
            return result
        return verify_and_record

    monkeypatch.setattr(skeleton, "verify_drafts", recording(skeleton.verify_drafts))  # every round, at every R
    return records


# ---------------------------------------------------------------------------------------------------------
# The check, the same for drafted blocks and suffix proposals
# ---------------------------------------------------------------------------------------------------------


def speculative(target, drafter, prompt_list, **options):
    """(sequences as `generate` returns them, each row's `SpeculativeStats`, the prompts' width)."""
    kwargs = dict(assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD,
                  return_dict_in_generate=True, **options)
    if len(prompt_list) == 1:
        out = target.generate(prompt_list[0], **kwargs)
        assert out.speculative_stats is drafter.last_generation_stats
        return out.sequences, [out.speculative_stats], prompt_list[0].shape[1]
    ids, mask = left_pad(prompt_list, PAD)
    out = target.generate(ids, attention_mask=mask, **kwargs)
    assert len(out.request_stats) == len(prompt_list)
    return out.sequences, out.request_stats, ids.shape[1]


def plain_batch(target, prompt_list, eos: list[int]) -> torch.Tensor:
    """Each prompt's own plain greedy output, laid out as `generate` lays out a batch: left-padded prompts, new
    tokens, rows that stopped early padded on the right."""
    new = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=PAD)
           [0, p.shape[1]:] for p in prompt_list]
    ids = left_pad(prompt_list, PAD)[0] if len(prompt_list) > 1 else prompt_list[0]
    width = ids.shape[1]
    expected = ids.new_full((len(prompt_list), width + max(n.shape[0] for n in new)), PAD)
    expected[:, :width] = ids
    for row, tokens in enumerate(new):
        expected[row, width : width + tokens.shape[0]] = tokens
    return expected


def mid_block_stops(new: list[int], stats, source: str) -> dict[int, tuple[int, int]]:
    """new-token index -> (round, slot) of each token a run emitted as an accepted `source` draft at that slot, with
    the block's next draft accepted too (so it sat inside the accepted drafts), first seen there (an EOS equal to
    it stops the row there), at index 2 or later. Index 0 comes from the prefill; a round emits its accepted
    drafts, then the target's token."""
    stops, index = {}, 1
    for round_index, (proposer, accepted) in enumerate(zip(stats.sources, stats.accepted), start=1):
        for slot in range(accepted - 1):  # a later draft of this block was accepted too
            position = index + slot
            if proposer == source and position >= 2 and new[position] not in new[:position]:
                stops[position] = (round_index, slot)
        index += accepted + 1
    return stops


def first_stop(new: list[int], eos) -> int | None:
    return next((index for index, token in enumerate(new) if token in eos), None)


def choose_eos(news: list[list[int]], candidates: list[dict]) -> list[int]:
    """The fewest EOS ids such that every row that reaches one stops inside an accepted block (`candidates`), some
    row does, and with several rows: rows stop in two rounds at least, and some row never stops. Of those, the ids
    that stop rows in the most rounds, then the most rows."""
    tokens = sorted({token for new in news for token in new})
    for size in (1, 2, 3):
        found = []
        for eos in itertools.combinations(tokens, size):
            stops = [first_stop(new, eos) for new in news]
            if any(s is not None and s not in c for s, c in zip(stops, candidates)):
                continue
            rounds = {c[s][0] for s, c in zip(stops, candidates) if s is not None}
            if rounds and (len(news) == 1 or (len(rounds) >= 2 and None in stops)):
                found.append(((len(rounds), len(news) - stops.count(None)), list(eos)))
        if found:
            return max(found, key=lambda score_and_eos: score_and_eos[0])[1]
    raise AssertionError(f"no EOS ends rows inside accepted blocks: {news}, {candidates}")


def check_eos_mid_block(monkeypatch, target, drafter, prompt_list, source: str, options=dict) -> None:
    """A run without EOS shows where `source` blocks were accepted; an EOS chosen there must end each row at it,
    as plain greedy decoding ends it, although the verification accepted drafts after it. `options()`: the
    call's generate() options (each call its own, so both runs plan alike)."""
    sequences, stats, width = speculative(target, drafter, prompt_list, **options())
    news = [row[width:].tolist() for row in sequences]
    assert all(len(new) == MAX_NEW for new in news)
    candidates = [mid_block_stops(new, row_stats, source) for new, row_stats in zip(news, stats)]
    eos = choose_eos(news, candidates)

    verified = record_verifications(monkeypatch)
    sequences, stats, width = speculative(target, drafter, prompt_list, eos_token_id=eos, **options())
    expected = plain_batch(target, prompt_list, eos)
    assert torch.equal(sequences, expected), f"{sequences.tolist()} != {expected.tolist()}"
    if len(prompt_list) > 1:  # ... which is also what plain generate() does with the left-padded batch
        ids, mask = left_pad(prompt_list, PAD)
        plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                pad_token_id=PAD)
        assert torch.equal(sequences, plain)

    rounds = set()
    for row, (new, candidate, row_stats) in enumerate(zip(news, candidates, stats)):
        stop = first_stop(new, eos)
        emitted = 1 + sum(accepted + 1 for accepted in row_stats.accepted)  # the prefill's token, then the rounds'
        if stop is None:
            assert emitted == MAX_NEW, (row, row_stats.accepted)
            continue
        round_index, slot = candidate[stop]
        rounds.add(round_index)
        # The row ended in the round that drafted its EOS: the EOS stands for that round's target token, the drafts
        # after it in the block are not emitted (not counted as accepted either).
        assert emitted == stop + 1 and row_stats.num_rounds == round_index, (row, stop, row_stats.accepted)
        assert row_stats.sources[-1] == source and row_stats.accepted[-1] == slot
        assert slot + 1 < row_stats.draft_lengths[-1]  # the block went on after the EOS
        # ... and its verification accepted drafts past the EOS: a loop that ignored it would have emitted them.
        block = new[stop - slot : stop + 1]
        assert any(tokens[: slot + 1] == block and accepted >= slot + 2 for tokens, accepted in verified), \
            (row, block, verified)
    assert rounds and (len(prompt_list) == 1 or len(rounds) >= 2)


# ---------------------------------------------------------------------------------------------------------
# The drafter's blocks: every kind, R = 1 and R > 1
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_eos_accepted_inside_a_drafted_block_ends_the_row(monkeypatch, kind, batch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=BLOCK)
    drafter.generation_config.dspark_round_planning = False  # every round drafts its whole block
    prompt_list = prompts(5)[:batch]
    references = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + BLOCK + 1)[0] for p in prompt_list]
    accept_every_block(monkeypatch, references)
    check_eos_mid_block(monkeypatch, target, drafter, prompt_list, "drafter")


# ---------------------------------------------------------------------------------------------------------
# Suffix proposals: prompts that hold the loop the target's greedy text goes on with
# ---------------------------------------------------------------------------------------------------------


def looping_prompts(target, constructions) -> list[torch.Tensor]:
    """Each (seed, index, length): a random prompt followed by the first `length` tokens of its own greedy text,
    which has fallen into a loop by then (small weights), so the text goes on as the prompt's loop did and a suffix
    match proposes exactly what the target emits."""
    built = []
    for seed, index, length in constructions:
        prompt = prompts(8, length=5, seed=seed)[index]
        built.append(target.generate(prompt, do_sample=False, max_new_tokens=length))
    return built


LOOPS = {
    1: [(11, 1, 16)],
    3: [(11, 4, 30), (11, 1, 16), (11, 2, 20)],
    5: [(11, 4, 30), (11, 1, 16), (13, 1, 22), (11, 2, 20), (11, 3, 20)],
}


def suffix_rounds_only() -> dict:
    """generate() options for rounds that verify suffix proposals whenever there is one, decided by the prices and
    statistics given here (nothing measured): verifying more tokens costs nothing more, the drafter's pass far more
    than it could bring, and suffix matches start out promising."""
    state = DraftingState()
    state.statistics.suffix = promising_suffix()
    return dict(dspark_suffix_drafting=True, dspark_round_planning=True, dspark_learn_round_costs=False,
                dspark_cost_table=VerificationCostTable([1.0] * 8, draft_seconds=100.0), dspark_state=state)


@pytest.mark.parametrize("batch", BATCHES)
def test_an_eos_accepted_inside_a_suffix_proposal_ends_the_row(monkeypatch, batch):
    # A step's seconds all its rows' (no fixed part): every row's accepted tokens save their share, so a batch that
    # drains verifies each row's proposal, not only the last row's (the flat table alone prices a row at nothing).
    monkeypatch.setattr(CostModel, "row_seconds", lambda costs, rows: costs.forward_seconds(rows, 1) / rows)
    target = tiny_target("llama", initializer_range=0.08)
    drafter = tiny_drafter(target, "markov", block_size=BLOCK)
    check_eos_mid_block(monkeypatch, target, drafter, looping_prompts(target, LOOPS[batch]), "suffix",
                        suffix_rounds_only)
