"""End-to-end drafter training used by `hf-dspark train`: build (or resume) a drafter for a target, assemble
the data, pick a draft vocabulary, train with `DSparkTrainer`, save a safetensors checkpoint."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import ConcatDataset
from transformers import AutoConfig, TrainingArguments

from ..models import (DFlash2DraftConfig, DFlash2DraftModel, DSparkDraftConfig, DSparkDraftModel, Eagle3DraftConfig,
                      Eagle3DraftModel)
from ..models.errors import UserInputError
from ..models.identity import drafter_kind
from ..models.loading import read_saved_config
from .data import Decontaminator, answer_examples, sharegpt_path
from .init import init_context_from_target, init_layers_from_target, init_markov_head_from_bigrams
from .precondition import fold_context_preconditioning, fused_feature_scales, precondition_context_fusion
from .budget import TimeBudgetCallback
from .checkpoints import newest_complete_checkpoint
from .target_cache import TargetCacheDataset
from .trainer import DSparkTrainer, RegeneratedDataset, frozen_target_states, most_frequent_tokens


class ExampleList(torch.utils.data.Dataset):
    """Training examples held in memory (dicts of `input_ids` and `loss_mask`), as a map-style dataset."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def build_drafter(kind: str, target, *, num_layers: int, block_size: int, markov_rank: int,
                  draft_vocab_size: int | None, target_layer_ids: list[int] | None, qk_norm: bool = True,
                  suffix_drafting: bool = True, sample_from_anchor: bool = True):
    """A fresh drafter for `target`. q/k norms are on by default (what vLLM, SGLang and llama.cpp serve, whatever
    the target's family), and the saved config turns suffix drafting on for whoever loads it. A block drafter with
    `sample_from_anchor` False drafts from slot 1 (slot j predicts anchor + j), as z-lab's layout requires."""
    overrides = {"block_size": block_size, "draft_vocab_size": draft_vocab_size, "qk_norm": qk_norm,
                 "suffix_drafting": suffix_drafting}
    if not sample_from_anchor:
        if kind == "eagle3":
            raise UserInputError("--no-sample-from-anchor is a block drafter's slot convention; Eagle3 drafts a chain")
        overrides["sample_from_anchor"] = False
    if target_layer_ids:
        overrides["target_layer_ids"] = target_layer_ids
    if kind == "eagle3":
        return Eagle3DraftModel(Eagle3DraftConfig.from_target_config(target.config, num_hidden_layers=num_layers,
                                                                     **overrides))
    if kind == "dflash":
        config = DSparkDraftConfig.dflash_from_target_config(target.config, num_hidden_layers=num_layers, **overrides)
    elif kind == "dflash2":
        return DFlash2DraftModel(DFlash2DraftConfig.from_target_config(target.config, num_hidden_layers=num_layers,
                                                                       **overrides))
    else:
        config = DSparkDraftConfig.from_target_config(target.config, num_hidden_layers=num_layers,
                                                      markov_head=kind if kind != "dspark" else "markov",
                                                      markov_rank=markov_rank, confidence_head=True, **overrides)
    return DSparkDraftModel(config)


def _with_qk_norms(drafter):
    """The same drafter with per-head q/k RMSNorms (weights 1) in every attention layer; every other weight,
    including the draft vocabulary, and its drafting defaults are carried over."""
    config = drafter.config.__class__.from_dict({**drafter.config.to_dict(), "qk_norm": True})
    widened = drafter.__class__(config)
    missing, unexpected = widened.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any(not name.endswith(("q_norm.weight", "k_norm.weight")) for name in missing):
        raise ValueError(f"adding q/k norms changed more than the norms: missing {missing}, unexpected {unexpected}")
    widened.generation_config = drafter.generation_config  # the drafting defaults it was saved with
    return widened.to(drafter.dtype)


def continue_drafter(kind: str, path: str, target, qk_norm: bool = False):
    """The drafter saved at `path`, in float32 on the target's device, ready to train further. With `qk_norm` a
    drafter saved without q/k norms gains them (weights 1, learnt from there), so it can be exported for serving;
    norms a drafter already has are never removed."""
    read_saved_config(path, "drafter")  # a missing or broken folder is named before transformers tries the Hub
    found = drafter_kind(AutoConfig.from_pretrained(path))
    if found != (kind if kind in ("dflash", "dflash2", "eagle3") else "dspark"):
        raise UserInputError(f"--init-from {path} holds a {found or 'non-drafter'} checkpoint, not a {kind} drafter; "
                             f"pass a {kind} drafter or the --kind it is.")
    model_class = {"eagle3": Eagle3DraftModel, "dflash2": DFlash2DraftModel}.get(kind, DSparkDraftModel)
    drafter = model_class.from_pretrained(path)
    if qk_norm and not drafter.config.qk_norm:
        drafter = _with_qk_norms(drafter)
        print(f"--init-from {path}: added q/k norms (weights 1, trained from here) to a drafter saved without them")
    drafter = drafter.float().to(target.device)  # trained in float32 whatever the target's dtype, on its device
    drafter.attach_target(target, follow=False)
    return drafter.train()


def _check_training_device(trainer_device: torch.device, target_device: torch.device) -> None:
    """The Trainer runs the drafter (and feeds the batches) on its own device; the target must be there too."""
    if (trainer_device.type, trainer_device.index or 0) != (target_device.type, target_device.index or 0):
        raise UserInputError(
            f"the target is on {target_device} but training runs on {trainer_device} (the Trainer's device: the "
            "first visible accelerator, or this process's under a launcher). Load the target there "
            f"(--device {trainer_device}), or make {target_device} the visible one (e.g. CUDA_VISIBLE_DEVICES)."
        )


def assemble_dataset(tokenizer, regenerated: list[str], dataset_answers: int, max_length: int):
    parts = [RegeneratedDataset(path, max_length=max_length) for path in regenerated]
    if dataset_answers:
        examples = answer_examples(tokenizer, [sharegpt_path()], max_length=max_length, limit=dataset_answers,
                                   decontaminator=Decontaminator.from_benchmarks())
        parts.append(ExampleList(examples))
    if not parts:
        raise UserInputError("no training data: pass --data DIR (regenerated shards) and/or --dataset-answers N")
    return ConcatDataset(parts) if len(parts) > 1 else parts[0]


def answer_token_counts(dataset, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index in range(len(dataset)):
        example = dataset[index]
        answer = torch.as_tensor(example["input_ids"], dtype=torch.long)[torch.as_tensor(example["loss_mask"]) > 0]
        counts += torch.bincount(answer, minlength=vocab_size)
    return counts


def _fused_features(drafter, target, example) -> torch.Tensor:
    """An example's concatenated target features, as `fc` reads them: from the cache, or from the target."""
    if "target_features" in example:
        return example["target_features"]
    ids = torch.as_tensor(example["input_ids"], dtype=torch.long, device=target.device)[None]
    features, _ = frozen_target_states(target, ids, None, drafter.target_hidden_state_indices,
                                       target.config.get_text_config().num_hidden_layers)
    return features[0].cpu()


def train_drafter(target, tokenizer, *, kind: str, output_dir: str, regenerated: list[str], dataset_answers: int,
                  cache: str | list[str] | None = None, max_seconds: float | None = None, num_layers: int, block_size: int, markov_rank: int, draft_vocab_size: int | None,
                  target_layer_ids: list[int] | None, init_from_target: list[int] | None, max_length: int,
                  batch_size: int, num_anchors: int, learning_rate: float, max_steps: int, save_steps: int,
                  warmup_ratio: float, seed: int, resume: bool, loss_weights: dict | None = None,
                  init_context: bool = False, init_markov_bigrams: bool = False, init_from: str | None = None,
                  qk_norm: bool = True, precondition_fusion: bool = True, sample_from_anchor: bool = True) -> dict:
    torch.manual_seed(seed)
    output = Path(output_dir)
    if init_from:
        # Continue a trained drafter under a new budget: its config (layers, draft vocabulary) wins over the flags.
        drafter = continue_drafter(kind, init_from, target, qk_norm=qk_norm)
        draft_vocab_size, init_from_target, init_markov_bigrams = None, None, False
    else:
        drafter = build_drafter(kind, target, num_layers=num_layers, block_size=block_size, markov_rank=markov_rank,
                                draft_vocab_size=draft_vocab_size, target_layer_ids=target_layer_ids,
                                qk_norm=qk_norm, sample_from_anchor=sample_from_anchor)
    if cache:
        # Several folders train as one dataset: data regenerated later is cached on its own, never recached.
        folders = [cache] if isinstance(cache, (str, Path)) else list(cache)
        parts = [TargetCacheDataset(folder, layer_ids=drafter.config.target_layer_ids) for folder in folders]
        dataset = ConcatDataset(parts) if len(parts) > 1 else parts[0]
    else:
        dataset = assemble_dataset(tokenizer, regenerated, dataset_answers, max_length)
    if draft_vocab_size:
        counts = answer_token_counts(dataset, target.config.vocab_size)
        drafter.set_draft_vocab(most_frequent_tokens(counts, draft_vocab_size, always=[tokenizer.eos_token_id]))
    if init_from_target:
        init_layers_from_target(drafter, target, init_from_target)
        if init_context:
            init_context_from_target(drafter, target, init_from_target[0])
    if init_markov_bigrams:
        init_markov_head_from_bigrams(drafter, dataset)
    if precondition_fusion and not init_context:  # a fusion started as a target layer's output is already scaled
        scales = fused_feature_scales(dataset, lambda example: _fused_features(drafter, target, example))
        precondition_context_fusion(drafter, scales, fresh=init_from is None)
    warmup_steps = max(1, int(warmup_ratio * max_steps))
    # The newest checkpoint a resume can read, by its explicit path: transformers' own choice (the newest folder
    # by name) fails for good on one that an interrupted save left half written.
    checkpoint = newest_complete_checkpoint(output / "trainer") if resume else None
    if checkpoint is not None:
        print(f"resuming from {checkpoint}", file=sys.stderr)
    callbacks = []
    if max_seconds:
        spent = TimeBudgetCallback.spent_seconds(checkpoint) if checkpoint is not None else 0.0
        callbacks.append(TimeBudgetCallback(max_seconds, warmup_steps=warmup_steps, elapsed=spent))
    args = TrainingArguments(
        output_dir=str(output / "trainer"), per_device_train_batch_size=batch_size, max_steps=max_steps,
        learning_rate=learning_rate, warmup_steps=0 if max_seconds else warmup_steps,
        lr_scheduler_type="constant" if max_seconds else "cosine", weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=10, save_strategy="steps", save_steps=save_steps, save_total_limit=2,
        report_to=[], use_cpu=target.device.type == "cpu", seed=seed, dataloader_num_workers=0,
    )
    _check_training_device(args.device, target.device)
    trainer = DSparkTrainer(model=drafter, target=target, args=args, train_dataset=dataset, num_anchors=num_anchors,
                            callbacks=callbacks, **(loss_weights or {}))
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    seconds = time.perf_counter() - started
    fold_context_preconditioning(drafter)
    drafter.save_pretrained(output)
    summary = {"kind": kind, "examples": len(dataset), "steps": trainer.state.global_step, "train_seconds": seconds,
               "budget_seconds": callbacks[0].elapsed if callbacks else None,
               "answer_tokens": int(sum(sum(dataset[i]["loss_mask"]) for i in range(len(dataset))))}
    (output / "training_summary.json").write_text(json.dumps(summary, indent=2))
    with open(output / "training_log.jsonl", "w") as handle:
        for entry in trainer.state.log_history:
            handle.write(json.dumps(entry) + "\n")
    return summary
