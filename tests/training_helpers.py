"""What the training tests share: target-generated examples and training arguments, tau measured with every round
drafting, regenerated shards written by hand, tiny training runs, small disks, and child processes a test interrupts
with SIGINT. The fixtures built on them (`small_disk`, `interruptible_child`) are `conftest.py`'s."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from factories import prompts, tiny_target


def target_generated_examples(target, count=12, new_tokens=40):
    examples = []
    for ids in prompts(count, seed=7):
        out = target.generate(ids, do_sample=False, max_new_tokens=new_tokens)
        examples.append({"input_ids": out[0].tolist(), "loss_mask": [0] * ids.shape[1] + [1] * new_tokens})
    return examples


def training_args(tmp_path, steps, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps, learning_rate=3e-3,
                  logging_steps=5, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                  lr_scheduler_type="constant", seed=0)
    values.update(overrides)
    return TrainingArguments(**values)


def mean_tau(target, drafter, examples, new_tokens=40):
    taus = []
    for example in examples:
        prompt_length = example["loss_mask"].index(1)
        ids = torch.tensor([example["input_ids"][:prompt_length]])
        # Every round drafts: the drafter's own acceptance, not which rounds a planner timed as worth drafting.
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=new_tokens,
                        dspark_round_planning=False)
        taus.append(drafter.last_generation_stats.tau)
    return sum(taus) / len(taus)


class SmallDisk:
    """A folder on a filesystem of `size` bytes: a tmpfs mounted there when this process may mount (root), so writes
    really fail with ENOSPC; `grow` makes room, as a user freeing space would. `mounted` is False where mounting is
    not allowed, and the tests then simulate the full disk (an OSError(ENOSPC) from the write)."""

    def __init__(self, folder: Path, size: int):
        folder.mkdir(parents=True)
        self.folder = folder
        self.mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                      capture_output=True).returncode == 0

    def remount(self, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.folder)], check=True)

    def grow(self, size: int) -> None:
        self.remount(f"size={size}")

    def fill(self) -> Path:
        """Take every free byte (a file the test removes to free space again)."""
        filler = self.folder / "filler"
        filler.write_bytes(b"\0" * shutil.disk_usage(self.folder).free)
        return filler

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.folder)], check=False)


def write_regenerated_shard(folder, count=8, length=30, prompt=6, seed=0):
    """`hf-dspark regenerate` records over token ids 2..95 (the tiny targets' vocabulary), written by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(folder / "shard-00000.jsonl", "w") as handle:
        for i in range(count):
            ids = [rng.randrange(2, 96) for _ in range(length)]
            handle.write(json.dumps({"id": i, "input_ids": ids, "prompt_length": prompt,
                                     "answer_spans": [[prompt, length]]}) + "\n")
    return folder


TINY_TRAINING = dict(kind="dspark", dataset_answers=0, num_layers=1, block_size=4, markov_rank=16,
                     draft_vocab_size=None, target_layer_ids=None, init_from_target=None, max_length=64, batch_size=2,
                     num_anchors=4, learning_rate=1e-3, save_steps=2, warmup_ratio=0.0, seed=0, resume=True)


def train_tiny(output, data, max_steps, target=None, **overrides):
    from hf_dspark.training.recipes import train_drafter

    settings = {**TINY_TRAINING, "max_steps": max_steps, **overrides}
    return train_drafter(target or tiny_target("llama"), None, output_dir=str(output), regenerated=[str(data)],
                         **settings)


def files_in(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


HANG_GUARD = 20 * 60
"""Seconds a child process may take to reach its event, or to stop after SIGINT: far beyond any machine's speed, so
only a hung child meets it. Every verdict is decided by events (a marker file, the child's exit), none by a clock."""


def announce_and_wait_for_sigint(marker: Path, text: str) -> None:
    """In a child process: say that the window a test interrupts has opened (`marker`, written whole at once, holds
    `text`), then stay in it until SIGINT arrives, however long the parent takes to send it."""
    partial = marker.with_name(marker.name + ".partial")
    partial.write_text(text)
    os.replace(partial, marker)
    while True:  # short naps, not one blocking wait: a signal landing just before a blocking call could be missed
        time.sleep(0.1)


CHILD_PROLOGUE = """
import signal, sys
# Ctrl-C in a terminal reaches Python's own SIGINT handler. A test run started in the background without job control
# (a CI step, `cmd &` in a script) inherits SIGINT *ignored*, and so would this child: the signal would do nothing.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[1])
"""


class InterruptibleChild:
    """A Python child process (`CHILD_PROLOGUE` + code, argv[1] the tests folder) that a test starts, waits for until
    it announces its window (`announce_and_wait_for_sigint`), interrupts with SIGINT and waits for again."""

    def __init__(self, folder: Path):
        self.log, self.process = folder / "child.log", None

    def start(self, code: str, marker: Path, *args: str) -> str:
        """Start the child and wait until it creates `marker`; returns the marker's text."""
        with open(self.log, "w") as out:
            self.process = subprocess.Popen([sys.executable, "-c", CHILD_PROLOGUE + code, str(Path(__file__).parent),
                                             *args], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + HANG_GUARD
        while not marker.exists() and self.process.poll() is None:
            assert time.monotonic() < deadline, f"no {marker.name} after {HANG_GUARD} s (hung):\n{self.output()}"
            time.sleep(0.05)
        assert marker.exists(), f"the child ended ({self.process.returncode}) before {marker.name}:\n{self.output()}"
        return marker.read_text()

    def interrupt(self) -> int:
        """Send SIGINT and wait for the child to end; returns its exit code."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=HANG_GUARD)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the child still runs {HANG_GUARD} s after SIGINT (hung):\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
