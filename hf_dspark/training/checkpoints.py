"""Trainer checkpoints that survive interruptions: which ones are complete, and saves that are never half visible.

A save interrupted by Ctrl-C, a crash or a full disk used to leave `checkpoint-N` without `trainer_state.json`;
transformers' `resume_from_checkpoint=True` picks the newest folder by name and then fails on it for good.
`newest_complete_checkpoint` picks the newest folder holding everything `Trainer` reads when it resumes, and
`DSparkTrainer` writes each checkpoint under a hidden staging name and renames it into place once complete.
Nothing here deletes a folder the user cannot recreate: a half checkpoint that is in the way is moved under
`incomplete/` and reported.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

from ..transformers_internals.trainer_hooks import TrainerCheckpointHooks
from .output_folder import OutputWriteError, write_problem

PREFIX = "checkpoint-"
STAGING_PREFIX = ".saving-"  # hidden, and outside transformers' `checkpoint-*` globs and rotation
INCOMPLETE = "incomplete"  # where a half checkpoint goes when a new save needs its name

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
            "adapter_model.safetensors", "adapter_model.bin")
_OPTIMIZER = ("optimizer.pt", "optimizer.bin")


def checkpoint_step(path: Path) -> int | None:
    """N of a `checkpoint-N` folder name, else None."""
    suffix = path.name[len(PREFIX):] if path.name.startswith(PREFIX) else ""
    return int(suffix) if suffix.isdigit() else None


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is not whole (its header promises more bytes than it has), or None."""
    try:
        with open(path, "rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_length))
        header.pop("__metadata__", None)
        end = max((info["data_offsets"][1] for info in header.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return f"{path.name} is unreadable"
    return None if path.stat().st_size >= 8 + header_length + end else f"{path.name} is truncated"


def checkpoint_problem(folder: str | os.PathLike, need_optimizer: bool = True) -> str | None:
    """Why `Trainer.train(resume_from_checkpoint=folder)` cannot resume from `folder`, or None when it can.

    What transformers 5 reads on resume: `trainer_state.json` (last of the files `_save_checkpoint` writes), the
    model weights, the optimizer and scheduler states (unless the run saved the model only) and the RNG state.
    Files torch writes are zip archives, so a truncated one lacks its closing directory; a truncated safetensors
    file is shorter than its header says. Sharded FSDP/DeepSpeed layouts count as present by their folders."""
    folder = Path(folder)
    state = folder / "trainer_state.json"
    if not state.is_file():
        return "no trainer_state.json: its save was interrupted"
    try:
        int(json.loads(state.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return "trainer_state.json is unreadable: its save was interrupted"
    entries = [p.name for p in folder.iterdir()]
    sharded = [name for name in entries if (folder / name).is_dir()]
    if not any(name in _WEIGHTS for name in entries) and not any("model" in name for name in sharded):
        return "no model weights"
    if need_optimizer:
        if not any(name in _OPTIMIZER for name in entries) and not any(
                name.startswith(("optimizer", "global_step")) for name in sharded):
            return "no optimizer state (optimizer.pt)"
        if any(name in _OPTIMIZER for name in entries) and "scheduler.pt" not in entries:
            return "no scheduler state (scheduler.pt)"
        if not any(name.startswith("rng_state") for name in entries):
            return "no RNG state (rng_state.pth)"
    for name in entries:
        path = folder / name
        if name.endswith(".safetensors") and (problem := _safetensors_problem(path)):
            return problem
        if name.endswith((".pt", ".pth")) and path.is_file() and not zipfile.is_zipfile(path):
            return f"{name} is truncated"
    return None


def newest_complete_checkpoint(run_dir: str | os.PathLike, log=None) -> Path | None:
    """The newest `checkpoint-N` under `run_dir` that a resume can read (None if there is none). Every newer,
    incomplete one is named with the reason it was skipped, and so is what an interrupted save left in staging;
    none of them is deleted."""
    log = log or (lambda line: print(line, file=sys.stderr))
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for leftover in sorted(run_dir.glob(f"{STAGING_PREFIX}{PREFIX}*")):
        log(f"{leftover} is what an interrupted save left (never a checkpoint, not used); delete it to free space.")
    folders = sorted((p for p in run_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None),
                     key=checkpoint_step, reverse=True)
    for folder in folders:
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        log(f"{folder} is incomplete ({problem}); skipped, and left on disk.")
    return None


def _unused_name(path: Path) -> Path:
    candidates = (path.with_name(f"{path.name}-{n}") if n else path for n in range(10_000))
    return next(p for p in candidates if not p.exists())


def publish_checkpoint(staged: Path, final: Path, log=None, need_optimizer: bool = True) -> None:
    """Rename the completely written `staged` folder to `final` (one rename: a reader sees all of it or none). A
    complete checkpoint already there (the same step saved again) is replaced; a half one, what an interrupted
    save of an older version left, is moved under `incomplete/` and reported, never deleted."""
    log = log or (lambda line: print(line, file=sys.stderr))
    if final.exists():
        if checkpoint_problem(final, need_optimizer) is None:
            replaced = _unused_name(final.with_name(f"{STAGING_PREFIX}replaced-{final.name}"))
            os.rename(final, replaced)
            os.rename(staged, final)
            shutil.rmtree(replaced)
            return
        aside = _unused_name(final.parent / INCOMPLETE / final.name)
        aside.parent.mkdir(exist_ok=True)
        os.rename(final, aside)
        log(f"moved the incomplete {final} to {aside} to save a complete checkpoint in its place; delete it when "
            "you no longer need it.")
    os.rename(staged, final)


def rotate_checkpoints(run_dir: Path, keep: int | None, newest: Path, need_optimizer: bool = True) -> None:
    """Keep the `keep` newest complete checkpoints (by step) and `newest`, deleting older complete ones as
    `save_total_limit` asks; incomplete folders are never counted or deleted (transformers' own rotation
    deletes whatever matches `checkpoint-*`)."""
    if not keep or keep <= 0:
        return
    complete = sorted((p for p in run_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None
                       and p != newest and checkpoint_problem(p, need_optimizer) is None), key=checkpoint_step)
    for old in complete[: max(len(complete) + 1 - keep, 0)]:
        shutil.rmtree(old)


def failed_save_error(error: BaseException, run_dir: Path, step: int) -> OutputWriteError | None:
    """The one-line error for a save of checkpoint-`step` that failed because of its folder (a full disk, no
    permission), naming the checkpoint a rerun resumes from; None when the failure is not the folder's."""
    cause = write_problem(error, run_dir, saving=True)
    if cause is None:
        return None
    kept = newest_complete_checkpoint(run_dir, log=lambda line: None)
    resume = f"it resumes from {kept.name}, which is intact" if kept else "no complete checkpoint is kept yet"
    return OutputWriteError(f"saving {PREFIX}{step} in {run_dir} failed: {cause}. Nothing of that save was kept. "
                            f"Free space or fix that, then rerun the same command: {resume}.")


class AtomicCheckpointSaves(TrainerCheckpointHooks):
    """`Trainer` mixin: each checkpoint is written under `.saving-checkpoint-N` and renamed to `checkpoint-N` once
    complete, so an interruption (Ctrl-C, a crash, a full disk) never leaves a `checkpoint-N` a resume would pick
    and fail on. A failed save is removed again (it frees the space it took) and, when its folder was at fault, is
    an `OutputWriteError` naming the checkpoint a rerun resumes from. Rotation (`save_total_limit`) counts and
    deletes complete checkpoints only."""

    _checkpoint_staging: Path | None = None

    def checkpoint_output_dir(self, trial):
        # While a checkpoint is saved, the Trainer writes `<staging>/checkpoint-N` (and rotates there: one folder).
        return str(self._checkpoint_staging) if self._checkpoint_staging else self.stock_output_dir(trial)

    def write_checkpoint(self, model, trial) -> None:
        run_dir = Path(self.stock_output_dir(trial))
        name = f"{PREFIX}{self.state.global_step}"
        staging = run_dir / f"{STAGING_PREFIX}{name}"
        self._checkpoint_staging = staging
        try:
            self.stock_write_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every process has written its part (RNG states) into staging
        except BaseException as error:
            # Judged before the half save is removed (which frees its space); Ctrl-C is never the folder's fault.
            step = self.state.global_step
            problem = failed_save_error(error, run_dir, step) if isinstance(error, Exception) else None
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            if problem is not None:
                raise problem from error
            raise
        finally:
            self._checkpoint_staging = None
        if self.args.should_save:
            final, full = run_dir / name, not self.args.save_only_model
            publish_checkpoint(staging / name, final, need_optimizer=full)
            shutil.rmtree(staging, ignore_errors=True)  # empty now
            rotate_checkpoints(run_dir, self.args.save_total_limit, final, need_optimizer=full)
