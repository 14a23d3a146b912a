"""A tiny random chat target and drafters saved to disk with a real tokenizer, for the command-line tests."""

import torch

from conftest import tiny_drafter
from test_regeneration import tiny_chat_target


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
