"""Loading a target and drafters by path, placed on a device or spread by a device_map, with the errors a user can
fix as one line; and the drafters shipped for the embedded default target as package data (`hf_dspark/checkpoints/`,
found with importlib.resources, so an installed copy finds them with no repository beside it). The default target
itself, and `load_target`, which falls back to it when no path is given, are `hf_dspark.targets`'. Shared by the
CLI, the evaluation harness and the benchmarks."""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

import torch

from .errors import UserInputError
from .identity import OWN_DRAFTER_TYPES, drafting_core
from .saved_config import read_folder_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHIPPED_KINDS = ("dspark", "dflash", "eagle3")
SHIPPED_CHECKPOINTS = Path(os.fspath(resources.files("hf_dspark") / "checkpoints"))
"""The shipped drafter folders (config.json, model.safetensors, model card, training log and summary; the remote
code and `custom_generate/` are written by `save_pretrained` / `hf-dspark push`, not stored here)."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def read_saved_config(path: str | Path, what: str) -> dict | None:
    """The config.json of a local model folder, None for a Hub id; a missing or broken folder is a UserInputError
    naming the path and the fix."""
    folder = Path(path).expanduser()
    fix = f"pass the folder save_pretrained() wrote for the {what} (config.json and model.safetensors), or a Hub id"
    if folder.is_dir():
        config = read_folder_config(folder, what)
        if config is None:
            raise UserInputError(f"{folder} has no config.json, so it is not a saved {what}; {fix}.")
        return config
    if folder.exists():
        raise UserInputError(f"{path} is a file, not the {what}'s folder; {fix}.")
    if str(path).startswith((".", "/", "~")) or not _HUB_ID.match(str(path)) or str(path).count("/") > 1:
        raise UserInputError(f"no {what} at {path}: no such folder; {fix}.")
    return None  # a Hub id (org/name): transformers fetches it


def _from_pretrained(load, path, what: str, **kwargs):
    """`load(path)` with the errors a user can fix (unreachable Hub id, unreadable weights) as one line."""
    from safetensors import SafetensorError

    try:
        return load(path, **kwargs)
    except SafetensorError as error:
        raise UserInputError(f"the {what}'s weights in {path} cannot be read ({error}): the safetensors file is "
                             "truncated or corrupt; download or save it again.") from error
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if Path(path).expanduser().is_dir():
            raise UserInputError(f"the {what} in {path} cannot be loaded ({first}); save or download it again."
                                 ) from error
        raise UserInputError(f"no local folder {path} and it could not be loaded as a Hub id ({first}); "
                             f"pass the {what}'s folder.") from error


def safetensors_only(load, what: str):
    """``load`` (a `from_pretrained`) reading safetensors files inside the checkpoint folder only: the files it
    would read are resolved and checked first (`checked_weight_files`), and it never falls back to a pickle."""
    from .weight_files import checked_weight_files

    def load_checked(path, **kwargs):
        checked_weight_files(path, what, **kwargs)
        return load(path, use_safetensors=True, **kwargs)

    return load_checked


AUTO_DEVICE = "auto"
"""`device="auto"` (the command line's default, as in `transformers serve`): the machine's accelerator (CUDA, or
XPU / MPS where torch has one) when it has one, else the CPU."""

_DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICE_FIX = "use one that exists here: cpu, or auto (the accelerator if there is one)"


def resolve_device(device: str | int | torch.device) -> torch.device:
    """The `torch.device` that ``device`` names, checked against this machine: "auto" (see `AUTO_DEVICE`), "cpu",
    "cuda", "cuda:1", "mps", an accelerator index (1 = "cuda:1"), ... An accelerator without an index is this
    process's own: under torchrun / accelerate launch the one of its LOCAL_RANK (as transformers' device_map="cuda"),
    else the current one. A device that is not here, or a name torch does not know, is a UserInputError naming it
    and the fix, so a typo fails before any model loads."""
    if isinstance(device, str) and device.strip().lower() == AUTO_DEVICE:
        if not torch.accelerator.is_available():
            return torch.device("cpu")
        device = torch.accelerator.current_accelerator().type
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise UserInputError(f"device must be a name such as 'cpu', 'cuda', 'cuda:1' or 'auto', got {device!r}.")
    if isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None:
            raise UserInputError(f"no device {device} here: an index names an accelerator and this machine has none "
                                 f"that torch {torch.__version__} can use; {_DEVICE_FIX}.")
        device = f"{accelerator.type}:{device}"
    try:
        resolved = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, ValueError):
        raise UserInputError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N, mps or another torch device "
                             "name.") from None
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type == "meta":
        raise UserInputError(f"the meta device holds no weights, so no model can run on it; {_DEVICE_FIX}.")
    try:
        module = torch.get_device_module(resolved.type)
    except (RuntimeError, AttributeError):
        module = None
    available = module is not None and getattr(module, "is_available", lambda: False)()
    if not available:
        raise UserInputError(f"no device {str(resolved)!r} here: this torch ({torch.__version__}) has no usable "
                             f"{resolved.type} device; {_DEVICE_FIX}.")
    count = getattr(module, "device_count", lambda: 1)()
    if resolved.index is None:
        current = module.current_device() if hasattr(module, "current_device") else 0
        resolved = torch.device(resolved.type, int(os.environ.get("LOCAL_RANK", current)))
    if resolved.index >= count:
        raise UserInputError(f"no device {str(resolved)!r} here: this machine has {count} {resolved.type} "
                             f"device{'s' if count != 1 else ''} (indices 0-{count - 1}); {_DEVICE_FIX}.")
    return resolved


def _checked_device_map(device_map):
    """``device_map`` unchanged, once every device it names is checked (`resolve_device`), so a missing GPU is one
    clear line rather than an error from deep inside the loading code."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise UserInputError("a device_map needs accelerate (transformers dispatches the weights with it): install it "
                             "with pip install accelerate, or pass device= instead to place the whole model.")
    if isinstance(device_map, str) and device_map in _DEVICE_MAP_STRATEGIES:
        return device_map
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    for place in places:
        if place not in ("disk", "cpu"):  # "disk" and "cpu" in a device_map are offloads transformers manages
            resolve_device(place)
    return device_map


def placed_from_pretrained(load, path, what: str, *, device=None, device_map=None, **kwargs):
    """``load(path, **kwargs)`` (a `from_pretrained`) placed on ``device`` or spread by ``device_map``, neither of
    which may be given with the other. A single accelerator loads straight onto it when accelerate is installed
    (transformers needs it for any device_map), otherwise on the CPU first; None keeps transformers' default, the
    CPU. Errors a user can fix are UserInputErrors (see `_from_pretrained`)."""
    if device is not None and device_map is not None:
        raise UserInputError(f"the {what} got both device={device!r} and device_map={device_map!r}: pass device to "
                             "put the whole model on one device, or device_map to spread it, not both.")
    if device_map is not None:
        return _from_pretrained(load, path, what, device_map=_checked_device_map(device_map), **kwargs)
    if device is None:
        return _from_pretrained(load, path, what, **kwargs)
    import importlib.util

    device = resolve_device(device)
    if device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        return _from_pretrained(load, path, what, device_map=device, **kwargs)
    return _from_pretrained(load, path, what, **kwargs).to(device)


def load_target_model(path: str | Path, dtype: torch.dtype | None = None, device=None, device_map=None):
    """The target model saved at ``path`` (a folder or a Hub id) in eval mode, without its tokenizer, from
    safetensors files inside its folder only (`safetensors_only`); ``dtype`` None keeps the saved one. A drafter
    folder is refused before anything loads. ``device`` / ``device_map`` as in `placed_from_pretrained`."""
    from transformers import AutoModelForCausalLM

    config = read_saved_config(path, "target")
    if config is not None and config.get("model_type") in OWN_DRAFTER_TYPES:
        raise UserInputError(f"{path} holds an hf_dspark drafter, not a target model; pass it as --drafter and the "
                             "model it drafts for as --target.")
    options = {} if dtype is None else {"dtype": dtype}
    return placed_from_pretrained(safetensors_only(AutoModelForCausalLM.from_pretrained, "target"), path, "target",
                                  device=device, device_map=device_map, **options).eval()


def load_target_tokenizer(path: str | Path):
    """The tokenizer saved with the target at ``path`` (a folder or a Hub id); errors a user can fix are one line
    (see `_from_pretrained`)."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer.from_pretrained, path, "target")


def shipped_drafter_path(kind: str = "dspark") -> Path:
    """The folder of the drafter shipped for the embedded default target (SmolLM2-135M-Instruct): `kind` is
    "dspark", "dflash" or "eagle3". It is package data, so it is found from an installed copy too."""
    if kind not in SHIPPED_KINDS:
        raise UserInputError(f"no shipped {kind!r} drafter; shipped kinds are {', '.join(SHIPPED_KINDS)}.")
    path = SHIPPED_CHECKPOINTS / f"{kind}-smollm2-135m-instruct"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no shipped {kind} drafter at {path}: this hf_dspark installation lacks its package "
                                "data (hf_dspark/checkpoints/); reinstall hf_dspark, or pass --drafter PATH")
    return path


def load_drafter(path: str | Path, dtype: torch.dtype | None, device: str | torch.device | None = None):
    """A saved drafter in eval mode, in any layout `AutoDrafter` reads (hf_dspark's own, DeepSpec's, speculators',
    z-lab DFlash's), on ``device`` (see `resolve_device`; generation moves it beside its target's LM head anyway),
    in ``dtype`` (None: as saved). A folder holding another kind of model (e.g. the target itself) is refused
    before anything is loaded, and weights are read from safetensors files inside the folder only."""
    from .auto import AutoDrafter
    from .formats import layout_of, unread_layout_refusal

    config = read_saved_config(path, "drafter")
    if config is not None and config.get("model_type") not in OWN_DRAFTER_TYPES \
            and layout_of(config) is None and unread_layout_refusal(config, path) is None:  # AutoDrafter names those
        raise UserInputError(
            f"{Path(path) / 'config.json'} has model_type {config.get('model_type')!r} and architectures "
            f"{config.get('architectures')}, so {path} is no drafter layout hf_dspark reads (its own, DeepSpec's, "
            "vllm-project/speculators', z-lab DFlash's, SpecForge's, LiquidAI's LFM2.5 or Kimi K3's DSpark); pass a "
            "drafter folder (a target folder goes to --target)."
        )
    options = {} if dtype is None else {"dtype": dtype}
    # No safetensors_only here: every reader AutoDrafter dispatches to (our classes' from_pretrained, each format's
    # read_checkpoint_tensors) checks the weight files before reading them.
    model = _from_pretrained(AutoDrafter.from_pretrained, str(path), "drafter", **options).eval()
    if drafting_core(model) is None:
        raise UserInputError(f"{path} holds a {type(model).__name__}, not an hf_dspark drafter; pass a drafter.")
    return model if device is None else model.to(resolve_device(device))
