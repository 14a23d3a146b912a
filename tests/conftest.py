"""Tiny randomly initialised targets of three families (and two hybrid ones) and drafters for them (float32 for exact
identity), and the devices the lossless tests run on."""

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Lfm2Config, Lfm2ForCausalLM,
                          Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM)

import hf_dspark

VOCAB = 96


def tiny_target(family: str, vocab_size: int = VOCAB, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        initializer_range=0.2,
    )
    common.update(overrides)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif family == "gemma3":
        config = Gemma3TextConfig(
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            **common,
        )
        model = Gemma3ForCausalLM(config)
    elif family == "qwen3_5":  # hybrid: gated DeltaNet (recurrent + convolution state) and full attention layers
        config = Qwen3_5TextConfig(
            head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, **common,
        )
        model = Qwen3_5ForCausalLM(config)
    elif family == "lfm2":  # hybrid: short convolutions (convolution state) and full attention layers
        model = Lfm2ForCausalLM(Lfm2Config(layer_types=["conv", "full_attention", "conv", "full_attention"],
                                           conv_L_cache=3, **common))
    else:
        raise ValueError(family)
    return model.eval()


def tiny_drafter(target, kind: str = "markov", block_size: int = 4, seed: int = 1, **overrides):
    """kind: markov | gated | rnn | dflash | dflash2 | eagle3."""
    torch.manual_seed(seed)
    if kind == "eagle3":
        config = hf_dspark.Eagle3DraftConfig.from_target_config(target.config, block_size=block_size, **overrides)
        return hf_dspark.Eagle3DraftModel(config).eval()
    if kind == "dflash2":
        # 3 candidates per slot: fewer than even the 6-token vocabulary of the sampling tests, so the selector's q
        # leaves tokens out and rejection sampling must produce them from the residual.
        overrides = {"selector_rank": 8, "selector_top_k": 3, "conv_kernel_size": 3, **overrides}
        config = hf_dspark.DFlash2DraftConfig.from_target_config(target.config, num_hidden_layers=2,
                                                                 block_size=block_size, **overrides)
        return hf_dspark.DFlash2DraftModel(config).eval()
    if kind == "dflash":
        config = hf_dspark.build_dflash_config(target.config, num_hidden_layers=2, block_size=block_size, **overrides)
    else:
        overrides.setdefault("confidence_head", True)
        config = hf_dspark.DSparkDraftConfig.from_target_config(
            target.config, num_hidden_layers=2, block_size=block_size, markov_head=kind, markov_rank=16, **overrides
        )
    return hf_dspark.DSparkDraftModel(config).eval()


def hub_snapshot(cache, repo_id: str, folder, linked=None):
    """`folder` laid out as huggingface_hub caches `repo_id`: the files named in `linked` (every file: None) stored
    in the repo's blobs/ with a snapshot link to each, the others copied into the snapshot. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        if file.is_file() and (linked is None or file.name in linked):
            (repo / "blobs" / file.name).write_bytes(file.read_bytes())
            (snapshot / file.name).symlink_to(f"../../blobs/{file.name}")
        elif file.is_file():
            (snapshot / file.name).write_bytes(file.read_bytes())
    return snapshot


def prompts(count: int, length: int = 6, vocab_size: int = VOCAB, seed: int = 123, device="cpu"):
    """Drawn on the CPU from `seed` (the same prompts on every device), then moved to `device`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (1, length + i % 3), generator=generator).to(device) for i in range(count)]


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
