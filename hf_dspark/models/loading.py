"""Loading a target and drafters by path or by default: the embedded SmolLM2 target and the drafters shipped for
it as package data (`hf_dspark/checkpoints/`, found with importlib.resources, so an installed copy finds them with
no repository beside it). Shared by the CLI, the evaluation harness and the benchmarks."""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path

import torch

from .common import BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE, UserInputError, drafter_type

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
        config = folder / "config.json"
        if not config.is_file():
            raise UserInputError(f"{folder} has no config.json, so it is not a saved {what}; {fix}.")
        try:
            return json.loads(config.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise UserInputError(f"{config} is not valid JSON ({error}); restore the {what}'s folder.") from None
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


def load_target(path: str | None, dtype: str):
    """(model, tokenizer) of the target at ``path``, or of the embedded SmolLM2 default when ``path`` is None."""
    if path is None:
        from .default_target import load_default_target

        return load_default_target(dtype=DTYPES[dtype])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = read_saved_config(path, "target")
    if config is not None and config.get("model_type") in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE):
        raise UserInputError(f"{path} holds an hf_dspark drafter, not a target model; pass it as --drafter and the "
                             "model it drafts for as --target.")
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained, path, "target", dtype=DTYPES[dtype]).eval()
    return model, _from_pretrained(AutoTokenizer.from_pretrained, path, "target")


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


def load_drafter(path: str | Path, dtype: torch.dtype):
    """A saved drafter in eval mode (`import hf_dspark` has registered its classes with `AutoModel`). A folder
    holding another kind of model (e.g. the target itself) is refused before anything is loaded."""
    from transformers import AutoModel  # the drafter classes are registered on `import hf_dspark`, our parent

    config = read_saved_config(path, "drafter")
    if config is not None and config.get("model_type") not in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE):
        raise UserInputError(
            f"{Path(path) / 'config.json'} has model_type {config.get('model_type')!r}, so {path} is not an "
            f"hf_dspark drafter ({BLOCK_DRAFTER_TYPE!r} or {EAGLE3_DRAFTER_TYPE!r}); pass a folder written by "
            "`hf-dspark train` or a drafter's save_pretrained() (a target folder goes to --target)."
        )
    model = _from_pretrained(AutoModel.from_pretrained, str(path), "drafter", dtype=dtype).eval()
    if drafter_type(model) is None:
        raise UserInputError(f"{path} holds a {type(model).__name__}, not an hf_dspark drafter; pass a drafter.")
    return model
