"""A tiny random chat target and drafters saved to disk with a real tokenizer, for the command-line tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from factories import tiny_drafter


def tiny_chat_target(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def save_chat_target_and_drafters(folder, tokenizer, drafters: dict[str, str]):
    """Save the target (with `tokenizer`) under `folder/target` and one drafter per `{subfolder: kind}` (block 4,
    a 512-token draft vocabulary) under `folder/subfolder`; returns `folder`."""
    target = tiny_chat_target(tokenizer)
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    for subfolder, kind in drafters.items():
        drafter = tiny_drafter(target, kind, block_size=4, draft_vocab_size=512)
        drafter.set_draft_vocab(torch.arange(512))
        drafter.save_pretrained(folder / subfolder)
    return folder


def default_tokenizer():
    """SmolLM2's tokenizer from the embedded target's cached copy (materialised once)."""
    from transformers import AutoTokenizer

    from hf_dspark.targets.default_target import default_target_dir, load_default_target

    if not (default_target_dir() / "tokenizer.json").is_file():
        load_default_target()
    return AutoTokenizer.from_pretrained(default_target_dir())


def save_chat_target(folder):
    """A tiny chat target with SmolLM2's tokenizer saved in `folder`; returns the target."""
    tokenizer = default_tokenizer()
    target = tiny_chat_target(tokenizer)
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return target
