"""On-disk target cache: run the frozen target once over the training data and reuse its outputs every epoch.

Per token the cache stores, in bfloat16, the drafter's fused input (the chosen target layers, concatenated) and
the target's final normed state; in float32 the log-partition `logsumexp` of the target logits; and the target's
argmax. That is exact and compact: the target's distribution over any draft vocabulary S is
`exp(final @ W_S^T - logsumexp)` with `W_S` the LM-head rows of S (the mass outside S is what is left), so the
loss never needs the full 49K-wide logits again, and the draft vocabulary may still change after caching.

Layout: `manifest.json` plus `shard-XXXXX.safetensors` files of flat tensors with per-example `offsets`. Shards
are written atomically, so an interrupted build resumes at the first missing shard; a folder built from other
data or other target layers is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..models.errors import UserInputError
from .output_folder import OutputWriteError, write_problem

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def bytes_per_token(num_layers: int, hidden_size: int) -> int:
    """Disk bytes per cached token: bf16 fused features and final state, fp32 logsumexp, int32 argmax and id,
    one byte of loss mask."""
    return 2 * hidden_size * (num_layers + 1) + 4 + 4 + 4 + 1


def _fingerprint(examples) -> str:
    digest = hashlib.sha256()
    for example in examples:
        digest.update(torch.as_tensor(example["input_ids"], dtype=torch.int32).numpy().tobytes())
        digest.update(torch.as_tensor(example["loss_mask"], dtype=torch.int8).numpy().tobytes())
    return digest.hexdigest()[:16]


class InsufficientDiskError(OutputWriteError):
    """The cache does not fit on its disk (a UserInputError and an OSError): the message names the folder."""


class TargetCacheError(UserInputError, FileNotFoundError):
    """A `--cache` folder that is not a complete target cache for this drafter (the message says how to fix it)."""


def build_target_cache(target, examples, output_dir: str | os.PathLike, target_layer_ids: list[int], *,
                       shard_size: int = 256, max_tokens_per_batch: int = 4096, target_name: str = "target",
                       headroom: float = 1.05, progress: bool = True) -> dict:
    """Write the target cache for `examples` (dicts with `input_ids` and `loss_mask`) under `output_dir`.

    `target_layer_ids` are 0-based decoder layers, or -1 for the embedding output (the drafter config's
    `target_layer_ids`; HF `hidden_states[i + 1]`). Prints the size
    before writing and raises `InsufficientDiskError` when the free disk space would not hold it, or an
    `OutputWriteError` when writing a shard fails for the folder's sake (that shard's partial file is removed).
    """
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    examples = [{"input_ids": list(map(int, e["input_ids"])), "loss_mask": list(map(int, e["loss_mask"]))}
                for e in examples]
    text_config = target.config.get_text_config()
    hidden, total_layers = text_config.hidden_size, text_config.num_hidden_layers
    if any(not -1 <= i < total_layers for i in target_layer_ids):
        raise UserInputError(f"target_layer_ids {target_layer_ids} outside the target's {total_layers} layers (use "
                             f"0..{total_layers - 1}, or -1 for the embedding output)")
    manifest = {
        "format_version": FORMAT_VERSION, "target": target_name, "target_layer_ids": list(target_layer_ids),
        "hidden_size": hidden, "vocab_size": text_config.vocab_size, "num_examples": len(examples),
        "num_tokens": sum(len(e["input_ids"]) for e in examples), "shard_size": shard_size,
        "data_fingerprint": _fingerprint(examples),
    }
    path = output / MANIFEST
    if path.exists() and json.loads(path.read_text()) != manifest:
        raise UserInputError(f"{output} holds a target cache of other data or settings ({path}); "
                             "use a new folder, or the same data and target layers to resume.")
    shards = [examples[i : i + shard_size] for i in range(0, len(examples), shard_size)]
    todo = [i for i in range(len(shards)) if not (output / f"shard-{i:05d}.safetensors").exists()]
    needed = int(sum(len(e["input_ids"]) for i in todo for e in shards[i])
                 * bytes_per_token(len(target_layer_ids), hidden) * headroom)
    free = shutil.disk_usage(output).free
    print(f"target cache: {manifest['num_tokens']:,} tokens in {len(shards)} shards, "
          f"{needed / 2**30:.2f} GiB to write ({len(todo)} shards left), {free / 2**30:.1f} GiB free")
    if needed > free:
        raise InsufficientDiskError(
            f"the target cache needs {needed / 2**30:.2f} GiB but {output} has {free / 2**30:.2f} GiB free; "
            "free space, choose another folder, or cache fewer/shorter examples (--max-length), then rerun.")
    if not path.exists():
        path.write_text(json.dumps(manifest, indent=2))
    hidden_indices = [i + 1 for i in target_layer_ids] + [total_layers]
    bar = tqdm(total=sum(len(e["input_ids"]) for i in todo for e in shards[i]), unit="tok", disable=not progress,
               desc="target cache")
    try:
        for index in todo:
            _write_shard(output, index, _cache_shard(target, shards[index], hidden_indices, max_tokens_per_batch, bar))
    finally:
        bar.close()  # also on Ctrl-C, so the CLI's one line does not land on the bar's
    return manifest


def _write_shard(output: Path, index: int, tensors: dict) -> None:
    """Write one shard atomically: a half-written file (a full disk, Ctrl-C) never stays behind."""
    final_path = output / f"shard-{index:05d}.safetensors"
    temporary = final_path.with_suffix(".tmp")
    try:
        save_file(tensors, str(temporary), metadata={"format_version": str(FORMAT_VERSION)})
    except BaseException as error:  # Ctrl-C too: the half shard goes either way
        # A write problem is judged before the half shard goes, freeing space.
        cause = write_problem(error, output, saving=True) if isinstance(error, Exception) else None
        temporary.unlink(missing_ok=True)
        if cause is None:
            raise
        kept = len(list(output.glob("shard-*.safetensors")))
        raise OutputWriteError(f"writing {final_path.name} to {output} failed: {cause}. Free space or fix that, "
                               f"then rerun the same command: it keeps the {kept} shards written and resumes "
                               "at the first missing one.") from error
    os.replace(temporary, final_path)


def shard_count(manifest: dict) -> int:
    """How many shards the cache a manifest describes has when complete."""
    return -(-manifest["num_examples"] // manifest["shard_size"])


@torch.no_grad()
def _cache_shard(target, examples, hidden_indices, max_tokens_per_batch, bar) -> dict[str, torch.Tensor]:
    device = next(target.parameters()).device
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    per_example: dict[int, dict[str, torch.Tensor]] = {}
    start = 0
    while start < len(order):
        width = len(examples[order[start]]["input_ids"])
        stop = start + 1
        while stop < len(order) and len(examples[order[stop]]["input_ids"]) * (stop - start + 1) <= max_tokens_per_batch:
            width = len(examples[order[stop]]["input_ids"])
            stop += 1
        batch = [examples[i] for i in order[start:stop]]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for row, example in enumerate(batch):
            ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
            attention[row, : len(example["input_ids"])] = 1
        out = target(input_ids=ids.to(device), attention_mask=attention.to(device), output_hidden_states=True,
                     use_cache=False, logits_to_keep=1)
        features = torch.cat([out.hidden_states[i] for i in hidden_indices[:-1]], dim=-1)
        final = out.hidden_states[hidden_indices[-1]]
        lm_head = target.get_output_embeddings()
        for row, example_index in enumerate(order[start:stop]):
            length = len(examples[example_index]["input_ids"])
            logits = lm_head(final[row, :length]).float()
            per_example[example_index] = {
                "features": features[row, :length].to(torch.bfloat16).cpu(),
                "final": final[row, :length].to(torch.bfloat16).cpu(),
                "logsumexp": logits.logsumexp(-1).cpu(),
                "argmax": logits.argmax(-1).to(torch.int32).cpu(),
            }
            bar.update(length)
        start = stop
    lengths = [len(e["input_ids"]) for e in examples]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return {
        "offsets": offsets,
        "input_ids": torch.tensor([t for e in examples for t in e["input_ids"]], dtype=torch.int32),
        "loss_mask": torch.tensor([m for e in examples for m in e["loss_mask"]], dtype=torch.int8),
        **{key: torch.cat([per_example[i][key] for i in range(len(examples))])
           for key in ("features", "final", "logsumexp", "argmax")},
    }


class TargetCacheDataset(Dataset):
    """Examples of a target cache: `input_ids`, `loss_mask` and the cached `target_*` tensors, for `DSparkTrainer`.

    The shards are memory-mapped read-only, so several trainers on one machine share a single copy in the page
    cache. `layer_ids` picks the drafter's target layers
    out of the cached ones (one cache can serve drafters that read different layers, e.g. DSpark and Eagle3);
    a layer that was not cached is refused.
    """

    def __init__(self, cache_dir: str | os.PathLike, layer_ids: list[int] | None = None):
        cache = Path(cache_dir)
        manifest_path = cache / MANIFEST
        if not manifest_path.exists():
            raise TargetCacheError(f"{cache} is not a target cache (no {MANIFEST}); build it with `hf-dspark cache`")
        self.manifest = json.loads(manifest_path.read_text())
        cached = self.manifest["target_layer_ids"]
        if layer_ids is not None and any(i not in cached for i in layer_ids):
            raise TargetCacheError(f"{cache} caches target layers {cached} but the drafter reads {list(layer_ids)}; "
                             "rebuild the cache with (a superset of) the drafter's target_layer_ids.")
        self.columns = None if layer_ids is None or list(layer_ids) == cached else [cached.index(i) for i in layer_ids]
        count = shard_count(self.manifest)
        missing = [i for i in range(count) if not (cache / f"shard-{i:05d}.safetensors").exists()]
        if missing:
            raise TargetCacheError(f"{cache} is incomplete ({len(missing)} of {count} shards missing); "
                                    "rerun the same `hf-dspark cache` command to finish it.")
        self.shards = [_map_safetensors(cache / f"shard-{i:05d}.safetensors") for i in range(count)]
        self.index = [(s, j) for s, shard in enumerate(self.shards) for j in range(len(shard["offsets"]) - 1)]
        size = sum(t.numel() * t.element_size() for shard in self.shards for t in shard.values())
        print(f"target cache {cache}: {len(self.index)} examples, {size / 2**30:.2f} GiB memory-mapped")

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> dict:
        shard_index, j = self.index[index]
        shard = self.shards[shard_index]
        lo, hi = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
        features = shard["features"][lo:hi]
        if self.columns is not None:
            features = features.view(hi - lo, len(self.manifest["target_layer_ids"]), -1)[:, self.columns]
            features = features.reshape(hi - lo, -1)
        return {
            "input_ids": shard["input_ids"][lo:hi].long(),
            "loss_mask": shard["loss_mask"][lo:hi].long(),
            "target_features": features,
            "target_final": shard["final"][lo:hi],
            "target_logsumexp": shard["logsumexp"][lo:hi],
            "target_argmax": shard["argmax"][lo:hi].long(),
        }


_DTYPES = {"BF16": (np.uint16, torch.bfloat16), "F32": (np.float32, None), "I64": (np.int64, None),
           "I32": (np.int32, None), "I8": (np.int8, None)}


def _map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Read-only memory map of a safetensors file's tensors (no copy; bfloat16 is viewed through uint16)."""
    with open(path, "rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
    header.pop("__metadata__", None)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_length)
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: unexpected dtype {info['dtype']} for {name}; rebuild the cache")
        storage, view_as = _DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        array = raw[start:end].view(storage).reshape(info["shape"])
        with warnings.catch_warnings():  # the mapping is read-only on purpose: nothing writes into the cache
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        tensors[name] = tensor.view(view_as) if view_as is not None else tensor
    return tensors
