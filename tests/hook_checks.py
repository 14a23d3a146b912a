"""Running a `generate()` call with and without `import hf_dspark`'s wrappers (stock transformers either way
unless the call is ours), and what the call did."""

from transformers.generation.utils import GenerationMixin

from hf_dspark.generation.routing import integration
from hf_dspark.transformers_internals.generate_hooks import stock_method


def with_and_without_hf_dspark(monkeypatch, call) -> tuple[tuple, tuple]:
    """(`call`'s outcome with `import hf_dspark`'s generate() wrappers bypassed, i.e. stock transformers, and its
    outcome with them). A test about stock behaviour holds the wrappers to changing nothing, and blames
    transformers only for what it does on its own."""
    with monkeypatch.context() as patched:
        for name in integration._ROUTING_WRAPPERS:
            patched.setattr(GenerationMixin, name, stock(name))
        assert all(getattr(GenerationMixin, name) is stock(name) for name in integration._ROUTING_WRAPPERS)
        stock_outcome = outcome(call)
    assert all(getattr(GenerationMixin, name) is not stock(name) for name in integration._ROUTING_WRAPPERS)
    return stock_outcome, outcome(call)


def stock(name: str):
    """The transformers method itself, wrapped by `import hf_dspark` or not."""
    return stock_method(GenerationMixin, name)


def outcome(call) -> tuple:
    """What a generate() call did: ("tokens", ids) or ("raised", exception type, message)."""
    try:
        return "tokens", call().tolist()
    except Exception as error:  # noqa: BLE001  (compared, not handled)
        return "raised", type(error).__name__, str(error)
