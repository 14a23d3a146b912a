"""What `generate()` calls without `dspark_state=` learn into: one `DraftingState` per drafter, target, device, dtype
and thread count, kept while the drafter and the target live, so a later call starts from this machine's prices and
the acceptance earlier calls measured instead of measuring them again. Outputs never depend on it (a plan reads only
earlier rounds; the verifier keeps every output the target's). A call that finds the state in use (another thread)
learns into a fresh one; a `SpeculativeEngine` built directly holds its drafter's state while it lives.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import replace

import torch

from .state import DraftingState

_LOCK = threading.Lock()
# drafter -> target -> (device, dtype, threads) -> [state, in use]
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _claim(drafter, target, plan) -> list | None:
    """The drafter's own [state, in use] entry for `target`, marked in use; None when `plan` has a state of its own
    or another holder has the drafter's."""
    if plan.settings.state_given:
        return None
    key = (str(target.device), target.dtype, torch.get_num_threads())
    with _LOCK:
        per_target = _STATES.setdefault(drafter, weakref.WeakKeyDictionary())
        held = per_target.setdefault(target, {}).setdefault(key, [DraftingState(), False])
        if held[1]:
            return None
        held[1] = True
        return held


def _release(held: list) -> None:
    with _LOCK:
        held[1] = False


@contextmanager
def remembered_state(drafter, target, plan):
    """`plan` with the drafter's own state for `target` while the call runs (the plan unchanged when the call gave
    a state of its own, or when another call holds that one)."""
    held = _claim(drafter, target, plan)
    if held is None:
        yield plan
        return
    try:
        yield replace(plan, settings=replace(plan.settings, state=held[0]))
    finally:
        _release(held)


def hold_remembered_state(owner, drafter, target, plan):
    """`plan` with the drafter's own state for `target` for as long as `owner` (a `SpeculativeEngine`) lives, so an
    engine starts from what earlier calls measured and leaves what it learns (as `remembered_state`)."""
    held = _claim(drafter, target, plan)
    if held is None:
        return plan
    weakref.finalize(owner, _release, held)
    return replace(plan, settings=replace(plan.settings, state=held[0]))
