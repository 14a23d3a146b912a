"""The private `Trainer` methods hf_dspark's training overrides or calls, behind public names, with the check that the
installed release still has them (`trainer_problems`, pinned by tests/coexistence/test_transformers_internals.py).

What is relied on (transformers 5.24 and 5.25):

* `Trainer._save_checkpoint(model, trial)` writes one checkpoint, into `Trainer._get_output_dir(trial)` (the run
  folder, where it also rotates old checkpoints); a mixin that overrides both can write a checkpoint elsewhere first
  (`TrainerCheckpointHooks`: the overrides call `write_checkpoint` and `checkpoint_output_dir`);
* `Trainer._prepare_inputs(inputs)` moves a batch to the device as `training_step` does: `prepare_inputs`.
"""

from __future__ import annotations

import inspect


class TrainerCheckpointHooks:
    """`Trainer` mixin (put it before `Trainer` in the bases): Trainer's private checkpoint steps as public hooks.
    Override `checkpoint_output_dir(trial)` (the folder the Trainer writes and rotates checkpoints in) and
    `write_checkpoint(model, trial)` (one checkpoint); `stock_output_dir` and `stock_write_checkpoint` are the
    Trainer's own."""

    def _get_output_dir(self, trial):
        return self.checkpoint_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self.write_checkpoint(model, trial)

    def checkpoint_output_dir(self, trial) -> str:
        return self.stock_output_dir(trial)

    def write_checkpoint(self, model, trial) -> None:
        self.stock_write_checkpoint(model, trial)

    def stock_output_dir(self, trial) -> str:
        return super()._get_output_dir(trial)

    def stock_write_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)


def prepare_inputs(trainer, inputs: dict) -> dict:
    """`inputs` on the trainer's device, prepared as its `training_step` prepares a batch."""
    return trainer._prepare_inputs(inputs)


# The parameters each method is called with.
RELIED_ON = {"_get_output_dir": ["self", "trial"], "_save_checkpoint": ["self", "model", "trial"],
             "_prepare_inputs": ["self", "inputs"]}


def trainer_problems(trainer_class=None) -> list[str]:
    """What the installed `Trainer` (or `trainer_class`, for testing the check) no longer has of what this module
    relies on; empty when all holds."""
    if trainer_class is None:
        from transformers import Trainer as trainer_class
    problems = []
    for name, parameters in RELIED_ON.items():
        method = getattr(trainer_class, name, None)
        found = list(inspect.signature(method).parameters) if callable(method) else None
        if found != parameters:
            problems.append(f"{trainer_class.__name__}.{name} takes {found}, hf_dspark calls it with {parameters}")
    return problems
