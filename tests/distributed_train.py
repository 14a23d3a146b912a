"""A few `DSparkTrainer` steps on a tiny Llama target, run by tests/training/test_distributed.py in one process or under
`accelerate launch --num_processes 2` (CPU, gloo; DDP or FSDP2). Writes the logged losses (`losses.json`) and the
trained drafter's full state dict (`drafter.safetensors`) from the main process.

    python tests/distributed_train.py OUT --batch-size 4
    accelerate launch --cpu --num_processes 2 tests/distributed_train.py OUT --batch-size 2
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import SequentialSampler
from transformers import TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from factories import tiny_drafter, tiny_target  # noqa: E402

from hf_dspark.training import DSparkTrainer  # noqa: E402

NUM_EXAMPLES = 8


def examples() -> list[dict]:
    """Sequences of different lengths and answer spans, so each process holds a different number of supervised
    slots (what makes the loss normalisation matter)."""
    generator = torch.Generator().manual_seed(3)
    data = []
    for i in range(NUM_EXAMPLES):
        length = 10 + (5 * i) % 13
        prompt = 2 + i % 4
        ids = torch.randint(2, 96, (length,), generator=generator).tolist()
        data.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return data


class InOrderTrainer(DSparkTrainer):
    """Sequential order: the global batch of step s is examples[s*B:(s+1)*B] in one process and in several
    (accelerate hands process p the p-th per-device slice of it)."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def fsdp_on_cpu() -> bool:
    """accelerate 1.15 turns `--use_fsdp` into FSDP only on accelerators: on CPU its state stays MULTI_CPU (DDP over
    gloo). Promote that state to FSDP, with the plugin built from the launcher's FSDP_* settings, before the Trainer
    creates its Accelerator (`use_configured_state`), so that the real FSDP2 preparation (`fully_shard` over a gloo
    device mesh) runs. Returns whether it did."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or torch.cuda.is_available():
        return False
    state = Accelerator(cpu=True).state  # the process-wide state the Trainer's Accelerator reuses
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState copies it on creation
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--batch-size", type=int, required=True, help="per process")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    configured = fsdp_on_cpu()
    output = Path(args.output)
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov").train()  # the same seeded initialisation in every process
    training_args = TrainingArguments(
        output_dir=str(output / "trainer"), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, accelerator_config={"use_configured_state": configured},
    )
    # num_anchors above every sequence's eligible positions: every process takes all anchors, no random draw.
    trainer = InOrderTrainer(model=drafter, target=target, args=training_args, train_dataset=examples(),
                             num_anchors=64)
    trainer.train()
    state = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.is_world_process_zero():
        output.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(output / "drafter.safetensors"))
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        (output / "losses.json").write_text(json.dumps({
            "losses": losses, "processes": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "wrapped": type(trainer.model_wrapped).__name__,
            "sharded": any(type(p).__name__ == "DTensor" for p in trainer.model_wrapped.parameters()),
        }))
    trainer.accelerator.wait_for_everyone()  # every process is done and the main one has written its files
    if trainer.accelerator.num_processes > 1:
        # torch 2.13's gloo teardown (at destroy_process_group or interpreter exit) sometimes aborts one process
        # with "terminate called without an active exception" after a finished run (about 1 launch in 7 here);
        # the work is complete, so leave without running the C++ destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
