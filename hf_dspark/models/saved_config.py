"""What a drafter folder's config.json says, read before any weight: the layout it is in (another project's is
converted while it loads) and the fields without which loading would fill in defaults that change the drafter's
outputs. One reader of config.json for the drafter classes, `AutoDrafter` and the model loaders."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from transformers import PreTrainedConfig

from .config_checks import check_config_fields, check_identity_fields
from .errors import DrafterLoadError, UserInputError
from .folder_files import checked_file
from .identity import OWN_DRAFTER_TYPES
from .weight_files import HUB_OPTIONS


def read_folder_config(folder: str | Path, what: str, error: type[UserInputError] = UserInputError) -> dict | None:
    """`folder/config.json` as a dict, None when the folder has none; a file that is not JSON, a link out of the
    folder, or a `model_type` / `architectures` of the wrong kind raises `error` (a `UserInputError`) naming the file
    and the fix. `what` names the model the folder should hold ("drafter")."""
    config_file = Path(folder) / "config.json"
    if not os.path.lexists(config_file):
        return None
    checked_file(config_file, folder, error)  # a link out of the folder, or a pipe, is never opened
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as problem:
        raise error(f"{config_file} is not valid JSON ({problem}); restore the {what}'s folder from its original "
                    f"copy, or save the {what} again.") from None
    if not isinstance(config, dict):
        raise error(f"{config_file} holds a JSON {type(config).__name__}, not the object of fields a config.json is; "
                    f"restore the {what}'s folder from its original copy, or save the {what} again.")
    check_identity_fields(config, str(config_file))
    return config


def read_config(path, options: dict) -> tuple[dict, Path | None]:
    """(config.json of the drafter at `path` as a dict, the local folder it is in; None for a Hub id not downloaded
    here). `options` are `from_pretrained`'s keyword arguments: `subfolder` and the Hub options are honoured."""
    folder = Path(path).expanduser() / (options.get("subfolder") or "")
    if folder.is_dir():
        config = read_folder_config(folder, "drafter", DrafterLoadError)
        if config is None:
            raise DrafterLoadError(f"{folder} has no config.json, so it is not a saved drafter; pass the folder "
                                   f"save_pretrained() (or the project that made it) wrote.")
        return config, folder
    hub = {k: options[k] for k in HUB_OPTIONS if options.get(k) is not None}
    config, _ = PreTrainedConfig.get_config_dict(str(path), **hub)
    check_identity_fields(config, f"config.json of {str(path)!r}")
    return config, None


class LayoutConverters:
    """Set by `hf_dspark.models.formats` when it is imported (any import of `hf_dspark.models` does), so that the
    drafter classes convert other projects' layouts without importing the converters, which import the classes:
    `layout_of(config)` names the layout module of a config.json dict (None for hf_dspark's own), and
    `load_layout(path, config, module, expected_class=..., **options)` loads it converted. Both stay None in a copy
    of this module saved as remote code where hf_dspark is not installed: that copy reads only its own layout."""

    layout_of: Callable[[dict], Any] | None = None
    load_layout: Callable[..., Any] | None = None


def install_layout_converters(*, layout_of: Callable[[dict], Any], load_layout: Callable[..., Any]) -> None:
    LayoutConverters.layout_of, LayoutConverters.load_layout = layout_of, load_layout


def _layout_converters() -> type[LayoutConverters]:
    """These converters, or those of hf_dspark itself when this module is a remote-code copy and hf_dspark is
    installed (importing it installs them)."""
    if LayoutConverters.layout_of is None and __name__ != "hf_dspark.models.saved_config":
        try:
            return importlib.import_module("hf_dspark.models.saved_config").LayoutConverters
        except ImportError:
            pass
    return LayoutConverters


def load_other_layout(cls, path, kwargs: dict):
    """The drafter at `path` converted in memory when its config.json is another project's layout (DeepSpec,
    speculators, z-lab DFlash; `formats.load_layout`), else None (hf_dspark's own layout, or nothing readable:
    the stock path then says what is wrong)."""
    if path is None or kwargs.get("config") is not None:  # AutoModel already read an hf_dspark config
        return None
    converters = _layout_converters()
    if converters.layout_of is None:  # a remote-code copy without hf_dspark: its own layout only
        return None
    try:
        config, _ = read_config(path, kwargs)
    except (OSError, ValueError):
        return None
    module = converters.layout_of(config)
    if module is None:
        return None
    if kwargs.pop("output_loading_info", False):
        raise UserInputError(f"{path} is a {module.FORMAT} checkpoint, converted while it loads, so there is no "
                             "transformers loading report: drop output_loading_info (the conversion is strict).")
    return converters.load_layout(path, config, module, expected_class=cls, **kwargs)


def check_saved_config(cls, path, kwargs: dict) -> tuple[dict, str] | None:
    """Refuse a drafter folder whose config.json names another architecture, lacks a field whose default would
    silently change the drafter's outputs (`config_class.required_saved_fields`), or has a field of the wrong type,
    range or consistency (`config_checks`); return (the config.json dict, the name of the file) for the checks of
    the weights against it. Unreadable folders are left to `from_pretrained`'s own error (None)."""
    folder = Path(path).expanduser() / (kwargs.get("subfolder") or "")
    if folder.is_dir():
        saved = read_folder_config(folder, "drafter", DrafterLoadError)
        if saved is None:
            return None
        source = str(folder / "config.json")
    else:
        source = f"config.json of {str(path)!r}"
        try:
            saved, _ = PreTrainedConfig.get_config_dict(path, **{k: kwargs[k] for k in HUB_OPTIONS if k in kwargs})
        except OSError:
            return None
    expected = cls.config_class.model_type
    found = saved.get("model_type")
    if found != expected:
        if found in OWN_DRAFTER_TYPES:
            fix = "load it with AutoModel.from_pretrained (after `import hf_dspark`), which picks the class from it"
        else:
            fix = ("it is not a drafter layout hf_dspark reads (its own, DeepSpec's, vllm-project/speculators' or "
                   "z-lab DFlash's, which hf_dspark.AutoDrafter.from_pretrained(path) and this class load directly, "
                   "and `hf-dspark convert` writes out): pass a folder written by `hf-dspark train`, a drafter's "
                   "save_pretrained() or one of those projects")
        raise DrafterLoadError(f"{source} has model_type {found!r}, but {cls.__name__} is {expected!r}: {fix}.")
    for field, hint in getattr(cls.config_class, "required_saved_fields", {}).items():
        if saved.get(field) is None:
            legacy = saved.get("rope_theta") if field == "rope_parameters" else None
            extra = f" (it has the old field rope_theta={legacy}: move it into rope_parameters)" if legacy else ""
            raise DrafterLoadError(f"{source} has no {field!r}{extra}. {hint}")
    rope = saved.get("rope_parameters")
    if "rope_parameters" in getattr(cls.config_class, "required_saved_fields", {}) and not (
        isinstance(rope, dict) and "rope_theta" in rope
    ):
        raise DrafterLoadError(f"{source} has rope_parameters {rope!r} without a rope_theta. "
                               f"{cls.config_class.required_saved_fields['rope_parameters']}")
    check_config_fields(saved, source, kind=cls.config_class.config_kind)
    return saved, source


__all__ = ["LayoutConverters", "check_saved_config", "install_layout_converters", "load_other_layout", "read_config",
           "read_folder_config"]
