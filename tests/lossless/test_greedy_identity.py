"""Greedy speculative output must equal plain greedy output token for token (float32), on every device (the
`device` fixture: the CPU, and CUDA when present)."""

import pytest
import torch

from hf_dspark.policy import DSparkScheduler, VerificationCostTable
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_dspark import DraftingState
from hf_dspark.generation.one_prompt.prompt_rows import OnePromptRows
from hf_dspark.generation.round.sampling import ProcessorSampling
from factories import prompts, tiny_drafter, tiny_target

DRAFTER_KINDS = ["markov", "gated", "rnn", "dflash", "dflash2", "eagle3"]


def plain_greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_random_drafter_matches_plain_greedy(family, kind, device):
    target = tiny_target(family).to(device)
    drafter = tiny_drafter(target, kind).to(device)
    for ids in prompts(4, device=device):
        expected = plain_greedy(target, ids, max_new_tokens=20)
        actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20)
        assert torch.equal(actual, expected)
        stats = drafter.last_generation_stats
        assert stats.num_rounds >= 1 and 1.0 <= stats.tau <= drafter.config.block_size + 1


def use_oracle(monkeypatch, reference: torch.Tensor, correct_slots: int | None):
    """Make every drafter propose the target's own greedy continuation (taken from ``reference``), corrupted
    from slot ``correct_slots`` on. The real drafter still runs; only the (greedy) token choice is replaced."""

    def choose(self, processed, generator=None):
        position = self.oracle_position  # the sequence position this draft slot predicts
        self.oracle_position += 1
        slot = position - self.oracle_anchor - 1
        token = int(reference[0, position]) if position < reference.shape[1] else 0
        if correct_slots is not None and slot >= correct_slots:
            token = (token + 1) % processed.shape[-1]
        return torch.tensor([token], device=processed.device), None

    original = OnePromptRows.draft

    def draft(self, budget, slots, rule, sampling, generator):
        sampling.oracle_anchor = self.sequence.shape[1] - 1
        sampling.oracle_position = self.sequence.shape[1]
        return original(self, budget, slots, rule, sampling, generator)

    monkeypatch.setattr(ProcessorSampling, "choose", choose)
    monkeypatch.setattr(OnePromptRows, "draft", draft)


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
@pytest.mark.parametrize("correct_slots,expected_accepts", [(None, 4), (2, 2), (0, 0)])
def test_full_partial_and_zero_acceptance(monkeypatch, family, kind, correct_slots, expected_accepts, device):
    target = tiny_target(family).to(device)
    drafter = tiny_drafter(target, kind, block_size=4).to(device)
    drafter.generation_config.dspark_round_planning = False  # every round drafts its block, whatever it accepts
    ids = prompts(1, device=device)[0]
    reference = plain_greedy(target, ids, max_new_tokens=40)
    use_oracle(monkeypatch, reference, correct_slots)
    actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=21)
    assert torch.equal(actual, reference[:, : ids.shape[1] + 21])
    stats = drafter.last_generation_stats
    full_rounds = [a for a, d in zip(stats.accepted, stats.draft_lengths) if d == 4]
    assert full_rounds and all(a == expected_accepts for a in full_rounds)
    assert stats.tau == pytest.approx((sum(stats.accepted) + stats.num_rounds) / stats.num_rounds)


@pytest.mark.parametrize("kind", ["rnn", "eagle3"])
def test_eos_and_max_length_inside_a_block(monkeypatch, kind, device):
    target = tiny_target("llama").to(device)
    drafter = tiny_drafter(target, kind, block_size=6).to(device)
    ids = prompts(1, device=device)[0]
    reference = plain_greedy(target, ids, max_new_tokens=40)
    use_oracle(monkeypatch, reference, correct_slots=None)  # full acceptance: blocks run past EOS / the limit
    new_tokens = reference[0, ids.shape[1] :].tolist()
    eos = next(t for i, t in enumerate(new_tokens) if i >= 3 and t not in new_tokens[:i])
    expected = plain_greedy(target, ids, max_new_tokens=40, eos_token_id=eos)
    actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, eos_token_id=eos)
    assert int(expected[0, -1]) == eos and expected.shape[1] < reference.shape[1]
    assert torch.equal(actual, expected)
    for limit in (1, 2, 5, 9):
        expected = plain_greedy(target, ids, max_new_tokens=limit)
        actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=limit)
        assert torch.equal(actual, expected)


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_stopping_criteria_streamer_and_processors(family, device):
    target = tiny_target(family).to(device)
    drafter = tiny_drafter(target, "markov").to(device)
    ids = prompts(1, device=device)[0]
    reference = plain_greedy(target, ids, max_new_tokens=30)
    stop_token = int(reference[0, ids.shape[1] + 6])
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    expected = plain_greedy(target, ids, max_new_tokens=30, stopping_criteria=criteria, repetition_penalty=1.3)
    streamer = CollectingStreamer()
    actual = target.generate(
        ids,
        assistant_model=drafter,
        do_sample=False,
        max_new_tokens=30,
        stopping_criteria=criteria,
        repetition_penalty=1.3,
        streamer=streamer,
    )
    assert torch.equal(actual, expected)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == actual[0, ids.shape[1] :].tolist()


def test_return_dict_scores_logits_and_stats(family, device):
    target = tiny_target(family).to(device)
    drafter = tiny_drafter(target, "gated").to(device)
    ids = prompts(1, device=device)[0]
    kwargs = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = target.generate(ids, **kwargs)
    actual = target.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == 12
    for got, want in zip(actual.scores, expected.scores):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(actual.logits, expected.logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert actual.cache.get_seq_length() == actual.sequences.shape[1] - 1
    assert actual.speculative_stats is drafter.last_generation_stats


STOP_RULES = [("threshold", 0.3), ("threshold", 0.5), ("threshold", 1.01),
              ("costs", [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]), ("costs", [1.0, 1.6, 2.2, 2.8, 3.4, 4.0, 4.6])]


@pytest.mark.parametrize("rule,value", STOP_RULES)
def test_confidence_stop_rules_end_blocks_early_and_stay_exact(rule, value, device):
    """A static survival threshold, or the throughput schedule over a cost table, shortens drafts losslessly."""
    target = tiny_target("qwen3").to(device)
    drafter = tiny_drafter(target, "markov", block_size=6).to(device)
    if rule == "threshold":
        drafter.generation_config.assistant_confidence_threshold = value
    else:
        drafter.generation_config.dspark_cost_table = VerificationCostTable(value)
    state = DraftingState()  # the round planner learns over the three prompts
    for ids in prompts(3, device=device):
        expected = plain_greedy(target, ids, max_new_tokens=16)
        actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16, dspark_state=state)
        assert torch.equal(actual, expected)
        stats = drafter.last_generation_stats
        for length, confidences in zip(stats.draft_lengths, stats.confidences):
            assert length == len(confidences)
            survival = torch.tensor(confidences).cumprod(0)
            if rule == "threshold":
                assert (survival >= value).all()
            else:  # every verified slot raised the expected throughput E(k) / cost(k + 1)
                costs = drafter.generation_config.dspark_cost_table
                rates = [(1 + float(survival[:k].sum())) / costs.padded_round_seconds(k + 1)
                         for k in range(length + 1)]
                assert all(later > earlier for earlier, later in zip(rates, rates[1:]))
        if rule == "threshold" and value > 1:
            assert set(stats.draft_lengths) == {0}


def test_throughput_draft_length_admits_until_the_first_drop():
    scheduler = DSparkScheduler(VerificationCostTable([1.0, 1.2, 1.4, 1.6, 1.8]))
    # Survivals 0.9, 0.45, 0.09. T(0) = 1/1; T(1) = 1.9/1.2; T(2) = 2.35/1.4; T(3) = 2.44/1.6 < T(2): two slots.
    assert scheduler.select_lengths(torch.tensor([[0.9, 0.5, 0.2]])).tolist() == [2]
    flat = DSparkScheduler(VerificationCostTable([1.0] * 8))  # a GPU-like table: every slot is worth it
    assert flat.select_lengths(torch.tensor([[0.5, 0.2, 0.1]])).tolist() == [3]


def test_plain_and_stock_assisted_generate_untouched(device, monkeypatch):
    """Stock assisted decoding and prompt lookup do what they do without hf_dspark (its wrappers change nothing),
    and that is plain greedy decoding's output unless stock transformers itself departs from it."""
    from hook_checks import with_and_without_hf_dspark

    target = tiny_target("llama").to(device)
    ids = prompts(1, device=device)[0]
    plain = plain_greedy(target, ids, max_new_tokens=10)
    # A fresh assistant per call: stock assisted decoding adapts `num_assistant_tokens` on the assistant's own
    # generation_config, and a later call verifying other widths may pick other kernels (on a GPU, other roundings).
    calls = {
        "assisted": lambda: target.generate(ids, assistant_model=tiny_target("llama", seed=5).to(device),
                                            do_sample=False, max_new_tokens=10),
        "prompt lookup": lambda: target.generate(ids, prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=10),
    }
    for name, call in calls.items():
        unhooked, hooked = with_and_without_hf_dspark(monkeypatch, call)
        assert hooked == unhooked, name
        if unhooked != ("tokens", plain.tolist()):
            pytest.skip(f"stock transformers' {name} decoding departs from plain greedy on its own: {unhooked[:2]}")


@pytest.mark.parametrize("kind", ["markov", "dflash2", "eagle3"])
def test_draft_vocabulary_only_proposes_its_tokens_and_stays_exact(kind, device):
    target = tiny_target("llama").to(device)
    drafter = tiny_drafter(target, kind, draft_vocab_size=24).to(device)
    allowed = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(3))[:24]
    drafter.set_draft_vocab(allowed)
    proposed = []
    original = ProcessorSampling.choose

    def spy(self, processed, generator=None):
        token, distribution = original(self, processed, generator)
        proposed.append(int(token))
        assert torch.isinf(processed[0, [t for t in range(target.config.vocab_size) if t not in allowed]]).all()
        return token, distribution

    ProcessorSampling.choose = spy
    try:
        for ids in prompts(3, device=device):
            expected = plain_greedy(target, ids, max_new_tokens=16)
            actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16)
            assert torch.equal(actual, expected)
            sampled = target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=16)
            assert sampled.shape[1] == ids.shape[1] + 16
    finally:
        ProcessorSampling.choose = original
    assert proposed and set(proposed) <= set(allowed.tolist())


def test_verification_padded_to_a_cheaper_size_stays_exact(device):
    table = VerificationCostTable([1.0, 3.0, 3.0, 3.0, 1.2, 5.0, 5.0, 5.0])
    assert [table.padded_tokens(n) for n in (1, 2, 4, 5, 6, 9)] == [1, 5, 5, 5, 6, 9]
    target = tiny_target("llama").to(device)
    drafter = tiny_drafter(target, "markov", block_size=6).to(device)
    # The table is the truth here, not what the tiny models cost; the scheduler alone picks each round's length.
    drafter.generation_config.update(dspark_cost_table=table, dspark_learn_round_costs=False,
                                     dspark_round_planning=False)
    state = DraftingState()
    sizes = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)
    try:
        for ids in prompts(3, device=device):
            expected = plain_greedy(target, ids, max_new_tokens=16)
            sizes.clear()
            actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                                     dspark_state=state)
            assert torch.equal(actual, expected)
            lengths = drafter.last_generation_stats.draft_lengths
            # Every verification forward ran at the padded size of its drafts + 1 (after the prefill).
            assert sizes[1:] == [table.padded_tokens(k + 1) for k in lengths]
            assert any(table.padded_tokens(k + 1) > k + 1 for k in lengths)
    finally:
        hook.remove()
