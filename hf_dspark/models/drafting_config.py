"""The drafting settings a drafter carries as its defaults: fields of its `generation_config`, the transformers way.

transformers keeps an assistant's decoding defaults in the assistant's `generation_config` (`num_assistant_tokens`,
`assistant_confidence_threshold`, ...); a drafter does the same, with `dspark_`-prefixed fields for what transformers
has no name for. They are saved with the drafter (`generation_config.json` beside `config.json`), loaded back by
`from_pretrained`, and any of them may be overridden per `generate()` call by a keyword argument of the same name.
Their meaning and checks live with the decoding loop (`hf_dspark.generation.call.settings`); this module holds the
defaults, so that a drafter, built or loaded, always has every field, and checks the one field that can name a file.

A drafter folder is data from the Hub: its `dspark_cost_table` is the table's fields inline (as `save_pretrained` writes
it) or the name of a JSON file inside the folder itself (relative, no `..`, no symlink out of it, a regular file of at
most 1 MiB), fetched like the config (`cached_file`) for a Hub id; anything else is refused by `from_pretrained`, and a
named file is read there and kept inline, so that nothing is read later against the working directory. A path a user
sets in code or passes to `generate()` is theirs, read where they run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable

from transformers import GenerationConfig
from transformers.utils import cached_file

from .config_checks import is_finite_number
from .errors import DrafterLoadError, UserInputError
from .folder_files import checked_file, resolves_inside
from .json_files import SMALL_JSON_BYTES, read_json

DRAFTING_DEFAULTS = {
    "num_assistant_tokens": None,
    "assistant_confidence_threshold": None,
    "dspark_confidence_threshold_rule": "cumulative",
    "dspark_suffix_drafting": False,
    "dspark_round_planning": True,
    "dspark_cost_table": None,
    "dspark_learn_round_costs": True,
    "dspark_verification_policy": None,
    "dspark_time_phases": None,
}
"""Every drafting setting and its default (a drafter config's `suffix_drafting` / `confidence_threshold_rule` seed
the two fields of the same meaning, as transformers seeds a generation config from a model config)."""

CALL_ONLY_SETTINGS = ("dspark_state",)
"""Settings a `generate()` call may pass that are never saved: the learning state object."""

GENERATION_CONFIG_FILE = "generation_config.json"
COST_TABLE_FIELDS = ("seconds", "draft_seconds", "description")
# The times a cost table may hold: a forward faster than a nanosecond or slower than a day is not a measurement, and
# prices that far apart divide to infinities or zeros in the admission rule.
MIN_TABLE_SECONDS, MAX_TABLE_SECONDS = 1e-9, 86400.0
OWN_TABLE_FIX = ("profile a table of your own (`hf-dspark profile --output my-costs.json`) and pass it per call: "
                 "generate(..., dspark_cost_table=\"my-costs.json\")")
_CHECKPOINT_FIX = (f"restore the drafter folder, remove dspark_cost_table from its {GENERATION_CONFIG_FILE}, "
                   f"or {OWN_TABLE_FIX}")


def drafting_generation_config(config) -> GenerationConfig:
    """A new drafter's `generation_config`: the defaults, seeded from its model config."""
    values = dict(DRAFTING_DEFAULTS)
    values["dspark_suffix_drafting"] = bool(getattr(config, "suffix_drafting", False))
    values["dspark_confidence_threshold_rule"] = getattr(config, "confidence_threshold_rule", None) or "cumulative"
    return GenerationConfig(**values)


def with_every_drafting_field(generation_config: GenerationConfig, config) -> GenerationConfig:
    """`generation_config` with the fields it lacks (a file written before a field existed) from the defaults."""
    defaults = drafting_generation_config(config)
    for name in DRAFTING_DEFAULTS:
        if not hasattr(generation_config, name):
            setattr(generation_config, name, getattr(defaults, name))
    return generation_config


def save_drafting_config(generation_config: GenerationConfig, folder: str | Path) -> None:
    """Write `generation_config.json` with the drafting fields as JSON: a cost table object becomes its fields."""
    values = generation_config.to_dict()
    table = values.get("dspark_cost_table")
    if dataclasses.is_dataclass(table):
        values["dspark_cost_table"] = dataclasses.asdict(table)
    elif isinstance(table, (str, Path)):  # a path would not travel with the folder (push_to_hub): keep the table
        fix = "profile one with `hf-dspark profile --output PATH` or unset it"
        values["dspark_cost_table"] = read_json(table, "generation_config.dspark_cost_table, the cost table", fix,
                                                max_bytes=SMALL_JSON_BYTES)
        problem = cost_table_problem(values["dspark_cost_table"])
        if problem is not None:
            raise UserInputError(f"generation_config.dspark_cost_table: {table} is not a cost table: {problem}; "
                                 f"{fix}.")
    elif isinstance(table, dict) and (problem := cost_table_problem(table)) is not None:  # refused when loaded
        raise UserInputError(f"generation_config.dspark_cost_table is not a cost table: {problem}; "
                             "set a VerificationCostTable or the fields `hf-dspark profile` writes, or unset it.")
    policy = values.get("dspark_verification_policy")
    if policy is not None and not isinstance(policy, (str, list, tuple)):
        raise ValueError(
            f"generation_config.dspark_verification_policy is a {type(policy).__name__} object, which a JSON file "
            "cannot hold. Save a policy name or a (policy, argument) pair, e.g. ('threshold', 0.4); pass scheduler "
            "objects per call: generate(..., dspark_verification_policy=scheduler)."
        )
    values.pop("transformers_version", None)
    saved = GenerationConfig.from_dict(values)
    saved.save_pretrained(folder)


def load_drafting_config(folder: str | Path, config, **hub_options) -> GenerationConfig:
    """The drafter's saved `generation_config.json` (a local folder or a Hub id, with `subfolder` and the other hub
    options of `from_pretrained`), completed with defaults; the defaults alone when there is none (a folder of another
    layout, or written before drafters saved one). A file that exists but cannot be read or fetched is an error, not a
    silent fall back to the defaults."""
    try:
        found = cached_file(str(folder), GENERATION_CONFIG_FILE, _raise_exceptions_for_missing_entries=False,
                            **hub_options)
    except OSError as error:
        raise DrafterLoadError(f"the {GENERATION_CONFIG_FILE} of {folder} cannot be fetched ({error}); check the "
                               "connection and access to the repository, then load the drafter again.") from None
    if found is None:
        return drafting_generation_config(config)
    checked_file(found, os.path.dirname(found), DrafterLoadError)  # a link out of the folder is never read
    saved = read_json(found, "the drafter's generation settings",
                      "restore it from the drafter's original folder, or delete it to use the drafting defaults",
                      DrafterLoadError, SMALL_JSON_BYTES)
    if not isinstance(saved, dict):
        raise DrafterLoadError(f"{found} is not a JSON object of generation settings; restore or delete it.")
    if saved.get("dspark_cost_table") is not None:
        saved["dspark_cost_table"] = checkpoint_cost_table(saved["dspark_cost_table"], folder, found, hub_options)
    return with_every_drafting_field(GenerationConfig.from_dict(saved), config)


class DraftingSettingsCheck:
    """Set by `hf_dspark.generation` when it is imported (the rules live with the decoding loop, above this layer):
    `check(drafter)` raises a ValueError naming the first drafting setting of `drafter.generation_config` that every
    `generate()` call would refuse. None in a remote-code copy without hf_dspark, whose first generate() checks."""

    check: Callable[[Any], Any] | None = None


def install_drafting_settings_check(check: Callable[[Any], Any]) -> None:
    DraftingSettingsCheck.check = check


def check_saved_settings(drafter, source: str) -> None:
    """Refuse at load, not at the first `generate()`, a drafting setting the drafter's saved generation config
    (`source`, its generation_config.json) holds that every call would refuse: a DrafterLoadError naming the file,
    the field and the fix."""
    if DraftingSettingsCheck.check is None:
        return
    try:
        DraftingSettingsCheck.check(drafter)
    except ValueError as error:
        raise DrafterLoadError(f"{source}: {' '.join(str(error).split())} Fix the field in the file, or delete it to "
                               "use its default.") from None


def checkpoint_cost_table(value, folder, found: str, hub_options: dict) -> dict:
    """The cost table a drafter folder's `generation_config.json` (`found`) carries, as its checked fields: `value`
    inline, or read from the file inside the folder it names (`cached_file` for a Hub id). A DrafterLoadError naming
    the field, the file and the fix otherwise."""
    where = f"{found} (dspark_cost_table)"
    if isinstance(value, str):
        value, path = _read_folder_table(value, folder, found, hub_options)
        where = f"{where}: {path}"
    elif not isinstance(value, dict):
        raise DrafterLoadError(f"{found} (dspark_cost_table) is {repr(value)[:80]}, neither the cost table's "
                               "fields (as save_pretrained writes them) nor the name of a JSON file inside the drafter "
                               f"folder; {_CHECKPOINT_FIX}.")
    problem = cost_table_problem(value)
    if problem is not None:
        raise DrafterLoadError(f"{where} is not a cost table: {problem}; {_CHECKPOINT_FIX}.")
    return value


def _read_folder_table(name: str, folder, found: str, hub_options: dict) -> tuple[object, str]:
    """The JSON value stored in the file `name` of the drafter folder, and the file read; refused unless `name` is
    a plain relative path inside the folder that, once its symlinks are resolved, is still inside it (a Hub cache
    snapshot's links into its own `blobs/` excepted), naming a regular file of at most `SMALL_JSON_BYTES`."""
    source = f"{found} (dspark_cost_table)"
    problem = _name_problem(name)
    if problem is not None:
        raise DrafterLoadError(f"{source} names {name[:200]!r}, which {problem}: a drafter folder may name only a "
                               f"file inside itself; {_CHECKPOINT_FIX}.")
    base = os.path.dirname(found)
    if os.path.isdir(str(folder)):  # a local folder, as cached_file tells them apart
        path = os.path.join(base, name)
        path = path if os.path.lexists(path) else None
    else:
        try:
            path = cached_file(str(folder), name, _raise_exceptions_for_missing_entries=False, **hub_options)
        except (OSError, ValueError) as error:
            raise DrafterLoadError(f"{source} names {name!r}, which cannot be fetched from {folder} ({error}); check "
                                   f"the connection and access to the repository, {_CHECKPOINT_FIX}.") from None
    if path is None:
        raise DrafterLoadError(f"{source} names {name!r}, which is not in the drafter folder {base}; "
                               f"{_CHECKPOINT_FIX}.")
    if not resolves_inside(path, base):
        raise DrafterLoadError(f"{source} names {name!r}, a link that leads outside the drafter folder {base}: a "
                               f"drafter folder may name only a file inside itself; {_CHECKPOINT_FIX}.")
    return read_json(path, f"{source}: the cost table", _CHECKPOINT_FIX, DrafterLoadError, SMALL_JSON_BYTES), path


def _name_problem(name: str) -> str | None:
    """Why `name` is not a relative path inside a folder, or None."""
    if not name or "\x00" in name:
        return "is not a file name"
    if os.path.isabs(name) or PureWindowsPath(name).drive or PureWindowsPath(name).root:
        return "is an absolute path, outside the drafter folder"
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return "leads outside the drafter folder"
    return None


def cost_table_problem(stored) -> str | None:
    """What is wrong with `stored` as the fields of a `VerificationCostTable` (`hf_dspark.policy`), naming the
    field, or None: 'seconds' a non-empty list of finite times > 0 (the forward over 1, 2, ... tokens),
    'draft_seconds' a finite time >= 0, 'description' an object (its 'rows', when given, an int >= 1), nothing else."""
    if not isinstance(stored, dict):
        return (f"a JSON {type(stored).__name__}, not an object with a list of 'seconds' and optional "
                "'draft_seconds' and 'description'")
    unknown = sorted(repr(key)[:40] for key in set(stored) - set(COST_TABLE_FIELDS))
    if unknown:
        return f"unknown field(s) {', '.join(unknown[:8])} (a cost table has only {', '.join(COST_TABLE_FIELDS)})"
    seconds = stored.get("seconds")
    if not isinstance(seconds, (list, tuple)) or not seconds:
        return (f"field 'seconds' is {repr(seconds)[:80]}, not a non-empty list of the seconds of a forward over 1, "
                "2, ... tokens")
    for index, value in enumerate(seconds):
        if not (is_finite_number(value) and MIN_TABLE_SECONDS <= value <= MAX_TABLE_SECONDS):
            return (f"field 'seconds'[{index}] is {repr(value)[:80]}, not a number of seconds from "
                    f"{MIN_TABLE_SECONDS} to {MAX_TABLE_SECONDS}")
    draft = stored.get("draft_seconds", 0.0)
    if not (is_finite_number(draft) and 0 <= draft <= MAX_TABLE_SECONDS):
        return f"field 'draft_seconds' is {repr(draft)[:80]}, not a number of seconds from 0 to {MAX_TABLE_SECONDS}"
    description = stored.get("description", {})
    if not isinstance(description, dict):
        return f"field 'description' is a {type(description).__name__}, not an object"
    rows = description.get("rows", 1)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        return f"field 'description.rows' is {repr(rows)[:80]}, not an int >= 1 (the batch size it was profiled for)"
    return None
