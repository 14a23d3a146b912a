"""The drafting settings a drafter carries as its defaults: fields of its `generation_config`, the transformers way.

transformers keeps an assistant's decoding defaults in the assistant's `generation_config` (`num_assistant_tokens`,
`assistant_confidence_threshold`, ...); a drafter does the same, with `dspark_`-prefixed fields for what transformers
has no name for. They are saved with the drafter (`generation_config.json` beside `config.json`), loaded back by
`from_pretrained`, and any of them may be overridden per `generate()` call by a keyword argument of the same name.
Their meaning and checks live with the decoding loop (`hf_dspark.generation.settings`); this module only holds the
defaults, so that a drafter, built or loaded, always has every field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import GenerationConfig
from transformers.utils import cached_file

from .errors import DrafterLoadError
from .json_files import read_json

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
        values["dspark_cost_table"] = read_json(table, "generation_config.dspark_cost_table, the cost table",
                                                "profile one with `hf-dspark profile --output PATH` or unset it")
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
    saved = read_json(found, "the drafter's generation settings",
                      "restore it from the drafter's original folder, or delete it to use the drafting defaults",
                      DrafterLoadError)
    if not isinstance(saved, dict):
        raise DrafterLoadError(f"{found} is not a JSON object of generation settings; restore or delete it.")
    return with_every_drafting_field(GenerationConfig.from_dict(saved), config)
