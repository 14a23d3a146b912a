"""Host round-trips per round: at most 2 at batch 1 for every drafter kind, at most 4 per engine step whatever R.

Counted with `HostSyncCounter` (item / tolist / cpu / bool / int / float / index / nonzero calls), which on a GPU are
the points where the host waits for the device; the CPU makes the same calls, so the counts hold there too."""

import pytest
import torch

from hf_dspark.evaluation.host_syncs import HostSyncCounter
from hf_dspark.generation.engine import speculative_engine as batched
from hf_dspark.generation.one_prompt import prompt_rows as one_prompt_rows
from hf_dspark.generation.round import drafting
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.policy import DSparkScheduler, VerificationCostTable
from factories import prompts, tiny_drafter, tiny_target

COSTS = VerificationCostTable([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7])


def test_the_counter_sees_each_kind_of_host_read():
    x = torch.arange(4)
    with HostSyncCounter() as syncs:
        x.tolist(), x[0].item(), bool(x.any()), int(x[1]), float(x[2]), x.nonzero(), x[: x[1]], x[x > 1]
        y = x + 1, x[torch.tensor([0, 2])]  # device work and gathers are not counted
    assert syncs.by_kind == {"tolist": 1, "item": 1, "bool": 1, "int": 1, "float": 1, "nonzero": 1, "index": 2}
    assert y[0].shape == (4,)


def syncs_per_round(target, drafter, ids, do_sample=False, new_tokens=33):
    """Reads per round, the prefill's subtracted (a one-token call)."""
    counts = []
    for tokens in (1, new_tokens):
        torch.manual_seed(0)
        with HostSyncCounter() as syncs:
            target.generate(ids, assistant_model=drafter, do_sample=do_sample, max_new_tokens=tokens)
        counts.append((syncs.total, drafter.last_generation_stats.num_rounds))
    assert counts[1][1] > counts[0][1] + 8
    return (counts[1][0] - counts[0][0]) / (counts[1][1] - counts[0][1])


@pytest.mark.parametrize("kind", ["markov", "gated", "rnn", "dflash", "dflash2", "eagle3"])
@pytest.mark.parametrize("costs", [None, COSTS], ids=["no-costs", "cost-table"])
def test_batch_one_reads_the_device_at_most_twice_per_round(kind, costs):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=6)
    drafter.generation_config.dspark_cost_table = costs
    ids = prompts(1, length=10)[0]
    assert syncs_per_round(target, drafter, ids) <= 2.0
    assert syncs_per_round(target, drafter, ids, do_sample=True) <= 2.0
    if kind in ("dflash", "dflash2", "eagle3"):  # no confidences to read: the verification's outcome only
        assert syncs_per_round(target, drafter, ids) <= 1.0


def test_batch_one_with_suffix_drafting_and_planning_stays_within_two():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "markov", block_size=6)
    drafter.generation_config.update(dspark_suffix_drafting=True, dspark_cost_table=COSTS)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # repetitive: suffix proposals get chosen
    assert syncs_per_round(target, drafter, ids, new_tokens=40) <= 2.0
    assert drafter.last_generation_stats.count("suffix") + drafter.last_generation_stats.count("drafter") > 0


# The admission rule on a table of its own, and on the loop's own cost model (the default, calibrating confidences).
POLICIES = [("all", None), ("threshold", 0.3), ("scheduler", "table"), ("scheduler", None)]


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("policy,arg", POLICIES)
def test_an_engine_step_reads_the_device_at_most_four_times_whatever_the_rows(rows, policy, arg):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    if arg == "table":
        arg = DSparkScheduler(COSTS)
    engine = SpeculativeEngine(target, drafter, policy, arg)
    for index, prompt in enumerate(prompts(rows, length=6)):
        engine.submit(prompt[0], 12 + index % 5, do_sample=index % 2 == 1)  # rows finish at different steps
    engine.step()  # admission
    counts = []
    while engine.num_running:
        with HostSyncCounter() as syncs:
            engine.step()
        counts.append(syncs.total)
    assert len(counts) >= 5 and max(counts) <= 4


def test_both_loops_draft_and_verify_through_the_one_core():
    assert one_prompt_rows.draft_block is batched.draft_block is drafting.draft_block
    from hf_dspark.generation.round import skeleton, verification

    assert skeleton.verify_drafts is verification.verify_drafts
    # Batch 1 and the engine at R = 1 draft the same tokens on the same context (greedy, no cost table).
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    seen = {"single": [], "engine": []}
    original = drafting.draft_block

    def spy(label):
        def draft_block(drafter_, output, anchor, slots, sampling, generator=None):
            tokens, probs, confidences = original(drafter_, output, anchor, slots, sampling, generator)
            if slots:  # the engine also calls it for a row's last token, with nothing to draft
                seen[label].append((tokens.tolist(), confidences.tolist()))
            return tokens, probs, confidences
        return draft_block

    ids = prompts(1, length=7)[0]
    drafter.generation_config.dspark_round_planning = False  # both loops draft every round
    one_prompt_rows.draft_block = spy("single")
    try:
        single = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    finally:
        one_prompt_rows.draft_block = original
    batched.draft_block = spy("engine")
    try:
        engine = SpeculativeEngine(target, drafter, "all")
        request = engine.submit(ids[0], 12)
        out = engine.run_until_done()[request]
    finally:
        batched.draft_block = original
    assert torch.equal(out, single[0])
    assert seen["single"] and len(seen["single"]) == len(seen["engine"])
    for (tokens_1, conf_1), (tokens_r, conf_r) in zip(seen["single"], seen["engine"]):
        assert tokens_1 == tokens_r
        torch.testing.assert_close(torch.tensor(conf_1), torch.tensor(conf_r), rtol=1e-4, atol=1e-5)
