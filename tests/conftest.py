"""The fixtures every test may ask for (the target families, the devices the lossless tests run on, the Hub
tokenizer, saved chat models, training data and disks) and the `--drafter-cost-factor` audit. The factories they and
the tests build from are `factories.py`'s."""

import pytest
import torch

from layout_fixtures import write_layout_folders
from saved_chat_models import save_chat_target_and_drafters
from training_helpers import InterruptibleChild, SmallDisk

@pytest.fixture(params=["llama", "qwen3", "gemma3"])
def family(request):
    return request.param


NO_CUDA_REASON = "no CUDA device here; the cuda variants run where one is (bash benchmarks/gpu/check.sh)"
DEVICES = [
    pytest.param("cpu", id="cpu"),
    # Skipped at collection, so a machine without a GPU runs exactly the CPU tests it always ran.
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Where a lossless test's target, drafter and inputs live: the CPU always, and CUDA too when one is present.
    Tests build their models on the CPU (the same seeded weights everywhere) and move them here."""
    return torch.device(request.param)


def pytest_addoption(parser):
    parser.addoption(
        "--drafter-cost-factor", type=float, default=None,
        help="audit: multiply every drafter pass's measured seconds by this factor before the round planner learns "
             "them (50: a machine where drafting never pays; 0.02: one where it always does). A test whose verdict "
             "changes under it depends on this machine's speed, which no test may.")


@pytest.fixture(autouse=True)
def _skewed_drafter_costs(request, monkeypatch):
    """Skews what the loop measures: a drafter pass timed by the real clock. Prices a test gives (`record_draft`
    called directly, a simulated clock) are the test's own and stay as given."""
    factor = request.config.getoption("--drafter-cost-factor")
    if factor is not None and request.node.get_closest_marker("synthetic_timings") is None:
        import time
        from hf_dspark.policy.planner import RoundPolicy
        recorded = RoundPolicy.record

        def skewed(self, plan, request_ids, lengths, accepted, width, verification_started, *args, **kwargs):
            if self.clock is time.perf_counter:  # the drafter's pass ran from the round's start to verification's
                self._started = verification_started - (verification_started - self._started) * factor
            return recorded(self, plan, request_ids, lengths, accepted, width, verification_started, *args, **kwargs)
        monkeypatch.setattr(RoundPolicy, "record", skewed)
    yield


@pytest.fixture
def small_disk(tmp_path):
    """Makes `SmallDisk`s under tmp_path (name, size in bytes), unmounted after the test."""
    disks = []

    def make(name: str, size: int) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / name, size))
        return disks[-1]

    yield make
    for disk in disks:
        disk.close()


@pytest.fixture
def interruptible_child(tmp_path):
    """An `InterruptibleChild`, killed after the test if it still runs."""
    child = InterruptibleChild(tmp_path)
    yield child
    child.close()


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer, from the embedded default target (materialises its cached copy once)."""
    from hf_dspark.targets.default_target import load_default_target

    return load_default_target()[1]


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory, tokenizer):
    """A tiny chat target and a DSpark drafter for it saved to disk (`target/`, `drafter/`), for the CLI tests."""
    return save_chat_target_and_drafters(tmp_path_factory.mktemp("pair"), tokenizer, {"drafter": "markov"})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny, loadable drafter folder in each layout hf_dspark reads."""
    return write_layout_folders(tmp_path_factory.mktemp("layouts"))
