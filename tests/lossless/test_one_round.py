"""One round skeleton (`round.skeleton.speculative_round`) that both loops run, and one implementation of each of its
steps: the batch-1 loop and the batched engine call the same functions to plan the round (the same policy, learning
the same way), build the drafter's input block, draft, decide how many drafts to verify, verify, merge the accepted
drafts with the target's token, stop, count what a stopping round emitted, and propose suffix matches."""

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from factories import prompts, tiny_drafter, tiny_target
from hf_dspark.generation.engine import passes as engine_rounds
from hf_dspark.generation.engine import requests as engine_requests
from hf_dspark.generation.engine import speculative_engine as batched
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.generation.one_prompt import loop as decoding
from hf_dspark.generation.one_prompt import prompt_rows as one_prompt_rows
from hf_dspark.generation.round import drafting, skeleton, stopping, verification
from hf_dspark.models import suffix
from hf_dspark.policy import planner
from hf_dspark.policy.acceptance import SuffixAcceptance
from hf_dspark.policy.planner import RoundPolicy
from hf_dspark.policy.length_rule import DraftLengthRule

# Each step: (the module that defines it, its name), and the modules of both loops that call it by that name.
SHARED_STEPS = {
    "speculative_round": (skeleton, [decoding, batched]),
    "draft_input_block": (drafting, [one_prompt_rows, batched]),
    "draft_block": (drafting, [one_prompt_rows, batched]),
    "verify_drafts": (verification, [skeleton, decoding, batched]),
    "round_tokens": (drafting, [skeleton]),
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
    for module in (decoding, one_prompt_rows, batched, engine_rounds):
        assert not hasattr(module, "RoundPolicy") and not hasattr(module, "SuffixProposer")
    monkeypatch.setattr(RoundPolicy, "__init__", recording)
    target.generate(prompts(1, length=5)[0], assistant_model=drafter, do_sample=False, max_new_tokens=6)
    engine = SpeculativeEngine(target, drafter)
    engine.submit(prompts(1, length=5)[0][0], 6)
    engine.run_until_done()
    assert len(made) == 2 and all(isinstance(m.suffix_acceptance, SuffixAcceptance) for m in made)


def _files_the_round_calls(run) -> set[str]:
    """The hf_dspark files (relative to the package) of every function `round/skeleton.py` calls directly while
    `run()` runs: what a reader follows from the round's skeleton."""
    package = Path(skeleton.__file__).resolve().parents[2]
    home, seen = skeleton.__file__, set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None and frame.f_back.f_code.co_filename == home:
            called = Path(frame.f_code.co_filename).resolve()
            if package in called.parents:
                seen.add(called.relative_to(package).as_posix())

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
def test_a_round_reads_in_six_files_at_either_batch_size(kind):
    """Both loops run the skeleton, which calls into the loop's rows, the drafting cores, the acceptance rule and the
    policy only: with the loop itself, six files at batch 1 and six in the engine."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, kind, block_size=4, suffix_drafting=True)
    drafter.generation_config.dspark_round_planning = False  # every round drafts
    prompt = torch.cat([prompts(1, length=5)[0]] * 2, dim=1)
    shared = {"generation/round/skeleton.py", "generation/round/drafting.py", "generation/round/verification.py",
              "policy/planner.py"}

    batch_one = _files_the_round_calls(
        lambda: target.generate(prompt, assistant_model=drafter, do_sample=True, max_new_tokens=10))
    assert "generation/one_prompt/prompt_rows.py" in batch_one
    assert batch_one <= shared | {"generation/one_prompt/prompt_rows.py"}, batch_one

    def engine_run():
        engine = SpeculativeEngine(target, drafter)
        for row in prompts(2, length=5):
            engine.submit(row[0], 10, do_sample=True)
        engine.run_until_done()

    engine = _files_the_round_calls(engine_run)
    assert "generation/engine/passes.py" in engine
    assert engine <= shared | {"generation/engine/passes.py"}, engine
