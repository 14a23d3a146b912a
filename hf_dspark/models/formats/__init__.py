"""Drafter checkpoints in other projects' layouts, read into hf_dspark drafters in memory: DeepSpec's
(`Qwen3DSparkModel`, `Qwen3Eagle3Model`, and for Gemma 4 `Gemma4DSparkModel`, `Gemma4Eagle3Model`: `deepspec_gemma4`),
`vllm-project/speculators`' (`speculator_model`) and z-lab DFlash's (`DFlashDraftModel`, `DFlash2DraftModel`). One
module per layout, each with `FORMAT`, `matches(config)` and `load(folder, config)`.

`load_layout` is what `DSparkDraftModel.from_pretrained`, `Eagle3DraftModel.from_pretrained` and
`hf_dspark.AutoDrafter.from_pretrained` call when a folder's config.json is not hf_dspark's own, so every published
drafter loads with no convert step; `layout_name` lets `generate()` name the loader when such a folder was loaded by
a stock class instead (`AutoModel` maps DeepSpec's `model_type: qwen3` to a plain `Qwen3Model`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.utils import logging

from ..errors import DrafterLoadError, UserInputError
from ..identity import OWN_DRAFTER_TYPES
from ..saved_config import install_layout_converters

logger = logging.get_logger(__name__)

LOADER_CALL = "hf_dspark.AutoDrafter.from_pretrained(path)"
"""The call that loads every layout; refusals name it."""

_HUB_OPTIONS = ("cache_dir", "force_download", "proxies", "token", "local_files_only", "revision")
_LOAD_OPTIONS = ("dtype", "torch_dtype", "device_map", "subfolder", "use_safetensors", "trust_remote_code")
"""The `from_pretrained` options a converted layout honours; anything else is refused, not ignored."""


def _layouts():
    from . import deepspec, k3_dspark, lfm2_dspark, specforge_dspark, speculators, target_mtp, zlab_dflash

    # The layouts published since DeepSpec first: SpecForge's and LiquidAI's are Qwen3 configs with a dflash_config,
    # which z-lab's reader would otherwise claim; a target checkpoint with a DSpark module is target_mtp's.
    return (specforge_dspark, lfm2_dspark, k3_dspark, target_mtp, deepspec, speculators, zlab_dflash)


# Drafter layouts hf_dspark knows and does not read, by config.json model_type: what the folder holds, why it is not
# read, and what runs it. They stay out of `layout_of` on purpose: generate() refuses an assistant whose config is in a
# layout hf_dspark reads (`refuse_a_drafter_loaded_without_its_heads`), and these are transformers' own assistants,
# which its own generate() must run with `import hf_dspark` exactly as without it (tests/coexistence/test_transformers_paths.py).
UNREAD_LAYOUTS = {
    "muse_glimmer_assistant": (
        "a Muse Glimmer DFlash assistant (model_type 'muse_glimmer_assistant', MuseGlimmerAssistantModel), the block "
        "drafter transformers runs itself, which hf_dspark does not read: its layers are z-lab DFlash's under other "
        "names (encoder.fc / encoder.output_norm_enc, block_size / mask_token_id / target_layer_ids at the top level "
        "of config.json), but every layer attends bidirectionally within an inclusive sliding window, the block is "
        "embedded with the target's raw embedding rows (bypassing the normed embedding of Muse Glimmer), and its "
        "target, the multimodal MuseGlimmerForConditionalGeneration, is not one hf_dspark's decoding loop runs. Use "
        "transformers' own DFlash: load it with transformers.AutoModel.from_pretrained(path) and call "
        "target.generate(ids, assistant_model=assistant, speculation_type=\"dflash\")"
    ),
}


def unread_layout_refusal(config: dict, path) -> str | None:
    """Why the drafter folder `path` (its config.json read as `config`) is refused, when it is in one of the
    `UNREAD_LAYOUTS`; None otherwise."""
    what = UNREAD_LAYOUTS.get(config.get("model_type"))
    return None if what is None else f"{path} holds {what}."


def layout_of(config: dict):
    """The format module whose layout `config` (a config.json dict) is in, or None (hf_dspark's own, or none)."""
    if config.get("model_type") in OWN_DRAFTER_TYPES:
        return None
    return next((module for module in _layouts() if module.matches(config)), None)


def layout_name(config) -> str | None:
    """`"DeepSpec (Qwen3DSparkModel)"`-style name of the drafter layout a config (dict or `PreTrainedConfig`)
    describes, None when it describes no drafter hf_dspark reads."""
    config = config if isinstance(config, dict) else config.to_dict()
    module = layout_of(config)
    if module is None:
        return None
    what = config.get("speculators_model_type") or ", ".join(config.get("architectures") or []) or "drafter"
    return f"{module.FORMAT} ({what})"


def _local_snapshot(path, options: dict, patterns=("*.json", "*.safetensors")) -> Path:
    """A Hub repository's config and safetensors files (`patterns`) in the local cache (downloaded if needed)."""
    from huggingface_hub import snapshot_download

    hub = {k: options[k] for k in _HUB_OPTIONS if options.get(k) is not None}
    folder = snapshot_download(str(path), allow_patterns=list(patterns), **hub)
    return Path(folder) / (options.get("subfolder") or "")


def load_layout(path, config: dict, module, expected_class=None, **options):
    """Load the drafter at `path` whose config.json (`config`) is in `module`'s layout, converted in memory;
    `expected_class` (when a class's own from_pretrained was called) must be what the checkpoint holds."""
    unknown = sorted(k for k, v in options.items() if k not in (*_HUB_OPTIONS, *_LOAD_OPTIONS) and v is not None)
    if unknown:
        raise UserInputError(f"{path} is a {module.FORMAT} checkpoint, converted to hf_dspark's layout while it loads; "
                             f"these from_pretrained options do not apply to it: {unknown}. Drop them.")
    if options.get("use_safetensors") is False:
        raise UserInputError("hf_dspark drafters load weights from safetensors only; drop use_safetensors=False.")
    folder = Path(path).expanduser() / (options.get("subfolder") or "")
    if not folder.is_dir():  # a target checkpoint's module: its config and index only (`SNAPSHOT_PATTERNS`)
        folder = _local_snapshot(path, options, getattr(module, "SNAPSHOT_PATTERNS", ("*.json", "*.safetensors")))
    model = module.load(folder, config)
    if expected_class is not None and not isinstance(model, expected_class):
        raise DrafterLoadError(f"{path} holds a {module.FORMAT} drafter that loads as {type(model).__name__}, not "
                               f"{expected_class.__name__}; load it with {LOADER_CALL}, which picks the class.")
    logger.warning("hf_dspark: %s is a %s checkpoint; converted to %s in memory (nothing written).", path,
                   layout_name(config), type(model).__name__)
    return _placed(model, options)


def _placed(model, options: dict):
    dtype = options.get("dtype", options.get("torch_dtype"))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, dtype)  # "bfloat16" -> torch.bfloat16; anything else is refused below
    if isinstance(dtype, torch.dtype):
        model = model.to(dtype)
    elif dtype not in (None, "auto"):
        raise UserInputError(f"dtype={dtype!r} is not a torch dtype; pass e.g. torch.bfloat16 or 'float32'.")
    place = options.get("device_map")
    if isinstance(place, dict):
        places = set(place.values())
        if len(places) > 1:
            raise UserInputError(f"device_map={place!r} spreads the drafter over several devices; a drafter runs "
                                 "whole beside its target's LM head: pass one device (or none: generate() moves it).")
        place = next(iter(places), None)
    if place is not None and place != "auto":
        model = model.to(place)
    return model.eval()


# The drafter classes' own from_pretrained converts these layouts too, through this hook (they cannot import this
# package, which imports them).
install_layout_converters(layout_of=layout_of, load_layout=load_layout)
