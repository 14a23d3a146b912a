"""Shared by the tests of the layouts published since DeepSpec (SpecForge, LFM2.5, Kimi K3, target modules): tiny
checkpoints written with the publishers' field and tensor names, a target whose next token a Markov head can
predict (so that decoding accepts drafts), and the greedy-identity check."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config
from safetensors.torch import save_file

from hf_dspark import DraftContextCache
from hf_dspark.hub.convert import export_deepspec
from hf_dspark.hub.export_speculators import export_speculators
from factories import tiny_drafter, tiny_target


def write_checkpoint(folder: Path, config: dict, tensors: dict) -> Path:
    """config.json and model.safetensors, as the publishers' save_pretrained writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def random_tensors(shapes: dict, seed: int) -> dict:
    """Seeded weights of unit-scale activations: 1-d `*norm*` weights near 1, biases small, matrices 1/sqrt(fan-in)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator)
        if len(shape) == 1 and "norm" in name:
            tensors[name] = 1 + 0.2 * noise
        elif name.endswith("bias"):
            tensors[name] = 0.1 * noise
        elif "markov_w1" in name or "embed" in name:
            tensors[name] = noise
        else:
            tensors[name] = noise / math.sqrt(shape[-1])
    return tensors


def bigram_target(vocab: int, hidden: int, layers: int, seed: int = 0, **overrides):
    """A tiny Qwen3 target whose layers barely change its input (attention and MLP outputs scaled down), so its next
    token is nearly a function of the current one; every logit still depends on the context."""
    target = tiny_target("qwen3", vocab_size=vocab, seed=seed, hidden_size=hidden, num_hidden_layers=layers,
                         **overrides)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(0.02)
    return target


def agreeing_markov_head(target, scale: float = 60.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(W1, W2) of a rank-vocab vanilla Markov head whose bias after token x is the target's bigram logits after x,
    shifted so their best token gets 0 and scaled: a drafter with it drafts the target's likely next token."""
    final_norm = getattr(target.model, "norm", None) or target.model.embedding_norm  # LFM2 names it so
    with torch.no_grad():
        embeddings = target.get_input_embeddings().weight
        bigram = target.lm_head(final_norm(embeddings))  # (vocab, vocab): logits after each token
        bias = scale * (bigram - bigram.max(dim=-1, keepdim=True).values) / bigram.std()
    vocab = embeddings.shape[0]
    return torch.eye(vocab), bias.T.contiguous()  # markov_w1 (vocab, rank=vocab), markov_w2 (vocab, rank)


def assert_greedy_identical(target, drafter, prompts, max_new_tokens: int = 24) -> int:
    """`generate(assistant_model=drafter)` greedy equals plain greedy for each prompt; the drafts accepted in all."""
    accepted = 0
    for ids in prompts:
        expected = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        got = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens,
                              dspark_round_planning=False)  # every round verifies the layout's drafts
        assert torch.equal(got, expected), (ids, got, expected)
        accepted += sum(drafter.last_generation_stats.accepted)
    return accepted


def assert_batch_greedy_identical(target, drafter, vocab: int, max_new_tokens: int = 16) -> None:
    """The same for two left-padded prompts in one call (the batched engine)."""
    ids = torch.randint(6, vocab, (2, 7), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    got = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=max_new_tokens, dspark_round_planning=False)
    assert torch.equal(got, expected), (got, expected)


def assert_cache_context_matches_forward(drafter, features: torch.Tensor) -> None:
    """`cache_context` (what a server runs when rows join) appends exactly the keys and values a drafting pass
    appends for the same context rows, at explicit positions with gaps as a batch with holes has them, and a block
    drafted over either cache comes out the same."""
    rows, length = features.shape[:2]
    positions = torch.arange(length)[None].repeat(rows, 1) + 3 * torch.arange(rows)[:, None]
    block = torch.full((rows, 1), drafter.config.mask_token_id)
    with torch.no_grad():
        drafted, only = DraftContextCache(), DraftContextCache()
        drafter(input_ids=block, target_hidden_states=features, position_ids=positions[:, -1:] + 1,
                context_position_ids=positions, cache=drafted)
        drafter.cache_context(features, positions, only)
        assert len(only.keys) == len(drafted.keys) == len(drafter.layers)
        for mine, theirs in zip(only.keys + only.values, drafted.keys + drafted.values):
            assert torch.equal(mine, theirs)
        follow = torch.full((rows, 3), drafter.config.mask_token_id)
        follow_positions = positions[:, -1:] + 1 + torch.arange(3)
        after_drafting = drafter(input_ids=follow, position_ids=follow_positions, cache=drafted).base_logits
        after_caching = drafter(input_ids=follow, position_ids=follow_positions, cache=only).base_logits
    assert torch.equal(after_drafting, after_caching)


def zlab_folder(folder):
    """A z-lab DFlash drafter saved by z-lab's own class (skips where the `dflash` package is missing)."""
    dflash = pytest.importorskip("dflash")
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         num_target_layers=4, architectures=["DFlashDraftModel"],
                         dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 2], "block_size": 4})
    dflash.DFlashDraftModel(config).eval().save_pretrained(folder)  # z-lab's own class and save


def write_layout_folders(root):
    """A tiny, loadable drafter folder in each layout hf_dspark reads (`LAYOUTS` of test_config_validation), under
    `root`; returns `root`."""
    target = tiny_target("qwen3")
    dspark, eagle3 = tiny_drafter(target, "markov"), tiny_drafter(target, "eagle3")
    dspark.save_pretrained(root / "own_dspark")
    eagle3.save_pretrained(root / "own_eagle3")
    export_deepspec(dspark, root / "deepspec_dspark")
    export_deepspec(tiny_drafter(target, "eagle3", target_layer_ids=[0, 1, 2]), root / "deepspec_eagle3",
                    target=target)  # with the stored embedding and LM head DeepSpec keeps
    export_speculators(dspark, root / "speculators_dspark")
    export_speculators(eagle3, root / "speculators_eagle3", target=target)
    zlab_folder(root / "zlab")
    return root
