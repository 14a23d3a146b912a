"""Sharing across threads: one drafter used by generate() calls from two threads (with targets of different dtypes,
so the drafter must be cast for one of them, or for both), and a `SpeculativeEngine` stepped by one thread while
another submits and cancels requests. Events force the interleavings that broke (a call in one dtype inside another
call's, a cancel inside a step), so the tests do not depend on timing; every output must equal plain greedy
decoding of its prompt alone."""

import random
import threading

import pytest
import torch

import hf_dspark.generation.engine.passes as engine_rounds
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.models.modeling_dspark import DSparkDecoderLayer
from factories import prompts, tiny_drafter, tiny_target

MAX_NEW = 10
TIMEOUT = 120  # seconds any thread may wait for another before the test fails instead of hanging
EVERY_ROUND_DRAFTS = dict(dspark_round_planning=False, dspark_suffix_drafting=False)


def run_threads(*workers):
    """Run each worker in its own thread; re-raise the first exception any of them raised."""
    errors = []

    def guarded(work):
        def run():
            try:
                work()
            except BaseException as error:  # noqa: BLE001 -- reported in the test's thread
                errors.append(error)
        return run

    threads = [threading.Thread(target=guarded(work), name=f"worker-{i}", daemon=True)
               for i, work in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]


def plain(target, prompt, max_new_tokens=MAX_NEW):
    return target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)


def speculative(target, drafter, prompt, **kwargs):
    return target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW,
                           **EVERY_ROUND_DRAFTS, **kwargs)


def own_weights(drafter):
    return {name: value.clone() for name, value in drafter.state_dict().items()}


def assert_weights_unchanged(drafter, before):
    for name, value in drafter.state_dict().items():
        assert value.dtype == before[name].dtype and torch.equal(value, before[name]), name


# ---------------------------------------------------------------------------------------------------------
# One drafter, generate() from two threads
# ---------------------------------------------------------------------------------------------------------


def drafter_and_targets(stored_dtype, target_dtypes):
    base = tiny_target("llama")
    drafter = tiny_drafter(base, "markov").to(stored_dtype)
    return drafter, [tiny_target("llama").to(dtype) for dtype in target_dtypes]


@pytest.mark.parametrize("stored_dtype, target_dtypes", [
    (torch.float32, (torch.float64, torch.float32)),  # only the paused call's drafter is cast
    (torch.bfloat16, (torch.float32, torch.float32)),  # both calls cast a bfloat16-stored drafter
], ids=["float32-drafter", "bfloat16-drafter"])
def test_a_call_inside_another_calls_drafting_changes_nothing_it_reads(monkeypatch, stored_dtype, target_dtypes):
    """The first thread pauses inside its first drafter pass (between the context fusion and the first layer);
    the second runs whole calls meanwhile. A call that casts the shared drafter in place (and restores it when it
    returns) would change the weights of the paused pass under it."""
    drafter, (paused_target, other_target) = drafter_and_targets(stored_dtype, target_dtypes)
    before = own_weights(drafter)
    prompt = prompts(1)[0]
    expected = {id(t): plain(t, prompt) for t in (paused_target, other_target)}
    paused, resume = threading.Event(), threading.Event()
    original = DSparkDecoderLayer.forward

    def forward(self, *args, **kwargs):
        if threading.current_thread().name == "worker-0" and not paused.is_set():
            paused.set()
            assert resume.wait(TIMEOUT)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DSparkDecoderLayer, "forward", forward)
    results = {}

    def paused_call():
        results["paused"] = speculative(paused_target, drafter, prompt)

    def other_calls():
        try:
            assert paused.wait(TIMEOUT)
            results["other"] = [speculative(other_target, drafter, prompt) for _ in range(2)]
        finally:
            resume.set()

    run_threads(paused_call, other_calls)
    assert torch.equal(results["paused"], expected[id(paused_target)])
    assert all(torch.equal(out, expected[id(other_target)]) for out in results["other"])
    assert_weights_unchanged(drafter, before)  # the drafter keeps its own dtype and weights, bit for bit


@pytest.mark.parametrize("stored_dtype, target_dtypes", [
    (torch.float32, (torch.float32, torch.float64)),
    (torch.bfloat16, (torch.float32, torch.float32)),
], ids=["float32-and-float64-targets", "bfloat16-drafter"])
def test_two_threads_share_one_drafter_for_many_calls(stored_dtype, target_dtypes):
    drafter, targets = drafter_and_targets(stored_dtype, target_dtypes)
    before = own_weights(drafter)
    prompt_list = prompts(3)
    same_length = torch.cat([prompt_list[0], torch.randint(2, 96, prompt_list[0].shape,
                                                          generator=torch.Generator().manual_seed(4))])
    expected = {id(t): [plain(t, p) for p in prompt_list] for t in targets}
    expected_batch = {id(t): torch.cat([plain(t, row[None]) for row in same_length]) for t in targets}

    def calls(target):
        def work():
            for _ in range(3):
                for prompt, reference in zip(prompt_list, expected[id(target)]):
                    assert torch.equal(speculative(target, drafter, prompt), reference)
                # Several prompts go to the batched engine, with this call's own drafter too.
                batch = speculative(target, drafter, same_length, attention_mask=torch.ones_like(same_length))
                assert torch.equal(batch, expected_batch[id(target)])
        return work

    run_threads(*(calls(target) for target in targets))
    assert_weights_unchanged(drafter, before)


def test_a_cast_copy_is_made_once_and_no_copy_when_none_is_needed():
    drafter, (same, wider) = drafter_and_targets(torch.float32, (torch.float32, torch.float64))
    own = [param.data_ptr() for param in drafter.parameters()]
    view = drafter.for_target(same)
    assert [param.data_ptr() for param in view.parameters()] == own  # the drafter's own weights, not a copy
    assert view.target_heads.lm_head is same.lm_head and drafter.target_heads.lm_head is same.lm_head
    first, second = drafter.for_target(wider), drafter.for_target(wider)
    assert {param.dtype for param in first.parameters()} == {torch.float64}
    assert [p.data_ptr() for p in first.parameters()] == [p.data_ptr() for p in second.parameters()]  # reused
    assert first is not second and first.target_heads.lm_head is wider.lm_head
    assert drafter.dtype == torch.float32 and [param.data_ptr() for param in drafter.parameters()] == own
    with torch.no_grad():
        next(drafter.parameters()).add_(1.0)  # the drafter's own weights changed: the copy is made again
    again = drafter.for_target(wider)
    assert torch.equal(next(again.parameters()), next(drafter.parameters()).double())


# ---------------------------------------------------------------------------------------------------------
# One engine, stepped by one thread while another submits and cancels
# ---------------------------------------------------------------------------------------------------------


class RaceInsideStep:
    """Patches the target forward a step runs so that, when armed, it waits inside the step until the other thread
    has submitted a request (which must not wait for the step) and, for a while, for its cancel to return (which
    must wait for the step)."""

    def __init__(self, monkeypatch):
        self.armed, self.inside, self.submitted, self.cancelled = (threading.Event() for _ in range(4))
        self.cancel_returned_inside = []
        original = engine_rounds.target_forward

        def forward(*args, **kwargs):
            if self.armed.is_set() and threading.current_thread() is threading.main_thread():
                self.armed.clear()
                self.inside.set()
                assert self.submitted.wait(TIMEOUT), "submit() waited for the running step"
                self.cancel_returned_inside.append(self.cancelled.wait(0.5))
            return original(*args, **kwargs)

        monkeypatch.setattr(engine_rounds, "target_forward", forward)


def test_submit_and_cancel_from_another_thread_never_cost_the_other_requests(monkeypatch):
    target = tiny_target("llama")
    engine = SpeculativeEngine(target, tiny_drafter(target, "markov", block_size=4))
    prompt_list = prompts(14)
    lengths = [MAX_NEW + (i % 4) * 2 for i in range(len(prompt_list))]
    expected = [plain(target, p, n)[0] for p, n in zip(prompt_list, lengths)]
    submitted = {engine.submit(prompt_list[i][0], lengths[i]): i for i in range(6)}
    outputs, cancelled = dict(engine.step()), {}
    race = RaceInsideStep(monkeypatch)
    # Forced: a submit and a cancel land inside a step. The cancelled request is running, or the one just
    # submitted (still posted, not yet waiting), or running again.
    for next_prompt, cancel_the_new_one in ((6, False), (7, True), (8, False)):
        live = [r for r in submitted if r not in outputs and r not in cancelled]

        def submit_and_cancel():
            assert race.inside.wait(TIMEOUT)
            new = engine.submit(prompt_list[next_prompt][0], lengths[next_prompt])
            submitted[new] = next_prompt
            race.submitted.set()
            victim = new if cancel_the_new_one else live[next_prompt % len(live)]
            cancelled[victim] = engine.cancel(victim)
            race.cancelled.set()

        for event in (race.inside, race.submitted, race.cancelled):
            event.clear()
        race.armed.set()
        other = threading.Thread(target=submit_and_cancel, daemon=True)
        other.start()
        outputs.update(engine.step())  # must not raise: the cancel waits for it
        other.join(TIMEOUT)
        assert not other.is_alive() and race.cancelled.is_set()
    assert race.cancel_returned_inside == [False] * 3  # each cancel took effect after the step it arrived in

    # Unforced: submits and cancels at random moments while this thread steps.
    rng = random.Random(0)

    def random_traffic():
        for index in range(9, len(prompt_list)):
            threading.Event().wait(rng.uniform(0.0, 0.05))
            submitted[engine.submit(prompt_list[index][0], lengths[index])] = index
            live = [r for r in submitted if r not in outputs and r not in cancelled]
            if rng.random() < 0.5 and live:
                victim = rng.choice(live)
                try:
                    cancelled[victim] = engine.cancel(victim)
                except KeyError:  # it finished first: its output went to the stepping thread
                    pass

    other = threading.Thread(target=random_traffic, daemon=True)
    other.start()
    while other.is_alive():
        outputs.update(engine.step())
    other.join()
    outputs.update(engine.run_until_done())
    # The engine keeps serving.
    again = engine.submit(prompt_list[0][0], lengths[0])
    assert torch.equal(engine.run_until_done()[again], expected[0])

    assert sorted(outputs.keys() | cancelled.keys()) == sorted(submitted)
    for request_id, index in submitted.items():
        if request_id in cancelled:  # its tokens so far: a prefix of its own greedy output
            tokens = cancelled[request_id]
            assert torch.equal(tokens, expected[index][: tokens.shape[0]]), request_id
        else:
            assert torch.equal(outputs[request_id], expected[index]), request_id


def test_cancel_from_inside_a_step_is_refused_and_the_step_undone(monkeypatch):
    target = tiny_target("llama")
    engine = SpeculativeEngine(target, tiny_drafter(target, "markov", block_size=4))
    prompt_list = prompts(2)
    ids = [engine.submit(p[0], MAX_NEW) for p in prompt_list]
    original = engine_rounds.target_forward
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            engine.cancel(ids[0])  # code a step runs, in the stepping thread: refused, not a deadlock
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_rounds, "target_forward", forward)
    with pytest.raises(RuntimeError, match="from inside a step"):
        engine.step()
    monkeypatch.setattr(engine_rounds, "target_forward", original)
    outputs = engine.run_until_done()
    assert all(torch.equal(outputs[r], plain(target, p)[0]) for r, p in zip(ids, prompt_list))
