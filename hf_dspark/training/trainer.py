"""`DSparkTrainer`: online distillation of DSpark / DFlash / DFlash 2 / Eagle3 drafters against a frozen target.

By default every step runs the frozen target once over the batch (online distillation: no cache needed); with a
`TargetCacheDataset` the target's outputs come from disk instead and the target never runs. It samples anchors
inside the answers and trains the drafter on packed blocks (DSpark/DFlash) or on unrolled training-time-test steps
(Eagle3). Only drafter parameters train; the embedding and LM head are the target's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import Trainer

from ..models.drafter_base import DraftPreTrainedModel
from ..models.errors import UserInputError
from ..models.identity import drafter_kind
from ..models.layers import DraftContextCache
from ..models.modeling_eagle3 import Eagle3DraftModel
from ..transformers_internals.trainer_hooks import prepare_inputs
from .blocks import build_blocks, sample_anchors
from .checkpoints import AtomicCheckpointSaves
from .losses import (TargetDistribution, draft_labels, dspark_loss, l1_distance, position_weights,
                     selector_candidates, selector_cross_entropy, soft_cross_entropy)
from .regenerate import iter_regenerated


@torch.no_grad()
def frozen_target_states(target, input_ids, attention_mask, feature_indices: list[int], final_index: int):
    """One forward of the frozen target: (its hidden states at `feature_indices` (HF `hidden_states` indices)
    concatenated on the last axis, the hidden state at `final_index`). Only those states are kept, and logits for
    one row."""
    out = target(input_ids=input_ids, attention_mask=attention_mask,
                 output_hidden_states=list(feature_indices) + [final_index], use_cache=False, logits_to_keep=1)
    return torch.cat([out.hidden_states[i] for i in feature_indices], dim=-1), out.hidden_states[final_index]


class DraftDataCollator:
    """Right-pads `input_ids` / `loss_mask` examples into a batch with an attention mask; cached `target_*`
    tensors (from a `TargetCacheDataset`) are padded with zeros alongside."""

    def __init__(self, pad_token_id: int = 0, max_length: int | None = None):
        self.pad_token_id = pad_token_id
        self.max_length = max_length

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        cut = lambda seq: torch.as_tensor(seq)[: self.max_length] if self.max_length else torch.as_tensor(seq)  # noqa: E731
        ids = [cut(e["input_ids"]).long() for e in examples]
        width = max(len(i) for i in ids)
        batch = {
            "input_ids": torch.full((len(ids), width), self.pad_token_id, dtype=torch.long),
            "loss_mask": torch.zeros(len(ids), width, dtype=torch.long),
            "attention_mask": torch.zeros(len(ids), width, dtype=torch.long),
        }
        for row, (i, example) in enumerate(zip(ids, examples)):
            batch["input_ids"][row, : len(i)] = i
            batch["loss_mask"][row, : len(i)] = cut(example["loss_mask"]).long()
            batch["attention_mask"][row, : len(i)] = 1
        for key in [k for k in examples[0] if k.startswith("target_")]:
            values = [cut(e[key]) for e in examples]
            padded = values[0].new_zeros((len(values), width, *values[0].shape[1:]))
            for row, value in enumerate(values):
                padded[row, : len(value)] = value
            batch[key] = padded
        return batch


class RegeneratedDataset(Dataset):
    """Examples from `hf-dspark regenerate` shards, truncated to `max_length`, with at least two answer tokens."""

    def __init__(self, data_dir, max_length: int = 1024, limit: int | None = None):
        if not Path(data_dir).is_dir():
            raise UserInputError(f"--data {data_dir}: no such folder; pass a folder written by "
                                 "`hf-dspark regenerate --output DIR`.")
        self.examples = []
        for example in iter_regenerated(data_dir):
            example = {k: v[:max_length] for k, v in example.items()}
            if sum(example["loss_mask"]) >= 2:
                self.examples.append(example)
            if limit is not None and len(self.examples) >= limit:
                break
        if not self.examples:
            raise UserInputError(f"no usable regenerated examples under {data_dir} (no shard-*.jsonl there, or no "
                                 "answer of at least 2 tokens); write them with `hf-dspark regenerate --output "
                                 f"{data_dir}`.")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


def most_frequent_tokens(counts: torch.Tensor, size: int, always: list[int] | tuple = ()) -> torch.Tensor:
    """Draft vocabulary: the `size` most frequent answer tokens (plus `always`, e.g. EOS), as sorted target ids."""
    order = counts.argsort(descending=True).tolist()
    chosen = list(dict.fromkeys([t for t in always if t is not None] + order))[:size]
    return torch.tensor(sorted(chosen))


class DSparkTrainer(AtomicCheckpointSaves, Trainer):
    """`Trainer` for hf_dspark drafters. Checkpoints are saved atomically (`AtomicCheckpointSaves`).

    Args:
        model: a `DSparkDraftModel` (DSpark or DFlash), `DFlash2DraftModel` or `Eagle3DraftModel`.
        target: the frozen target causal LM whose embedding/LM head the drafter shares. May be None when the
            training data is a `TargetCacheDataset` and the drafter already has the target attached.
        num_anchors: blocks per sequence (DSpark/DFlash) or supervised rows per step and sequence (Eagle3).
        ce_weight, tv_weight, bce_weight: loss weights; default 0.1/0.9/1.0 for DSpark, 1/0/0 for DFlash and for
            DFlash 2's backbone logits.
        selector_weight: DFlash 2: weight of the cross-entropy over its candidate selector's scores (default 1).
        kl_weight: weight of a soft cross-entropy to the target distribution (default 0: DeepSpec's recipe).
        loss_decay: slot weight `exp(-k / loss_decay)` (k from 0).
        ttt_decay: Eagle3 step weight `ttt_decay ** s`.
    """

    def __init__(self, model: DraftPreTrainedModel, target, args=None, train_dataset=None, eval_dataset=None, *,
                 num_anchors: int = 32, ce_weight: float | None = None, tv_weight: float | None = None,
                 bce_weight: float | None = None, kl_weight: float = 0.0, loss_decay: float = 4.0,
                 ttt_decay: float = 0.8, selector_weight: float = 1.0,
                 data_collator=None, **kwargs):
        if args is not None:
            args.remove_unused_columns = False  # our batch keys are not forward() parameters
        if data_collator is None:
            pad = target.config.get_text_config().pad_token_id if target is not None else None
            data_collator = DraftDataCollator(pad if pad is not None else 0)
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        drafter = self._drafter(model)
        if target is not None:
            drafter.attach_target(target, follow=False)  # a drafter under training keeps its device and dtype
            target = target.eval().requires_grad_(False)
            if self.accelerator.num_processes > 1:
                target = self.accelerator.prepare_model(target, evaluation_mode=True)
        elif drafter._target_heads is None:
            raise ValueError("DSparkTrainer needs `target=`, or a drafter with `attach_target(target)` already "
                             "called and a TargetCacheDataset as training data")
        self.target = target
        self.target_layers = drafter.target_hidden_state_indices
        # index of the post-norm final state in `hidden_states` (online mode only)
        self.final_layer = target.config.get_text_config().num_hidden_layers if target is not None else None
        # DFlash 2's backbone trains as DFlash's does; its selector has its own term (`selector_weight`).
        self.dflash2 = drafter_kind(drafter.config) == "dflash2"
        is_dflash = getattr(drafter.config, "is_dflash", False) or self.dflash2
        self.ce_weight = ce_weight if ce_weight is not None else (1.0 if is_dflash else 0.1)
        self.tv_weight = tv_weight if tv_weight is not None else (0.0 if is_dflash else 0.9)
        self.bce_weight = bce_weight if bce_weight is not None else (0.0 if is_dflash else 1.0)
        self.kl_weight, self.selector_weight = kl_weight, selector_weight
        self.num_anchors, self.loss_decay, self.ttt_decay = num_anchors, loss_decay, ttt_decay
        self._sums = {"train": defaultdict(float), "eval": defaultdict(float)}
        self._blocks_seen, self._clock = 0, time.perf_counter()

    # -- target -------------------------------------------------------------------------------------------------

    def _drafter(self, model) -> DraftPreTrainedModel:
        model = self.accelerator.unwrap_model(model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    @torch.no_grad()
    def target_features(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(concatenated target layer outputs (B, L, n*d), post-norm final states (B, L, d))."""
        if "target_features" in inputs:
            return inputs["target_features"], inputs["target_final"]
        if self.target is None:
            raise ValueError("this batch has no cached target outputs and the trainer has no target")
        return frozen_target_states(self.target, inputs["input_ids"], inputs["attention_mask"], self.target_layers,
                                    self.final_layer)

    @torch.no_grad()
    def target_distribution(self, drafter, inputs: dict, final: torch.Tensor, rows: torch.Tensor,
                            positions: torch.Tensor) -> TargetDistribution:
        """The target's next-token distribution after (row, position) pairs: from the cached log-partition and
        argmax (only the draft-vocabulary rows of the LM head are evaluated), or from full logits online."""
        states = final[rows, positions]
        if "target_logsumexp" in inputs:
            draft_logits = drafter.lm_head_logits(states.to(drafter.dtype))  # the target's, never soft-capped
            return TargetDistribution.from_cache(draft_logits, inputs["target_logsumexp"][rows, positions],
                                                 inputs["target_argmax"][rows, positions])
        logits = drafter.target_heads.lm_head(states).float()
        return TargetDistribution.from_logits(logits, drafter.draft_to_target)

    # -- losses -------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter = self._drafter(model)
        features, final = self.target_features(inputs)
        features = features.to(drafter.dtype)
        step = self._eagle3_loss if isinstance(drafter, Eagle3DraftModel) else self._block_loss
        loss, details, slots = step(model, drafter, inputs, features, final)
        self._record("train" if model.training else "eval", details, slots)
        return (loss, None) if return_outputs else loss

    def _block_loss(self, model, drafter, inputs, features, final):
        config = drafter.config
        anchors, valid = sample_anchors(inputs["loss_mask"], self.num_anchors)
        blocks = build_blocks(inputs["input_ids"], inputs["loss_mask"], anchors, valid, config.block_size,
                              config.mask_token_id, config.first_draft_slot)
        selected = blocks.slot_valid
        # DFlash 2's selector scores only its candidates (below), never the whole vocabulary: no teacher forcing
        # in the forward, whose logits are then the backbone's.
        out = model(input_ids=blocks.input_ids, target_hidden_states=features, position_ids=blocks.position_ids,
                    attention_mask=blocks.attention_mask, logits_mask=selected,
                    previous_token_ids=None if self.dflash2 else blocks.previous_token_ids)
        rows = torch.arange(selected.shape[0], device=selected.device)[:, None].expand_as(selected)[selected]
        target = self.target_distribution(drafter, inputs, final, rows, blocks.target_rows[selected])
        confidence = out.confidence_logits[selected] if out.confidence_logits is not None else None
        slots = blocks.slot_index[selected]
        weights = position_weights(slots, self.loss_decay)
        total = self._global_normaliser(weights.sum())
        loss, details = dspark_loss(
            out.logits, target, blocks.labels[selected], slots, confidence,
            ce_weight=self.ce_weight, tv_weight=self.tv_weight, bce_weight=self.bce_weight,
            kl_weight=self.kl_weight, decay=self.loss_decay,
            draft_to_target=drafter.draft_to_target, total_weight=total,
        )
        if self.dflash2 and self.selector_weight:
            # The label is the target's own next token (what greedy verification accepts), as speculators trains.
            labels = draft_labels(target.argmax, drafter.draft_to_target)
            candidates, positions = selector_candidates(out.base_logits, labels, drafter.config.selector_top_k)
            scores = drafter.candidate_scores(out.last_hidden_state[selected], out.base_logits,
                                              blocks.previous_token_ids[selected], candidates)
            selector = selector_cross_entropy(scores, positions)
            loss = loss + self.selector_weight * (weights * selector).sum() / total.clamp_min(1e-8)
        self._blocks_seen += int(valid.sum())
        return loss, details, blocks.slot_index[selected]

    def _eagle3_loss(self, model, drafter, inputs, features, final):
        """Training-time test: step s feeds each row the drafter's own state from step s-1 at the row before, and
        lets it attend to target-fed rows up to t-s plus its own chain, exactly as when drafting s tokens ahead."""
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"]
        batch, length = input_ids.shape
        rows = length - 2  # row t reads f_t and x_{t+1}, predicts x_{t+2}
        if rows < 1:
            raise ValueError("Eagle3 training needs sequences of at least 3 tokens")
        device = input_ids.device
        tokens = input_ids[:, 1 : rows + 1]
        label_ok = loss_mask[:, 2 : rows + 2] > 0
        t = torch.arange(rows, device=device)
        cache, hidden, total, details_all, slots_all = DraftContextCache(), None, 0.0, defaultdict(list), []
        weight_sum = 0.0
        for step in range(drafter.config.block_size):
            masks = [t[None, :] <= (t[:, None] - step)]
            masks += [t[None, :] == (t[:, None] - step + j) for j in range(1, step + 1)]
            attention = torch.cat(masks, dim=-1)[None, None]
            usable = label_ok & (t >= step)[None, :]
            chosen = _subsample(usable, self.num_anchors)
            if step == 0:
                out = model(input_ids=tokens, target_hidden_states=features[:, :rows], attention_mask=attention,
                            position_ids=t[None].expand(batch, -1), cache=cache, logits_mask=chosen)
            else:
                shifted = torch.cat([hidden.new_zeros(batch, 1, hidden.shape[-1]), hidden[:, :-1]], dim=1)
                out = model(input_ids=tokens, hidden_states=shifted, attention_mask=attention,
                            position_ids=t[None].expand(batch, -1), cache=cache, logits_mask=chosen)
            hidden = out.hidden_states
            if not chosen.any():
                continue
            position = torch.nonzero(chosen)
            target = self.target_distribution(drafter, inputs, final, position[:, 0], position[:, 1] + 1)
            step_weight = self.ttt_decay**step
            total = total + step_weight * soft_cross_entropy(out.logits, target).sum()
            weight_sum += step_weight * int(chosen.sum())
            with torch.no_grad():
                distance = l1_distance(out.logits.float().softmax(-1), target.probs)
                argmax = out.logits.argmax(-1)
                if drafter.draft_to_target is not None:
                    argmax = drafter.draft_to_target[argmax]
            details_all["acceptance"].append((1 - 0.5 * distance).clamp(0, 1))
            details_all["top1"].append((argmax == target.argmax).float())
            slots_all.append(torch.full((int(chosen.sum()),), step, device=device))
        normaliser = self._global_normaliser(torch.tensor(float(weight_sum), device=device))
        if float(normaliser) == 0:  # no process had a supervised row
            return sum(p.sum() * 0.0 for p in model.parameters() if p.requires_grad), {}, torch.zeros(0)
        if weight_sum == 0:
            total = sum(p.sum() * 0.0 for p in model.parameters() if p.requires_grad)
            details_all, slots_all = {}, [torch.zeros(0, device=device)]
        self._blocks_seen += batch
        details = {k: torch.cat(v) for k, v in details_all.items()}
        return total / normaliser, details, torch.cat(slots_all)

    def _global_normaliser(self, local_weight: torch.Tensor) -> torch.Tensor:
        """The loss normaliser for this process: the slot-weight sum over all processes divided by their number
        (this process's own sum when it runs alone). Every process calls it once per loss, so it is collective-safe.
        With it the average of the processes' gradients (DDP / FSDP) equals the gradient of the weighted mean over
        the global batch, whatever the split of supervised slots between processes, as in one process."""
        processes = self.accelerator.num_processes
        if processes == 1:
            return local_weight.detach()
        total = self.accelerator.reduce(local_weight.detach().float().clone(), reduction="sum")
        return total / processes

    # -- logging ------------------------------------------------------------------------------------------------

    def _record(self, split: str, details: dict, slots: torch.Tensor) -> None:
        sums = self._sums[split]
        for k in slots.unique().tolist():
            in_slot = slots == k
            sums[f"n_slot{k}"] += int(in_slot.sum())
            for name in ("acceptance", "top1"):
                if name in details:
                    sums[f"{name}_slot{k}"] += float(details[name][in_slot].sum())
        if "confidence" in details:
            sums["conf_abs_err"] += float((details["confidence"] - details["acceptance"]).abs().sum())
            sums["conf_n"] += int(details["confidence"].numel())

    def _summarise(self, split: str, prefix: str) -> dict[str, float]:
        sums, out = self._sums[split], {}
        for key in [k for k in sums if k.startswith("n_slot")]:
            k = key[len("n_slot"):]
            for name in ("acceptance", "top1"):
                if f"{name}_slot{k}" in sums:
                    out[f"{prefix}{name}_slot{k}"] = round(sums[f"{name}_slot{k}"] / max(sums[key], 1), 4)
        if sums.get("conf_n"):
            out[f"{prefix}confidence_mae"] = round(sums["conf_abs_err"] / sums["conf_n"], 4)
        sums.clear()
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if any(key.startswith("eval_") for key in logs):
            logs.update(self._summarise("eval", "eval_"))
        elif "loss" in logs:
            logs.update(self._summarise("train", ""))
            now = time.perf_counter()
            logs["blocks_per_second"] = round(self._blocks_seen / max(now - self._clock, 1e-9), 2)
            self._blocks_seen, self._clock = 0, now
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = prepare_inputs(self, inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


def _subsample(usable: torch.Tensor, per_row: int) -> torch.Tensor:
    """Keep at most `per_row` random True entries per row."""
    scores = torch.rand(usable.shape, device=usable.device).masked_fill(~usable, -1.0)
    keep = torch.zeros_like(usable)
    top = scores.topk(min(per_row, usable.shape[1]), dim=1)
    keep.scatter_(1, top.indices, top.values >= 0)
    return keep
