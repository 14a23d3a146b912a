"""Training to a wall-clock budget: the fair way to compare drafters whose steps cost differently."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState


class TimeBudgetCallback(TrainerCallback, ExportableState):
    """Stops training once `max_seconds` of training time have been spent and anneals the learning rate on a
    cosine over that time (after `warmup_steps` linear steps), instead of over `max_steps`.

    The spent time is saved in checkpoints (`trainer_state.json`); pass `elapsed=spent_seconds(checkpoint)` when
    resuming to continue the schedule, with the same or a larger `max_seconds`. Use it with
    `lr_scheduler_type="constant"`: this callback sets every parameter group's learning rate before each step.
    """

    @staticmethod
    def spent_seconds(checkpoint_dir) -> float:
        """Training seconds recorded in a Trainer checkpoint by this callback (0 if none)."""
        path = Path(checkpoint_dir) / "trainer_state.json"
        if not path.is_file():
            return 0.0
        stored = json.loads(path.read_text()).get("stateful_callbacks", {}).get("TimeBudgetCallback", {})
        stored = stored[0] if isinstance(stored, list) and stored else stored
        return float(stored.get("args", {}).get("elapsed", 0.0)) if isinstance(stored, dict) else 0.0

    def __init__(self, max_seconds: float, warmup_steps: int = 0, min_ratio: float = 0.0, elapsed: float = 0.0):
        if max_seconds <= 0:
            raise ValueError("max_seconds must be positive")
        self.max_seconds, self.warmup_steps, self.min_ratio = max_seconds, warmup_steps, min_ratio
        self.elapsed = elapsed
        self._since: float | None = None
        self._base_lrs: list[float] | None = None

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(self.elapsed / self.max_seconds, 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self._since = time.perf_counter()
        if optimizer is not None:
            if self._base_lrs is None:
                self._base_lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
            factor = self.factor(state.global_step)
            for group, base in zip(optimizer.param_groups, self._base_lrs):
                group["lr"] = base * factor

    def on_step_end(self, args, state, control, **kwargs):
        if self._since is not None:
            self.elapsed += time.perf_counter() - self._since
        if self.elapsed >= self.max_seconds:
            control.should_training_stop = True
            control.should_save = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.log_history and "loss" in state.log_history[-1]:
            state.log_history[-1]["budget_lr_factor"] = round(self.factor(state.global_step), 4)
            state.log_history[-1]["budget_seconds"] = round(self.elapsed, 1)

    def state(self) -> dict:
        return {"args": {"max_seconds": self.max_seconds, "warmup_steps": self.warmup_steps,
                         "min_ratio": self.min_ratio, "elapsed": self.elapsed},
                "attributes": {}}
