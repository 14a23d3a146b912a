"""Tiny randomly initialised targets of three families (and two hybrid ones), drafters for them (float32 for exact
identity), prompts and Hub cache snapshots: the factories every test folder imports (`from factories import ...`).
Fixtures live in `conftest.py`."""

from hf_dspark.policy.acceptance import SlotAcceptance, SuffixAcceptance
from hf_dspark.policy.costs import CostModel

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


def priced(forward, draft=0.0, rows=range(1, 5), widths=range(1, 9)) -> CostModel:
    """A cost model that keeps these prices: `forward(rows, width)` seconds, `draft` seconds per row."""
    costs = CostModel(learn=False)
    costs.forwards.update({(r, w): forward(r, w) for r in rows for w in widths})
    costs.drafts.update({r: draft * r for r in rows})
    return costs


def promising_suffix(rate: float = 0.9, count: float = 20.0, slots: int = 8) -> SuffixAcceptance:
    """Suffix statistics as if every match length's proposals had had each token accepted at `rate`, `count` times
    (where a test wants suffix matches to start out promising)."""
    return SuffixAcceptance({match: SlotAcceptance([count] * slots, [rate * count] * slots) for match in range(1, 9)})
