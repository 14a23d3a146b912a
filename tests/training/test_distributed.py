"""Scale-out for real: `accelerate launch --num_processes 2` on CPU (gloo) with DDP and with FSDP2 trains the drafter
like one process on the same global batch (same logged losses, same weights within float rounding)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from factories import tiny_drafter, tiny_target

pytest.importorskip("accelerate")
SCRIPT = Path(__file__).resolve().parents[1] / "distributed_train.py"
FSDP_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "accelerate_fsdp.yaml"  # the README's config
GLOBAL_BATCH = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: list[str], output: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((output / "losses.json").read_text()) | {"state": load_file(output / "drafter.safetensors")}


def _launch(tmp_path, name: str, launcher_flags: list[str]) -> dict:
    output = tmp_path / name
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
               *launcher_flags, str(SCRIPT), str(output), "--batch-size", str(GLOBAL_BATCH // 2)]
    return _run(command, output)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    output = tmp_path_factory.mktemp("one")
    return _run([sys.executable, str(SCRIPT), str(output), "--batch-size", str(GLOBAL_BATCH)], output)


def _assert_same_training(run: dict, reference: dict) -> None:
    assert run["processes"] == 2 and reference["processes"] == 1
    assert len(run["losses"]) == len(reference["losses"]) == 3
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    initial = tiny_drafter(tiny_target("llama"), "markov").state_dict()
    assert set(run["state"]) == set(reference["state"]) == set(initial)
    for name, trained in reference["state"].items():
        update = trained - initial[name]
        assert update.abs().max() > 1e-3, f"{name} did not train"
        difference = run["state"][name] - trained
        # AdamW divides by sqrt(v): float rounding in the reduced gradients moves weights by ~1e-6, not more.
        assert difference.abs().max() < 1e-4, name
        assert difference.norm() < 1e-3 * update.norm(), name


@pytest.mark.distributed
def test_two_process_ddp_matches_one_process(one_process, tmp_path):
    # accelerate's `--cpu` launcher starts one process (multi-CPU runs go through mpirun); `--multi_gpu` is its
    # torchrun launcher, and with no GPU visible the two processes train on CPU over gloo (MULTI_CPU, DDP).
    run = _launch(tmp_path, "ddp", ["--multi_gpu"])
    assert run["distributed_type"] == "DistributedType.MULTI_CPU" and run["wrapped"] == "DistributedDataParallel"
    _assert_same_training(run, one_process)


@pytest.mark.distributed
def test_two_process_fsdp2_matches_one_process(one_process, tmp_path):
    """examples/accelerate_fsdp.yaml itself (FSDP2, transformer-based wrap of the drafter's decoder layers, sharded
    state dict, CPU-RAM-efficient loading), on 2 CPU processes in float32."""
    run = _launch(tmp_path, "fsdp", ["--config_file", str(FSDP_CONFIG)])
    assert run["distributed_type"] == "DistributedType.FSDP" and run["sharded"]  # parameters are DTensor shards
    _assert_same_training(run, one_process)


def test_loss_normaliser_is_the_global_weight_share():
    """With local normalisation, two processes holding different numbers of supervised slots would each average
    their own slots and DDP would average those means: not the global batch's mean. The trainer normalises by the
    all-reduced weight sum over the number of processes; alone, by its own sum."""
    from hf_dspark.training.losses import dspark_loss

    torch.manual_seed(0)
    logits, target = torch.randn(7, 11), torch.randn(7, 11)
    labels, slots = torch.randint(0, 11, (7,)), torch.tensor([0, 1, 2, 0, 1, 0, 3])
    whole, _ = dspark_loss(logits, target, labels, slots)
    first, second = slice(0, 3), slice(3, 7)
    weights = torch.exp(-slots.float() / 4.0)
    share = weights.sum() / 2  # what each of two processes divides by
    parts = [dspark_loss(logits[s], target[s], labels[s], slots[s], total_weight=share)[0] for s in (first, second)]
    assert torch.allclose((parts[0] + parts[1]) / 2, whole, atol=1e-6)  # DDP's average of the two = the global mean
    local = [dspark_loss(logits[s], target[s], labels[s], slots[s])[0] for s in (first, second)]
    assert not torch.allclose((local[0] + local[1]) / 2, whole, atol=1e-3)
