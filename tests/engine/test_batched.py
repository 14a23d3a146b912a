"""The batched engine must be as lossless as batch-1 decoding: greedy rows equal each prompt's own plain greedy
output token for token, and sampled rows follow the target's distribution exactly."""

from collections import Counter

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import hf_dspark.generation.engine.speculative_engine as batched
import hf_dspark.generation.engine.passes as engine_rounds
from hf_dspark.generation import batched_speculative_generate
from hf_dspark.policy import DSparkScheduler, VerificationCostTable
from factories import VOCAB, prompts, tiny_drafter, tiny_target
from lossless_checks import assert_three_tokens_match
from lossless_checks import TINY_VOCAB, chi_square, critical_value, exact_three_token_distribution
from batch_helpers import MAX_NEW, assert_rows_equal, left_pad, plain_greedy, run_staggered, use_oracle


def scheduler() -> DSparkScheduler:
    return DSparkScheduler(VerificationCostTable([1.0 + 0.15 * i for i in range(40)]))


# ---------------------------------------------------------------------------------------------------------
# Greedy: every row equals plain greedy decoding of its own prompt
# ---------------------------------------------------------------------------------------------------------


POLICIES = [("all", None), ("fixed", 1), ("threshold", 0.3), ("scheduler", "table")]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["markov", "dflash", "dflash2"])
def test_greedy_rows_match_plain_greedy(family, kind):
    target = tiny_target(family)
    drafter = tiny_drafter(target, kind, block_size=4)
    prompt_list = prompts(4)
    expected = plain_greedy(target, prompt_list)
    ids, mask = left_pad(prompt_list)
    for policy, arg in POLICIES:
        if kind in ("dflash", "dflash2") and policy in ("threshold", "scheduler"):
            continue
        arg = scheduler() if arg == "table" else arg
        out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=MAX_NEW, policy=policy,
                                           policy_arg=arg)
        assert_rows_equal(out, expected)
        for stats, sequence, prompt in zip(out.stats, out.sequences, prompt_list):
            # Every round emits its accepted drafts plus one target token; the prefill emitted the first token.
            assert sum(stats.accepted) + stats.num_rounds + 1 == sequence.shape[0] - prompt.shape[1]
            assert all(0 <= a <= d <= 4 for a, d in zip(stats.accepted, stats.draft_lengths))
            if policy == "fixed":
                assert max(stats.draft_lengths) <= 1
            if kind == "markov":
                assert [len(c) for c in stats.confidences] == stats.draft_lengths
        assert len(out.verified_tokens_per_round) == max(s.num_rounds for s in out.stats)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind,policy", [("markov", "all"), ("dflash", "all"), ("dflash2", "all"),
                                         ("markov", "scheduler")])
def test_greedy_rows_with_accepted_drafts(monkeypatch, family, kind, policy):
    """Rows accept 0..gamma drafts in the same round, so their caches fill with holes at different places."""
    target = tiny_target(family)
    drafter = tiny_drafter(target, kind, block_size=4)
    prompt_list = prompts(4)
    references = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
    records = use_oracle(monkeypatch, references, block_size=4)
    ids, mask = left_pad(prompt_list)
    # A nearly flat cost table: the scheduler verifies several drafts, more for confident rows.
    arg = DSparkScheduler(VerificationCostTable([1.0 + 0.02 * i for i in range(60)])) if policy == "scheduler" else None
    out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=MAX_NEW, policy=policy,
                                       policy_arg=arg)
    assert_rows_equal(out, [r[: p.shape[1] + MAX_NEW] for r, p in zip(references, prompt_list)])
    for request, stats in enumerate(out.stats):
        # The oracle sees the rounds that drafted; a round in which no row drafts does not run the drafter.
        mine = [(verified, accepted) for r, verified, accepted in records if r == request]
        assert [pair for pair in zip(stats.draft_lengths, stats.accepted) if pair != (0, 0)] == \
            [pair for pair in mine if pair != (0, 0)]
    accepted = Counter(a for s in out.stats for a in s.accepted)
    assert len(accepted) >= 3  # several different acceptance counts occurred


def test_greedy_with_eager_attention():
    target = tiny_target("llama", attn_implementation="eager")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(3)
    out = batched_speculative_generate(target, drafter, *left_pad(prompt_list), max_new_tokens=MAX_NEW)
    assert_rows_equal(out, plain_greedy(target, prompt_list))


@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_rows_stop_at_eos(monkeypatch, oracle):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(4)
    free = plain_greedy(target, prompt_list)
    # An EOS that one prompt's greedy output reaches mid-way (first seen at new-token index >= 3).
    eos = None
    for sequence, prompt in zip(free, prompt_list):
        new = sequence[prompt.shape[1] :].tolist()
        eos = next((t for i, t in enumerate(new) if 3 <= i < MAX_NEW - 2 and t not in new[:i]), None)
        if eos is not None:
            break
    assert eos is not None
    expected = plain_greedy(target, prompt_list, eos_token_id=eos)
    assert any(e.shape[0] < f.shape[0] for e, f in zip(expected, free))  # some row really stops early
    if oracle:  # with oracle drafts the EOS usually arrives inside a block of accepted drafts
        references = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
        use_oracle(monkeypatch, references, block_size=4)
    out = batched_speculative_generate(target, drafter, *left_pad(prompt_list), max_new_tokens=MAX_NEW,
                                       eos_token_id=eos)
    assert_rows_equal(out, expected)


# ---------------------------------------------------------------------------------------------------------
# Sampling: the joint of the first three new tokens is the target's
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a sampling-distribution test
def test_batched_sampling_matches_target_distribution():
    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)
    drafter = tiny_drafter(target, "markov", block_size=3)
    # Sharpened confidences spread the survivals, and at this cost table the third draft's admission (a width of 4
    # costs 17 % more than 3) turns on the five rows' confidences: lengths vary across batches.
    drafter.config.confidence_temperatures = [0.05, 0.15, 0.15]
    drafter.generation_config.dspark_round_planning = False  # the scheduler alone decides which rounds draft
    policy = DSparkScheduler(VerificationCostTable([14.4 + n for n in range(1, 201)]))
    prompt = torch.tensor([[1, 4, 2, 5]])
    temperature, top_p = 0.7, 0.9
    joint = exact_three_token_distribution(target, prompt, temperature, top_p)
    biased = exact_three_token_distribution(target, prompt, temperature * temperature, top_p)

    batch, calls = 5, 500
    ids = prompt.repeat(batch, 1)
    mask = torch.ones_like(ids)
    generator = torch.Generator().manual_seed(2024)
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    first_lengths: Counter = Counter()
    drafted = accepted = 0
    for _ in range(calls):
        # Five new tokens, so the first round may verify up to three drafts; x1 comes from the prefill and x2, x3
        # from the first round's drafted slots (accepted or resampled) or its correction / bonus token.
        out = batched_speculative_generate(
            target, drafter, ids, mask, max_new_tokens=5, do_sample=True, temperature=temperature, top_p=top_p,
            policy="scheduler", policy_arg=policy, generator=generator,
        )
        for sequence, stats in zip(out.sequences, out.stats):
            x1, x2, x3 = sequence[4:7].tolist()
            counts[x1, x2, x3] += 1
            first_lengths[stats.draft_lengths[0]] += 1
            drafted += sum(stats.draft_lengths)
            accepted += sum(stats.accepted)
    samples = batch * calls
    assert len(first_lengths) >= 2 and first_lengths[0] < samples  # the scheduler both drafted and declined
    assert 0.05 * drafted < accepted < 0.95 * drafted  # both accepted and rejected drafts occurred

    assert_three_tokens_match(counts, joint, biased, samples)  # (x1, x2, x3)


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------


def test_rejects_unsupported_requests():
    target = tiny_target("llama")
    ids, mask = left_pad(prompts(2))
    with pytest.raises(ValueError, match="confidence head"):  # Eagle3 batches run (test_batched_eagle3.py)
        batched_speculative_generate(target, tiny_drafter(target, "eagle3"), ids, mask, max_new_tokens=4,
                                     policy="threshold", policy_arg=0.5)
    dflash = tiny_drafter(target, "dflash")
    with pytest.raises(ValueError, match="confidence head"):
        batched_speculative_generate(target, dflash, ids, mask, max_new_tokens=4, policy="threshold",
                                     policy_arg=0.5)
    with pytest.raises(ValueError, match="left-padded"):
        batched_speculative_generate(target, dflash, ids, mask.flip(1), max_new_tokens=4)


# ---------------------------------------------------------------------------------------------------------
# Continuous batching: requests join and leave between rounds
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["markov", "dflash", "dflash2"])
@pytest.mark.parametrize("oracle", [False, True])
def test_engine_requests_joining_late_match_plain_greedy(monkeypatch, kind, oracle):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4)
    prompt_list = prompts(5) + [prompts(1, length=15, seed=7)[0]]  # a newcomer longer than the running rows
    max_new = {0: 16, 1: 9, 2: 16, 3: 5, 4: 12, 5: 10}
    arrivals = {0: 0, 1: 0, 2: 2, 3: 3, 4: 3, 5: 5}
    references = [target.generate(p, do_sample=False, max_new_tokens=24)[0] for p in prompt_list]
    if oracle:  # drafts the target accepts 0..4 of, so the rows' holes differ when newcomers join
        use_oracle(monkeypatch, references, block_size=4)
    engine = batched.SpeculativeEngine(target, drafter, policy="all", keep_stats=True)
    outputs = run_staggered(engine, prompt_list, arrivals, max_new)
    assert sorted(outputs) == list(range(len(prompt_list)))
    for index, prompt in enumerate(prompt_list):
        expected = references[index][: prompt.shape[1] + max_new[index]]
        assert torch.equal(outputs[index], expected), f"request {index}"
    if oracle:
        assert sum(sum(s.accepted) for s in engine.stats.values()) > 0


def test_engine_mixes_sampling_settings_and_limits():
    """Greedy, top-k 1 (greedy by another route) and real sampling share rounds; each keeps its own settings."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(4)
    expected = plain_greedy(target, prompt_list)
    engine = batched.SpeculativeEngine(target, drafter, policy="threshold", policy_arg=0.2,
                                       generator=torch.Generator().manual_seed(0))
    greedy = engine.submit(prompt_list[0][0], MAX_NEW)
    sampled = engine.submit(prompt_list[1][0], MAX_NEW, do_sample=True, temperature=0.8, top_p=0.9)
    engine.step()
    top1 = engine.submit(prompt_list[2][0], MAX_NEW, do_sample=True, temperature=0.5, top_k=1)
    nothing = engine.submit(prompt_list[3][0], 0)
    outputs = engine.step()
    assert torch.equal(outputs.pop(nothing), prompt_list[3][0])
    outputs.update(engine.run_until_done())
    assert torch.equal(outputs[greedy], expected[0]) and torch.equal(outputs[top1], expected[2])
    assert outputs[sampled].shape[0] == prompt_list[1].shape[1] + MAX_NEW
    assert engine.num_waiting == engine.num_running == 0 and engine.run_until_done() == {}


def test_engine_takes_its_policy_explicitly():
    """The engine reads no drafting setting off the drafter: the policy is what its caller passes."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    scheduler = DSparkScheduler(VerificationCostTable([1.0 + 0.15 * i for i in range(40)]))
    engine = batched.SpeculativeEngine(target, drafter, "scheduler", scheduler)
    assert engine.policy == "scheduler" and engine.policy_arg is scheduler and engine.rule.policy_arg is scheduler
    prompt_list = prompts(3)
    for prompt in prompt_list:
        engine.submit(prompt[0], MAX_NEW)
    outputs = engine.run_until_done()
    for index, expected in enumerate(plain_greedy(target, prompt_list)):
        assert torch.equal(outputs[index], expected)


def test_engine_releases_each_request_statistics_with_its_output():
    """A long-running engine must not keep every request's statistics: they leave with the output (step, cancel,
    run_until_done), readable in `returned_stats` until the next call; `keep_stats=True` keeps them all."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(4)
    engine = batched.SpeculativeEngine(target, drafter, policy="all")
    served = 0
    for _ in range(3):  # waves of requests, as a server sees them
        ids = [engine.submit(prompt[0], MAX_NEW) for prompt in prompt_list[:3]]
        cancelled = engine.submit(prompt_list[3][0], MAX_NEW)
        engine.step()
        engine.cancel(cancelled)
        assert list(engine.returned_stats) == [cancelled] and cancelled not in engine.stats
        outputs = engine.run_until_done()
        served += 4
        assert set(outputs) == set(ids) == set(engine.returned_stats)
        assert engine.stats == {}, f"{len(engine.stats)} finished requests still held after {served} served"
        for request_id in ids:
            rounds = engine.returned_stats[request_id]
            assert rounds.num_rounds >= 1 and sum(rounds.accepted) + rounds.num_rounds >= MAX_NEW - 1
    keeping = batched.SpeculativeEngine(target, drafter, policy="all", keep_stats=True)
    kept = [keeping.submit(prompt[0], MAX_NEW) for prompt in prompt_list]
    keeping.run_until_done()
    assert set(keeping.stats) == set(kept)


# ---------------------------------------------------------------------------------------------------------
# Bad requests never cost the good ones
# ---------------------------------------------------------------------------------------------------------


def test_engine_refuses_bad_token_ids_at_submit_and_keeps_the_others():
    """The probe of issue 16: an out-of-vocabulary request admitted beside a good one used to raise inside
    `step()` and lose the good one. It is refused at `submit`, and the good request returns its plain greedy."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(2)
    expected = plain_greedy(target, prompt_list)
    engine = batched.SpeculativeEngine(target, drafter, policy="all")
    first = engine.submit(prompt_list[0][0], MAX_NEW)
    engine.step()
    second = engine.submit(prompt_list[1][0], MAX_NEW)
    for bad, match in [(torch.tensor([5, 7, VOCAB + 404]), "outside the target's vocabulary"),
                       (torch.tensor([5, -1, 7]), "outside the target's vocabulary"),
                       (torch.tensor([5.0, 7.9]), "integer token ids"),
                       (torch.tensor([True, False]), "integer token ids"),
                       (torch.zeros(0, dtype=torch.long), "non-empty"),
                       (torch.ones(2, 3, dtype=torch.long), "non-empty prompt of shape")]:
        with pytest.raises(ValueError, match=match):
            engine.submit(bad, MAX_NEW)
    assert engine.num_waiting == 1 and engine.num_running == 1
    outputs = engine.run_until_done()
    assert sorted(outputs) == [first, second]
    assert torch.equal(outputs[first], expected[0]) and torch.equal(outputs[second], expected[1])


@pytest.mark.parametrize("where", ["admission", "round"])
def test_a_failing_step_is_undone_and_the_engine_resumes(monkeypatch, where):
    """A step that raises after changing caches (here: right after a target forward appended to the shared cache)
    leaves every request as before the step; after `cancel()` of the culprit, the others equal plain greedy."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(4)
    references = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + 8)[0] for p in prompt_list]
    use_oracle(monkeypatch, references, block_size=4)  # accepted drafts: the caches really change every round
    engine = batched.SpeculativeEngine(target, drafter, policy="all")
    ids = [engine.submit(prompt_list[i][0], MAX_NEW) for i in range(2)]
    engine.step()
    engine.step()
    ids += [engine.submit(prompt_list[i][0], MAX_NEW) for i in range(2, 4)]
    culprit = ids[3]
    original = engine_rounds.target_forward
    calls = []
    failing_call = 0 if where == "admission" else 1  # a step prefills the newcomers, then verifies every row

    def failing_forward(target_model, rows, *args, **kwargs):
        out = original(target_model, rows, *args, **kwargs)  # the cache has grown by now
        calls.append(rows.request.tolist())
        if len(calls) == failing_call + 1:
            raise RuntimeError("simulated failure")
        return out

    monkeypatch.setattr(engine_rounds, "target_forward", failing_forward)
    running = {r: engine._requests[r].tokens.copy() for r in ids}
    width = engine._rows.target_valid.shape[1]
    with pytest.raises(RuntimeError, match="simulated failure") as raised:
        engine.step()
    assert "cancel(request_id)" in "".join(getattr(raised.value, "__notes__", ["cancel(request_id)"]))
    assert culprit in calls[-1] and engine.num_waiting == 2 and engine.num_running == 2
    assert engine._rows.target_valid.shape[1] == width
    assert all(layer.keys.shape[2] == width for layer in engine._rows.target_cache.layers)
    assert {r: engine._requests[r].tokens for r in ids} == running
    assert torch.equal(engine.cancel(culprit), prompt_list[3][0])
    outputs = engine.run_until_done()
    assert sorted(outputs) == ids[:3]
    for request, index in zip(ids[:3], range(3)):
        assert torch.equal(outputs[request], references[index][: prompt_list[index].shape[1] + MAX_NEW])
    assert all(s.num_rounds == len(s.accepted) == len(s.draft_lengths) for s in engine.stats.values())


def test_cancel_a_running_request_keeps_the_others():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt_list = prompts(3)
    expected = plain_greedy(target, prompt_list)
    engine = batched.SpeculativeEngine(target, drafter, policy="all")
    ids = [engine.submit(p[0], MAX_NEW) for p in prompt_list]
    engine.step()
    partial = engine.cancel(ids[1])
    assert torch.equal(partial, expected[1][: partial.shape[0]]) and partial.shape[0] > prompt_list[1].shape[1]
    with pytest.raises(KeyError, match="no request"):
        engine.cancel(ids[1])
    outputs = engine.run_until_done()
    assert sorted(outputs) == [ids[0], ids[2]]
    assert torch.equal(outputs[ids[0]], expected[0]) and torch.equal(outputs[ids[2]], expected[2])


# ---------------------------------------------------------------------------------------------------------
# No drafter: plain continuous batching, and conversations continued on their parked caches
# ---------------------------------------------------------------------------------------------------------


def test_plain_engine_rows_joining_late_match_plain_greedy():
    target = tiny_target("llama")
    prompt_list = prompts(5) + [prompts(1, length=15, seed=7)[0]]  # a newcomer longer than the running rows
    max_new = {0: 16, 1: 9, 2: 16, 3: 5, 4: 12, 5: 10}
    arrivals = {0: 0, 1: 0, 2: 2, 3: 3, 4: 3, 5: 5}
    references = [target.generate(p, do_sample=False, max_new_tokens=24)[0] for p in prompt_list]
    engine = batched.SpeculativeEngine(target, keep_stats=True)
    outputs = run_staggered(engine, prompt_list, arrivals, max_new)
    for index, prompt in enumerate(prompt_list):
        assert torch.equal(outputs[index], references[index][: prompt.shape[1] + max_new[index]]), f"request {index}"
    # Every round verified no drafts and emitted one token per running row.
    assert all(set(s.draft_lengths) == {0} and sum(s.accepted) == 0 for s in engine.stats.values())
    assert max(engine.verified_tokens_per_round) <= len(prompt_list)


def test_later_turns_continue_on_the_parked_cache_with_only_their_new_tokens(monkeypatch):
    """Two conversations finish a turn; their next turns (of different lengths, so the resumed rows have holes)
    join a running fresh prompt in one admission, prefilling only the new tokens, and equal plain greedy decoding
    of the whole text."""
    target = tiny_target("llama")
    first = prompts(3, length=7)
    engine = batched.SpeculativeEngine(target)
    ids = [engine.submit(p[0], 6 + 2 * index, keep_cache=True) for index, p in enumerate(first[:2])]
    outputs = engine.run_until_done()
    parked = [engine.take_parked(r) for r in ids]
    assert [p.tokens for p in parked] == [outputs[r].tolist()[:-1] for r in ids]
    with pytest.raises(KeyError, match="keep_cache=True"):
        engine.take_parked(ids[0])
    follow_ups = [torch.cat([outputs[r], torch.tensor(extra)]) for r, extra in zip(ids, ([5, 9, 2], [7, 3, 8, 1, 4]))]
    fed = []
    original = engine_rounds.target_forward
    monkeypatch.setattr(engine_rounds, "target_forward", lambda target_, rows, tokens, *a, **k: (
        fed.append(tokens.shape), original(target_, rows, tokens, *a, **k))[1])
    running = engine.submit(first[2][0], 12)
    engine.step()
    resumed = [engine.submit(text, 10, resume=cache) for text, cache in zip(follow_ups, parked)]
    result = engine.run_until_done()
    # One forward for both continued conversations, over their new tokens only (the last answer token, never fed
    # to the target, then the new turn).
    assert fed[2] == (2, 1 + 5)
    for request, text in zip(resumed, follow_ups):
        assert torch.equal(result[request], target.generate(text[None], do_sample=False, max_new_tokens=10)[0])
    assert torch.equal(result[running], plain_greedy(target, [first[2]])[0][: first[2].shape[1] + 12])


def test_plain_sampled_rows_follow_the_target_and_their_own_generators():
    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)
    prompt = torch.tensor([1, 4, 2, 5])
    temperature, top_p = 0.7, 0.9
    joint = exact_three_token_distribution(target, prompt[None], temperature, top_p)
    biased = exact_three_token_distribution(target, prompt[None], temperature * temperature, top_p)
    counts = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    engine = batched.SpeculativeEngine(target, generator=torch.Generator().manual_seed(2024))
    samples = 2000
    for index in range(samples):  # half draw from their own generator, half from the engine's
        own = torch.Generator().manual_seed(index) if index % 2 else None
        engine.submit(prompt, 3, do_sample=True, temperature=temperature, top_p=top_p, generator=own)
        if index % 50 == 49:
            for sequence in engine.run_until_done().values():
                counts[tuple(sequence[4:7].tolist())] += 1
    assert_three_tokens_match(counts, joint, biased, samples)

    # A request with its own generator draws the same tokens whatever shares its rounds.
    def sampled(neighbours: int) -> torch.Tensor:
        engine = batched.SpeculativeEngine(target)
        for other in prompts(neighbours, length=5, vocab_size=TINY_VOCAB):
            engine.submit(other[0], 7, do_sample=True)
        mine = engine.submit(prompt, 12, do_sample=True, temperature=temperature, top_p=top_p,
                             generator=torch.Generator().manual_seed(5))
        return engine.run_until_done()[mine]

    assert torch.equal(sampled(0), sampled(3))


def test_plain_top_k_rows_draw_from_the_full_vocabularys_warped_distribution():
    """With a top-k the plain engine warps and draws over the k largest logits only: the same distribution as
    generate's warpers over the whole vocabulary."""
    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)
    prompt = torch.tensor([1, 4, 2, 5])
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(3), TopPLogitsWarper(0.95)])
    with torch.no_grad():
        probs = warpers(prompt[None], target(prompt[None]).logits[:, -1]).softmax(-1)[0]
    engine = batched.SpeculativeEngine(target, generator=torch.Generator().manual_seed(7))
    counts = torch.zeros(TINY_VOCAB)
    for index in range(3000):
        own = torch.Generator().manual_seed(index) if index % 2 else None
        engine.submit(prompt, 1, do_sample=True, temperature=0.7, top_k=3, top_p=0.95, generator=own)
        if index % 100 == 99:
            for sequence in engine.run_until_done().values():
                counts[int(sequence[-1])] += 1
    assert int((probs > 0).sum()) >= 2 and not counts[probs == 0].any()
    assert chi_square(counts, probs) < critical_value(int((probs > 0).sum()) - 1)


def test_plain_engine_refusals_and_undo_of_a_resumed_admission(monkeypatch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    prompt = prompts(1, length=6)[0][0]
    with pytest.raises(ValueError, match="verifies no drafts"):
        batched.SpeculativeEngine(target, policy="fixed", policy_arg=1)
    with pytest.raises(ValueError, match="plain decoding"):
        batched.SpeculativeEngine(target, drafter).submit(prompt, 4, keep_cache=True)
    engine = batched.SpeculativeEngine(target)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        engine.submit(prompt, 0, keep_cache=True)
    request = engine.submit(prompt, 4, keep_cache=True)
    text = engine.run_until_done()[request]
    parked = engine.take_parked(request)
    with pytest.raises(ValueError, match="strict prefix"):
        engine.submit(torch.cat([text[:3] + 1, text[3:]]), 4, resume=parked)
    with pytest.raises(ValueError, match="strict prefix"):
        engine.submit(text[:-1], 4, resume=parked)  # nothing new to prefill
    continued = torch.cat([text, torch.tensor([3, 8])])
    request = engine.submit(continued, 6, resume=parked)
    original = engine_rounds.target_forward

    def failing_forward(*args, **kwargs):
        original(*args, **kwargs)
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(engine_rounds, "target_forward", failing_forward)
    with pytest.raises(RuntimeError, match="simulated failure"):
        engine.step()
    assert engine.num_waiting == 1 and engine._requests[request].resume is parked  # the admission was undone
    monkeypatch.setattr(engine_rounds, "target_forward", original)
    assert torch.equal(engine.run_until_done()[request],
                       target.generate(continued[None], do_sample=False, max_new_tokens=6)[0])


def test_the_drafter_does_not_run_in_rounds_where_no_row_drafts():
    """A round whose rows all have one token left drafts nothing: the drafter stays idle (its context waits
    queued for its next pass), and the output is the plain greedy one."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    calls = []
    drafter.register_forward_hook(lambda *args: calls.append(1))
    prompt_list = prompts(3)
    ids, mask = left_pad(prompt_list)
    out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=2)
    assert_rows_equal(out, [target.generate(p, do_sample=False, max_new_tokens=2)[0] for p in prompt_list])
    assert calls == [] and all(s.draft_lengths == [0] for s in out.stats)
    # Prices at which the drafter pays only if it is accepted well over half the time: a drafter never measured is
    # tried in some rounds (its posterior allows it) and not in others; the context queued over the idle rounds
    # reaches it in its next pass, and the output is exact.
    from factories import priced
    engine = batched.SpeculativeEngine(target, drafter)
    engine.round_policy.costs = priced(lambda r, w: 1.0 + 0.1 * (w - 1), draft=0.2)  # 0.6 s at three rows
    calls.clear()
    requests = [engine.submit(p[0], MAX_NEW) for p in prompt_list]
    outputs = engine.run_until_done()
    for request, p in zip(requests, prompt_list):
        assert torch.equal(outputs[request], target.generate(p, do_sample=False, max_new_tokens=MAX_NEW)[0])
    rounds = len(engine.verified_tokens_per_round)
    assert 0 < len(calls) < rounds, (len(calls), rounds)


def test_a_running_request_shows_its_tokens_so_far():
    """`tokens_so_far` is each step's prefix of the request's final output (what a stream sends), and a returned
    request is gone from it."""
    target = tiny_target("llama")
    engine = batched.SpeculativeEngine(target, tiny_drafter(target, "markov", block_size=4))
    prompt = prompts(1)[0][0]
    request = engine.submit(prompt, 12)
    assert engine.tokens_so_far(request) == prompt.tolist()  # waiting: the prompt alone
    seen, output = [], None
    while output is None:
        finished = engine.step()
        output = finished.get(request)
        if output is None:
            seen.append(engine.tokens_so_far(request))
    assert seen and all(len(a) < len(b) for a, b in zip(seen, seen[1:]))
    assert all(output.tolist()[: len(tokens)] == tokens for tokens in seen)
    with pytest.raises(KeyError, match="no request"):
        engine.tokens_so_far(request)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_queued_drafter_context_appends_in_place_under_inference_mode_too(mode):
    """Rounds that leave the drafter idle append their target features to the queued context in place. A server's
    engine thread runs under `torch.inference_mode()`, where views record no `_base`: asked of `_base`, every such
    round copied the whole queue (a prompt's features included)."""
    with mode():
        rows = engine_rounds._empty_rows([0, 1], None, 2, "cpu")
        valid = torch.ones(2, 1, dtype=torch.bool)
        rows.stage_context(torch.randn(2, 1, 8), valid, torch.zeros(2, 1, dtype=torch.long),
                           torch.zeros(2, 1, dtype=torch.long), width=1)
        staged = [rows.pending[:, -1].clone()]
        rows.stage_context(torch.randn(2, 1, 8), valid, torch.ones(2, 1, dtype=torch.long),
                           torch.zeros(2, 1, dtype=torch.long), width=1)
        storage = rows._pending_storage
        assert storage is not None
        for step in range(2, 20):
            staged.append(rows.pending[:, -1].clone())
            rows.stage_context(torch.randn(2, 1, 8), valid, torch.full((2, 1), step, dtype=torch.long),
                               torch.zeros(2, 1, dtype=torch.long), width=1)
            assert rows._pending_storage is storage  # written in place, no copy of the queue
        assert rows.pending.shape == (2, 20, 8)
        assert all(torch.equal(rows.pending[:, i], features) for i, features in enumerate(staged))
