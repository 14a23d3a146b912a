"""What `generate()` calls without `dspark_state=` learn into: one `DraftingState` per drafter, target, device, dtype
and thread count, kept while the drafter and the target live. A later call then starts from what earlier ones
measured: this machine's round costs (a plain step, each verification width, the drafter's pass) and how often suffix
proposals are accepted, instead of spending its first rounds measuring them again (plain steps, then probes that
do not pay).

Outputs never depend on it: a round's plan reads only earlier rounds, and the verifier keeps every output the
target's whatever is verified. Speed alone does. A call that finds the state in use (another thread generating with
the same drafter and target) learns into a fresh one, so no state is ever shared by two running calls. Pass
`dspark_state=DraftingState()` for a call that starts fresh, or one state of your own to choose what calls share.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import replace

import torch

from ...scheduling.drafting_state import DraftingState

_LOCK = threading.Lock()
# drafter -> target -> (device, dtype, threads) -> [state, in use]
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextmanager
def remembered_state(drafter, target, plan):
    """`plan` with the drafter's own state for `target` while the call runs (the plan unchanged when the call gave
    a state of its own, or when another call holds that one)."""
    if plan.settings.state_given:
        yield plan
        return
    key = (str(target.device), target.dtype, torch.get_num_threads())
    with _LOCK:
        per_target = _STATES.setdefault(drafter, weakref.WeakKeyDictionary())
        held = per_target.setdefault(target, {}).setdefault(key, [DraftingState(), False])
        taken = not held[1]
        held[1] = True
    if not taken:
        yield plan
        return
    try:
        yield replace(plan, settings=replace(plan.settings, state=held[0]))
    finally:
        with _LOCK:
            held[1] = False
