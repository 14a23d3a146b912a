"""DFlash 2 drafts exactly: its candidate selector's path distribution is the draft distribution q that verification's
rejection sampling reads, slot by slot given the tokens drawn before, so sampled output follows the target whether a
row drafts one slot or several, at batch 1 and batched (chi-square against the exact joint of three tokens, with
the double-temperature sampler as the control that the same bound rejects). Greedy identity for every drafter kind,
DFlash 2 included, is tests/lossless/test_greedy_identity.py's and tests/engine/test_batched.py's."""

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

import hf_dspark
from factories import tiny_drafter, tiny_target
from hf_dspark.generation import batched_speculative_generate
from hf_dspark.generation.round.drafting import draft_block, draft_input_block
from hf_dspark.generation.round.sampling import ProcessorSampling
from lossless_checks import assert_three_tokens_match
from lossless_checks import TINY_VOCAB, exact_three_token_distribution


def _sampling_pair(seed: int = 1):
    """A 6-token target and a DFlash 2 drafter (3 candidates per slot) whose selector's pairwise term is as large as
    the backbone's logits, so the token drawn at one slot changes the next slot's q."""
    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)
    drafter = tiny_drafter(target, "dflash2", block_size=3, seed=seed)
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.weight.normal_(0.0, 1.5)
        drafter.candidate_selector.successor_codebook.weight.normal_(0.0, 1.5)
    drafter.generation_config.dspark_round_planning = False  # every round drafts its whole block, at any prices
    return target, drafter


def test_draft_probabilities_are_the_selectors_path_distribution():
    target, drafter = _sampling_pair()
    drafter.attach_target(target)
    temperature = 0.7
    sampling = ProcessorSampling(LogitsProcessorList([TemperatureLogitsWarper(temperature)]), do_sample=True)
    ids = torch.tensor([[1, 4, 2, 5]])
    sampling.sequence = ids
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in drafter.target_hidden_state_indices], dim=-1)
        out = drafter(input_ids=draft_input_block(ids[:, -1], drafter.config), target_hidden_states=features)
        seen_second = set()
        for seed in range(20):
            tokens, probs, _ = draft_block(drafter, out, ids[:, -1], 3, sampling,
                                           torch.Generator().manual_seed(seed))
            previous = ids[:, -1]
            for slot in range(3):
                logits, _, _ = drafter.slot_logits(out.last_hidden_state[:, slot], out.base_logits[:, slot], previous,
                                                   None)
                expected = torch.softmax(logits / temperature, dim=-1)
                torch.testing.assert_close(probs[:, slot], expected)
                assert int((expected > 0).sum()) == drafter.config.selector_top_k  # q is 0 off the candidates
                assert expected[0, tokens[0, slot]] > 0
                previous = tokens[:, slot]
            seen_second.add((int(tokens[0, 0]), tuple(probs[0, 1].tolist())))
    # q at the second slot depends on the token drawn at the first: the selector's path, not a fixed row per slot.
    assert len({q for first, q in seen_second}) > 1


@pytest.mark.slow  # a sampling-distribution test
def test_two_drafted_slots_sample_the_target_distribution():
    target, drafter = _sampling_pair()
    ids = torch.tensor([[1, 4, 2, 5]])
    temperature, top_p = 0.7, 0.9
    joint = exact_three_token_distribution(target, ids, temperature, top_p)
    biased = exact_three_token_distribution(target, ids, temperature * temperature, top_p)
    torch.manual_seed(2024)
    samples, drafted, accepted = 2500, 0, 0
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    for _ in range(samples):
        # x1 from the prefill; x2 and x3 the first round's two drafted slots (accepted or resampled).
        out = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=temperature, top_p=top_p,
                              top_k=0, max_new_tokens=4)
        x1, x2, x3 = out[0, 4:7].tolist()
        counts[x1, x2, x3] += 1
        stats = drafter.last_generation_stats
        assert stats.draft_lengths[0] == 2
        drafted += 2
        accepted += stats.accepted[0]
    assert 0.05 * drafted < accepted < 0.95 * drafted  # both accept and reject paths ran
    assert_three_tokens_match(counts, joint, biased, samples)


@pytest.mark.slow  # a sampling-distribution test
def test_batched_rows_sample_the_target_distribution():
    target, drafter = _sampling_pair()
    prompt = torch.tensor([[1, 4, 2, 5]])
    temperature, top_p = 0.7, 0.9
    joint = exact_three_token_distribution(target, prompt, temperature, top_p)
    biased = exact_three_token_distribution(target, prompt, temperature * temperature, top_p)
    batch, calls = 5, 500
    ids, mask = prompt.repeat(batch, 1), torch.ones(batch, prompt.shape[1], dtype=torch.long)
    generator = torch.Generator().manual_seed(2024)
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    drafted = accepted = 0
    for _ in range(calls):
        out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=5, do_sample=True,
                                           temperature=temperature, top_p=top_p, policy="all", generator=generator)
        for sequence, stats in zip(out.sequences, out.stats):
            x1, x2, x3 = sequence[4:7].tolist()
            counts[x1, x2, x3] += 1
            assert stats.draft_lengths[0] >= 2  # x2 and x3 are the first round's drafted slots
            drafted += sum(stats.draft_lengths)
            accepted += sum(stats.accepted)
    assert 0.05 * drafted < accepted < 0.95 * drafted
    assert_three_tokens_match(counts, joint, biased, batch * calls)


def test_auto_drafter_loads_its_own_saved_folder(tmp_path):
    target, drafter = _sampling_pair()
    drafter.save_pretrained(tmp_path)
    loaded = hf_dspark.AutoDrafter.from_pretrained(tmp_path)
    assert type(loaded) is hf_dspark.DFlash2DraftModel
    fields = {name: value for name, value in drafter.config.to_dict().items() if name != "_name_or_path"}
    assert {name: loaded.config.to_dict()[name] for name in fields} == fields
    saved, again = drafter.state_dict(), loaded.state_dict()
    assert saved.keys() == again.keys() and all(torch.equal(saved[name], again[name]) for name in saved)
