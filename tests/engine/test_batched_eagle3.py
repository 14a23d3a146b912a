"""Eagle3 drafters in the batched engine: every row equals its prompt's own plain greedy output, whatever shares the
batch and whenever it joined; each request drafts what batch-1 decoding of its prompt drafts (the same verified
lengths and accepted counts, round for round: its drafter context, holes and all, is its own); `("fixed", k)`
bounds the chains; sampled rows follow the target's distribution."""

from collections import Counter

import pytest
import torch

import hf_dspark.generation.engine.speculative_engine as batched
from hf_dspark.evaluation.host_syncs import HostSyncCounter
from hf_dspark.generation.one_prompt import prompt_rows as one_prompt_rows
from hf_dspark.generation.engine import eagle3 as engine_eagle3
from hf_dspark.generation import batched_speculative_generate
from factories import VOCAB, prompts, tiny_drafter, tiny_target
from lossless_checks import assert_three_tokens_match
from batch_helpers import left_pad, run_staggered
from batch_helpers import unpadded_rows
from lossless_checks import TINY_VOCAB, exact_three_token_distribution

MAX_NEW = 16
POLICIES = [("all", None), ("fixed", 1)]
PROMPTS = prompts(5) + [prompts(1, length=15, seed=7)[0]]  # 6 to 8 tokens, and one longer newcomer


def trained_eagle3(target, prompt_list, steps: int = 150):
    """A tiny Eagle3 drafter fitted to the target's greedy continuations of `prompt_list` (its context rows and
    its first chain step), so that rounds accept some drafts and not others; drafted by the drafter alone every
    round (no round planning, no suffix proposals), as batch 1 then drafts too."""
    drafter = tiny_drafter(target, "eagle3", block_size=4)
    drafter.generation_config.dspark_round_planning = False
    drafter.generation_config.dspark_suffix_drafting = False
    drafter.attach_target(target)
    with torch.no_grad():
        sequences = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + 24)[0] for p in prompt_list]
        width = min(s.shape[0] for s in sequences)
        sequences = torch.stack([s[-width:] for s in sequences])
        out = target(sequences, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in drafter.target_hidden_state_indices], dim=-1)
    labels = out.logits.argmax(dim=-1)  # the target's greedy token after each position
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    loss_fn = torch.nn.functional.cross_entropy
    for _ in range(steps):
        # Row t reads the feature at t and the token at t + 1 and predicts the target's token after t + 1; a chain
        # step reads the drafter's own state of the row before.
        context = drafter(input_ids=sequences[:, 1:], target_hidden_states=features[:, :-1])
        step = drafter(input_ids=sequences[:, 2:], hidden_states=context.hidden_states[:, :-1])
        loss = loss_fn(context.logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1)) + \
            loss_fn(step.logits.reshape(-1, VOCAB), labels[:, 2:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval().requires_grad_(False)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    target = tiny_target(request.param)
    drafter = trained_eagle3(target, PROMPTS)
    references = [target.generate(p, do_sample=False, max_new_tokens=MAX_NEW + 8)[0] for p in PROMPTS]
    return target, drafter, references


def batch_one_rounds(target, drafter, prompt, max_new: int, policy) -> list[tuple[int, int]]:
    """(verified, accepted) of every round of batch-1 decoding of `prompt` alone."""
    target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=max_new,
                    dspark_verification_policy=policy[0] if policy[1] is None else policy)
    stats = drafter.last_generation_stats
    return list(zip(stats.draft_lengths, stats.accepted))


def assert_partial_acceptance(all_stats) -> None:
    rounds = [(d, a) for stats in all_stats for d, a in zip(stats.draft_lengths, stats.accepted)]
    assert any(a > 0 for d, a in rounds) and any(a < d for d, a in rounds)
    assert len(Counter(a for _, a in rounds)) >= 2


@pytest.mark.parametrize("num_rows", [2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_rows_match_plain_greedy_and_draft_as_batch_one(setup, num_rows, policy):
    target, drafter, references = setup
    prompt_list = PROMPTS[:num_rows]
    ids, mask = left_pad(prompt_list)
    out = batched_speculative_generate(target, drafter, ids, mask, max_new_tokens=MAX_NEW, policy=policy[0],
                                       policy_arg=policy[1])
    for row, (sequence, prompt) in enumerate(zip(out.sequences, prompt_list)):
        assert torch.equal(sequence, references[row][: prompt.shape[1] + MAX_NEW]), f"row {row}"
        rounds = list(zip(out.stats[row].draft_lengths, out.stats[row].accepted))
        assert rounds == batch_one_rounds(target, drafter, prompt, MAX_NEW, policy), f"row {row}"
        assert max(out.stats[row].draft_lengths) == (4 if policy[0] == "all" else 1)
    if policy[0] == "all":
        assert_partial_acceptance(out.stats)


def test_generate_runs_a_batch_through_the_engine(setup):
    target, drafter, references = setup
    prompt_list = PROMPTS[:3]
    ids, mask = left_pad(prompt_list)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=MAX_NEW, return_dict_in_generate=True)
    expected = [references[row][: p.shape[1] + MAX_NEW].tolist() for row, p in enumerate(prompt_list)]
    assert unpadded_rows(out.sequences, mask, pad=0) == expected
    assert_partial_acceptance(out.request_stats)
    # An untrained drafter (almost nothing accepted) through the same route, with ("fixed", 2).
    random_drafter = tiny_drafter(target, "eagle3", block_size=4)
    result = target.generate(ids, attention_mask=mask, assistant_model=random_drafter, do_sample=False,
                             max_new_tokens=MAX_NEW, dspark_verification_policy=("fixed", 2))
    assert unpadded_rows(result, mask, pad=0) == expected
    assert max(random_drafter.last_generation_stats.draft_lengths) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_joining_late_match_plain_greedy_and_batch_one(setup, policy):
    """Requests join between steps (one longer than the running rows) and finish at different times; each still
    drafts what it drafts alone, and the drafter cache stays within the target cache's width."""
    target, drafter, references = setup
    max_new = {0: 16, 1: 9, 2: 16, 3: 5, 4: 12, 5: 10}
    arrivals = {0: 0, 1: 0, 2: 2, 3: 3, 4: 3, 5: 5}
    engine = batched.SpeculativeEngine(target, drafter, *policy, keep_stats=True)
    outputs = run_staggered(engine, PROMPTS, arrivals, max_new)
    assert sorted(outputs) == sorted(engine.stats) == list(range(len(PROMPTS)))  # request ids in arrival order
    for index, prompt in enumerate(PROMPTS):
        assert torch.equal(outputs[index], references[index][: prompt.shape[1] + max_new[index]]), f"request {index}"
        stats = engine.stats[index]
        rounds = list(zip(stats.draft_lengths, stats.accepted))
        assert rounds == batch_one_rounds(target, drafter, prompt, max_new[index], policy), f"request {index}"
    if policy[0] == "all":
        assert_partial_acceptance(engine.stats.values())


def test_round_planning_rounds_without_the_drafter_keep_its_context(setup):
    """With round planning (the drafter's defaults), rows draft in some rounds only: the context of the rounds in
    between stays queued, with the tokens after it, for the row's next chain; outputs stay plain greedy."""
    target, _, references = setup
    drafter = tiny_drafter(target, "eagle3", block_size=4)  # untrained: the planner soon stops drafting
    engine = batched.SpeculativeEngine(target, drafter, keep_stats=True)
    max_new = {0: 20, 1: 9, 2: 20, 3: 5, 4: 12, 5: 10}
    outputs = run_staggered(engine, PROMPTS, {0: 0, 1: 0, 2: 2, 3: 3, 4: 3, 5: 5}, max_new)
    for index, prompt in enumerate(PROMPTS):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=max_new[index])[0]
        assert torch.equal(outputs[index], expected), f"request {index}"


@pytest.mark.parametrize("k", [1, 2])
def test_a_fixed_policy_bounds_the_chains(setup, k):
    """("fixed", k) drafts k tokens per round: k - 1 chain steps after the context pass, none for k = 1."""
    target, drafter, _ = setup
    chains = []  # per drafting pass, the chain steps after its context pass

    def count(module, args, kwargs, out):
        if kwargs.get("hidden_states") is None:
            chains.append(0)
        else:
            chains[-1] += 1

    hook = drafter.register_forward_hook(count, with_kwargs=True)
    try:
        engine = batched.SpeculativeEngine(target, drafter, "fixed", k)
        assert engine.draft_length == k
        for prompt in PROMPTS[:3]:
            engine.submit(prompt[0], MAX_NEW)
        engine.run_until_done()
    finally:
        hook.remove()
    assert len(chains) > 3 and max(chains) == k - 1


@pytest.mark.parametrize("rows", [1, 4])
def test_an_engine_step_reads_the_device_at_most_three_times(setup, rows):
    """Eagle3 rounds add no host read to the engine's two (the verified lengths, then the accepted counts and
    tokens; one more when requests finish): lengths come from the rule on the device, each row's newest context
    row is picked by index. Batch 1 drafts through the very same steps."""
    assert one_prompt_rows.context_pass is engine_eagle3.context_pass
    assert one_prompt_rows.draft_chain is engine_eagle3.draft_chain
    target, drafter, _ = setup
    engine = batched.SpeculativeEngine(target, drafter, "all")
    for index, prompt in enumerate(PROMPTS[:rows]):
        engine.submit(prompt[0], 12 + index % 5, do_sample=index % 2 == 1)  # rows finish at different steps
    engine.step()  # admission
    counts = []
    while engine.num_running:
        with HostSyncCounter() as syncs:
            engine.step()
        counts.append(syncs.total)
    assert len(counts) >= 3 and max(counts) <= 3


def test_policies_reading_confidences_are_refused(setup):
    target, drafter, _ = setup
    with pytest.raises(ValueError, match="confidence head"):
        batched.SpeculativeEngine(target, drafter, "threshold", 0.5)


@pytest.mark.slow  # a sampling-distribution test
def test_sampled_rows_follow_the_target_distribution():
    """Two requests per batch, prompts of different lengths: each one's first three new tokens (x1 from the
    prefill, x2 and x3 from the first round's three-token chain, accepted or resampled, or the correction) follow
    its own prompt's exact joint distribution."""
    target = tiny_target("llama", vocab_size=TINY_VOCAB, initializer_range=0.1, pad_token_id=None, bos_token_id=None)
    drafter = tiny_drafter(target, "eagle3", block_size=3)
    drafter.generation_config.dspark_round_planning = False  # every round drafts its whole budget
    pair = [torch.tensor([[1, 4, 2, 5]]), torch.tensor([[3, 0, 2]])]
    temperature, top_p = 0.7, 0.9
    joints = [exact_three_token_distribution(target, p, temperature, top_p) for p in pair]
    biased = [exact_three_token_distribution(target, p, temperature * temperature, top_p) for p in pair]
    engine = batched.SpeculativeEngine(target, drafter, "all", generator=torch.Generator().manual_seed(2024),
                                       keep_stats=True)
    samples = 2500
    counts = [torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB) for _ in pair]
    drafted = accepted = 0
    for _ in range(samples):
        ids = [engine.submit(p[0], 5, do_sample=True, temperature=temperature, top_p=top_p) for p in pair]
        outputs = engine.run_until_done()
        for request_id, prompt, table in zip(ids, pair, counts):
            x1, x2, x3 = outputs[request_id][prompt.shape[1] : prompt.shape[1] + 3].tolist()
            table[x1, x2, x3] += 1
            stats = engine.stats.pop(request_id)
            assert stats.draft_lengths[0] == 3  # the first round drafts the whole chain
            drafted += stats.draft_lengths[0]
            accepted += stats.accepted[0]
    assert 0.05 * drafted < accepted < 0.95 * drafted  # both accepted and rejected drafts occurred
    for table, joint, wrong in zip(counts, joints, biased):
        assert_three_tokens_match(table, joint, wrong, samples)
