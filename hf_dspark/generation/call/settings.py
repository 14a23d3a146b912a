"""Drafting settings of one `generate()` call, resolved once: the drafter's `generation_config` defaults, then the
call's own keyword arguments.

| setting | default | meaning |
| --- | --- | --- |
| `num_assistant_tokens` | None | drafts per round, 1..`num_draft_slots`; None drafts every slot (transformers' name) |
| `assistant_confidence_threshold` | None | stop drafting below this confidence (confidence-headed drafters) |
| `dspark_confidence_threshold_rule` | `"cumulative"` | compare the threshold with c_1...c_j, or `"per_slot"`: c_j |
| `dspark_suffix_drafting` | config | also propose suffix matches over each request's text so far |
| `dspark_round_planning` | True | pick drafter / suffix / plain step per round and request, from earlier rounds |
| `dspark_cost_table` | None | a `VerificationCostTable` (or its JSON path): schedule draft lengths by throughput |
| `dspark_learn_round_costs` | True | price rounds with what the loop measures (plain steps first without a table), the table filling gaps |
| `dspark_verification_policy` | None | `"all"`, `("fixed", k)`, `("threshold", t)`, a scheduler; None derives it |
| `dspark_time_phases` | None | record per-phase seconds (None: on the CPU only) |
| `dspark_state` | the drafter's own | the `DraftingState` the call learns into (`remembered_state`; never saved) |

transformers fills `num_assistant_tokens=20` and `assistant_confidence_threshold=0.4` into every call's generation
config that does not set them, so a call's generation config cannot tell those values from unset ones: they are read
exactly when passed as keyword arguments, and from a `generation_config=` object (or the target's own generation
config) only when they differ from those fills.

A cost table is a `VerificationCostTable`, its fields, or the user's own path (a keyword or `drafter.generation_config`
set in code), read from the working directory. A checkpoint never makes a call read a file: `from_pretrained` turns a
drafter folder's file name into the table's fields, and a call's generation config (possibly the target's
`generation_config.json`) that names a file is refused.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from pathlib import Path

from ...models.configuration_common import CONFIDENCE_THRESHOLD_RULES
from ...models.drafting_config import CALL_ONLY_SETTINGS, DRAFTING_DEFAULTS, OWN_TABLE_FIX
from ...models.errors import UserInputError
from ...models.cost_table import VerificationCostTable
from ...policy.length_rule import POLICIES
from ...policy.state import DraftingState

SETTING_NAMES = tuple(DRAFTING_DEFAULTS) + CALL_ONLY_SETTINGS
PASSED_SETTINGS_KEY = "hf_dspark_drafting_settings"
"""Under this model-input name the `assistant_model=` route hands a call's settings to the decoding method."""
# What transformers' generate() fills into a call's generation config when neither the call nor the target sets them.
_TRANSFORMERS_FILLS = {"num_assistant_tokens": 20, "assistant_confidence_threshold": 0.4}


@dataclass(frozen=True)
class DraftingSettings:
    """The checked settings of one call (see the module's table)."""

    num_assistant_tokens: int
    assistant_confidence_threshold: float | None
    confidence_threshold_rule: str
    suffix_drafting: bool
    round_planning: bool
    cost_table: VerificationCostTable | None
    learn_round_costs: bool
    verification_policy: object
    time_phases: bool | None
    state: DraftingState
    state_given: bool = False  # False: `state` is a fresh one, which the call may swap for its drafter's own

    @classmethod
    def resolve(cls, drafter, call: dict | None = None) -> "DraftingSettings":
        """The drafter's `generation_config` fields overridden by `call` (settings the call passed)."""
        call = dict(call or {})
        unknown = sorted(set(call) - set(SETTING_NAMES))
        if unknown:
            raise UserInputError(f"unknown drafting setting(s) {unknown}; the settings are {list(SETTING_NAMES)}.")
        stored = drafter.generation_config
        value = {name: call[name] if name in call else getattr(stored, name, default)
                 for name, default in DRAFTING_DEFAULTS.items()}
        state = call.get("dspark_state")
        if state is not None and not isinstance(state, DraftingState):
            raise UserInputError(f"dspark_state must be a hf_dspark.DraftingState (or None for the drafter's own), got "
                                 f"{type(state).__name__}.")
        return cls(
            num_assistant_tokens=checked_draft_length(value["num_assistant_tokens"], drafter.config.num_draft_slots),
            assistant_confidence_threshold=_checked_threshold(value["assistant_confidence_threshold"]),
            confidence_threshold_rule=_checked_choice("dspark_confidence_threshold_rule",
                                                      value["dspark_confidence_threshold_rule"],
                                                      CONFIDENCE_THRESHOLD_RULES),
            suffix_drafting=_checked_bool("dspark_suffix_drafting", value["dspark_suffix_drafting"]),
            round_planning=_checked_bool("dspark_round_planning", value["dspark_round_planning"]),
            cost_table=_cost_table(value["dspark_cost_table"], "dspark_cost_table" if "dspark_cost_table" in call
                                   else "generation_config.dspark_cost_table"),
            learn_round_costs=_checked_bool("dspark_learn_round_costs", value["dspark_learn_round_costs"]),
            verification_policy=_checked_policy(value["dspark_verification_policy"]),
            time_phases=None if value["dspark_time_phases"] is None
            else _checked_bool("dspark_time_phases", value["dspark_time_phases"]),
            state=state if state is not None else DraftingState(),
            state_given=state is not None,
        )


def call_settings(generation_config, passed: dict | None = None) -> dict:
    """The settings a call passed: `passed` (its keyword arguments, exactly), plus `dspark_*` fields and non-default
    transformers fields of its generation config (a `generation_config=` object the user built)."""
    found, passed = {}, dict(passed or {})
    for name in set(DRAFTING_DEFAULTS) - set(passed):
        value = getattr(generation_config, name, None)
        if value is not None and value != _TRANSFORMERS_FILLS.get(name):
            found[name] = value
    if "dspark_cost_table" in found:
        found["dspark_cost_table"] = _generation_config_table(found["dspark_cost_table"])
    found.update(passed)
    return found


def _generation_config_table(value):
    """A call's generation config may be the target's own, loaded from its checkpoint's `generation_config.json`:
    data, which may carry a table's fields but never name a file to read (the call's own path is a keyword)."""
    if isinstance(value, dict):
        return VerificationCostTable.from_dict(value, "the call's generation_config.dspark_cost_table",
                                               f"pass a VerificationCostTable, or {OWN_TABLE_FIX}")
    if isinstance(value, (str, os.PathLike)):
        raise UserInputError(
            f"the call's generation_config.dspark_cost_table names a file, {str(value)[:200]!r}: a generation config "
            "(the target's own, loaded from its checkpoint's generation_config.json, or one given as "
            "generation_config=) is never trusted to name a file to read. Remove the field from it and pass a table "
            f"per call instead: a VerificationCostTable, or {OWN_TABLE_FIX}.")
    return value


def checked_draft_length(value, slots: int, name: str = "num_assistant_tokens") -> int:
    """`num_assistant_tokens` (the engine's `draft_length`: `name`) as an int in 1..slots (None: all `slots`)."""
    if value is None:
        return slots
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= slots:
        raise ValueError(
            f"{name} must be an int from 1 to the drafter's {slots} draft slots "
            f"(config.num_draft_slots), or None for all of them; got {value!r}. A drafter predicts only the slots it "
            "was trained for."
        )
    return int(value)


def _checked_threshold(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"assistant_confidence_threshold must be a number >= 0 (above 1 verifies no drafts) or None, "
                         f"got {value!r}.")
    return float(value)


def _checked_choice(name: str, value, choices: tuple) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
    return value


def _checked_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def _cost_table(value, source: str) -> VerificationCostTable | None:
    """The table `value` is: itself, the user's own path (resolved against the working directory; a checkpoint's
    file names were read into fields by `from_pretrained`), or its fields, checked and named by `source`."""
    if value is None or isinstance(value, VerificationCostTable):
        return value
    if isinstance(value, (str, Path)):
        return VerificationCostTable.load(value)
    if isinstance(value, dict):
        return VerificationCostTable.from_dict(value, source, f"pass a VerificationCostTable, or {OWN_TABLE_FIX}")
    raise ValueError(f"dspark_cost_table must be a VerificationCostTable, the path of its JSON or None, got "
                     f"{type(value).__name__}.")


def _checked_policy(policy):
    """The policy as given, once its shape is known to be one (its argument is checked by `DraftLengthRule`)."""
    if policy is None or hasattr(policy, "select_lengths"):
        return policy
    name = policy if isinstance(policy, str) else policy[0] if isinstance(policy, (tuple, list)) and len(policy) == 2 \
        else None
    if name not in POLICIES:
        raise ValueError(f"dspark_verification_policy must be None, one of {POLICIES}, a (policy, argument) pair "
                         f"such as ('fixed', 2), or a scheduler; got {policy!r}.")
    return tuple(policy) if isinstance(policy, list) else policy


