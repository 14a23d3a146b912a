"""On a transformers release whose cache cannot keep the state after each verified token (before 5.25.0), a hybrid
target is refused before any forward, naming the release and the upgrade, at batch 1 and in the engine. Run on
every release: on newer ones the missing support is simulated."""

import pytest
import transformers

import hf_dspark.transformers_internals.recurrent_states as recurrent_states
from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine
from hf_dspark.models.errors import UserInputError
from factories import prompts, tiny_drafter, tiny_target
from batch_helpers import left_pad


@pytest.fixture
def without_per_position_states(monkeypatch):
    if recurrent_states.keeps_states_per_position():
        monkeypatch.setattr(recurrent_states, "keeps_states_per_position", lambda: False)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_a_hybrid_target_is_refused_naming_the_release(without_per_position_states, family):
    target = tiny_target(family)
    drafter = tiny_drafter(target, "markov")
    forwards = []
    target.register_forward_hook(lambda *args: forwards.append(1))
    message = f"transformers {transformers.__version__}.*transformers>=5.25.0"
    (prompt,) = prompts(1)
    # transformers before 5.25 refuses stateful targets (Qwen3.5) for assisted generation itself, first.
    with pytest.raises((UserInputError, ValueError), match=f"{message}|not supported with stateful models"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    with pytest.raises(UserInputError, match=message):
        SpeculativeEngine(target, drafter)
    ids, mask = left_pad(prompts(2))
    with pytest.raises((UserInputError, ValueError), match=f"{message}|not supported with stateful models"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert forwards == []
