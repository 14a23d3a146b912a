"""One implementation of each step of a round: the batch-1 loop and the batched engine call the same functions to
plan the round (the same policy, learning the same way), build the drafter's input block, draft, decide how many
drafts to verify, verify, merge the accepted drafts with the target's token, stop, count what a stopping round
emitted, and propose suffix matches."""

from collections import defaultdict

import pytest
import torch

from conftest import prompts, tiny_drafter, tiny_target
from hf_dspark.generation.engine import passes as engine_rounds
from hf_dspark.generation.engine import requests as engine_requests
from hf_dspark.generation.engine import speculative_engine as batched
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.generation.one_prompt import loop as decoding
from hf_dspark.generation.one_prompt import proposers as candidates
from hf_dspark.generation.round import drafting, stopping, verification
from hf_dspark.models import suffix
from hf_dspark.policy import planner
from hf_dspark.policy.acceptance import SuffixAcceptance
from hf_dspark.policy.planner import RoundPolicy
from hf_dspark.policy.length_rule import DraftLengthRule

# Each step: (the module that defines it, its name), and the modules of both loops that call it by that name.
SHARED_STEPS = {
    "draft_input_block": (drafting, [candidates, batched]),
    "draft_block": (drafting, [candidates, batched]),
    "verify_drafts": (verification, [decoding, engine_rounds, batched]),
    "round_tokens": (drafting, [decoding, engine_rounds]),
    "emitted_drafts": (drafting, [decoding, batched]),
}


def _count_calls(monkeypatch, counts: dict, label: list[str]) -> None:
    """Wrap each shared function, in its defining module and wherever a loop imported it, with one counter per
    loop (`label[0]` says which loop runs)."""
    for name, (home, users) in SHARED_STEPS.items():
        original = getattr(home, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[label[0], _name] += 1
            return _original(*args, **kwargs)

        for module in [home, *users]:
            assert getattr(module, name) is original, f"{module.__name__}.{name} is not {home.__name__}.{name}"
            monkeypatch.setattr(module, name, counted)
    for owner, method in ((stopping.HostStoppingRule, "first_stop"), (suffix.SuffixProposer, "propose"),
                          (DraftLengthRule, "lengths"), (RoundPolicy, "plan"), (RoundPolicy, "record")):
        original = getattr(owner, method)

        def counted_method(self, *args, _original=original, _name=method, **kwargs):
            counts[label[0], f"{type(self).__name__}.{_name}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(owner, method, counted_method)


@pytest.mark.parametrize("kind", ["markov", "dflash"])
def test_batch_one_and_the_engine_run_the_same_steps(monkeypatch, kind):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4, suffix_drafting=True)
    drafter.generation_config.dspark_learn_round_costs = False  # flat prices: both loops draft every round
    counts, label = defaultdict(int), ["batch 1"]
    _count_calls(monkeypatch, counts, label)
    prompt = torch.cat([prompts(1, length=5)[0]] * 2, dim=1)  # repeats itself: suffix proposals
    single = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=10)
    label[0] = "engine"
    engine = SpeculativeEngine(target, drafter)
    request = engine.submit(prompt[0], 10)
    assert torch.equal(engine.run_until_done()[request], single[0])
    steps = [*SHARED_STEPS, "HostStoppingRule.first_stop", "SuffixProposer.propose", "DraftLengthRule.lengths",
             "RoundPolicy.plan", "RoundPolicy.record"]
    for step in steps:
        assert counts["batch 1", step] > 0 and counts["engine", step] > 0, (step, dict(counts))


def test_both_loops_stop_with_one_rule():
    """The engine's stop (EOS, the request's length limit) is the batch-1 loop's `HostStoppingRule`."""
    assert engine_requests.HostStoppingRule is stopping.HostStoppingRule
    request = engine_requests.Request([5, 6], 3, None, {9})
    assert engine_requests.emit([request], [[7, 9, 8]], [3]) == [True] and request.tokens == [5, 6, 7, 9]
    request = engine_requests.Request([5, 6], 2, None, set())
    assert engine_requests.emit([request], [[7, 8, 4]], [3]) == [True] and request.tokens == [5, 6, 7, 8]
    request = engine_requests.Request([5], 5, None, {9})
    assert engine_requests.emit([request], [[7, 8, 4]], [2]) == [False] and request.emitted == 2


def test_both_loops_make_their_round_policy_from_the_calls_plan(monkeypatch):
    """One factory (`DraftingPlan.round_policy`) makes both loops' policy; the batch-1 loop has no policy of its
    own, and the policy's suffix proposals are the suffix module's."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4, suffix_drafting=True)
    made = []
    original = RoundPolicy.__init__

    def recording(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    assert planner.SuffixProposer is suffix.SuffixProposer
    assert not hasattr(candidates, "RoundPolicy") and not hasattr(candidates, "SuffixProposer")
    monkeypatch.setattr(RoundPolicy, "__init__", recording)
    target.generate(prompts(1, length=5)[0], assistant_model=drafter, do_sample=False, max_new_tokens=6)
    engine = SpeculativeEngine(target, drafter)
    engine.submit(prompts(1, length=5)[0][0], 6)
    engine.run_until_done()
    assert len(made) == 2 and all(isinstance(m.suffix_acceptance, SuffixAcceptance) for m in made)
