"""How a drafter's `save_pretrained` / `push_to_hub` reach what hf_dspark adds to them (a `custom_generate/` folder,
the model card), without the models importing the hub layer: `hf_dspark.hub` installs the hooks from above."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable


class HubHooks:
    """Set by `hf_dspark.hub` when `import hf_dspark` runs, so that this module never imports the hub layer:
    `save_extras(folder)` writes what stock transformers needs besides the modeling code (`custom_generate/`), and
    `push(drafter, repo_id, **options)` uploads with a model card. Both stay None in a copy of this module loaded
    as remote code without hf_dspark, which then saves and pushes as stock transformers does."""

    save_extras: Callable[[str | Path], Any] | None = None
    push: Callable[..., Any] | None = None


def install_hub_hooks(*, save_extras: Callable[[str | Path], Any], push: Callable[..., Any]) -> None:
    HubHooks.save_extras, HubHooks.push = save_extras, push


def _hub_hooks() -> type[HubHooks]:
    """These hooks, or those of hf_dspark itself when this module is a remote-code copy and hf_dspark is loaded."""
    if HubHooks.save_extras is None and __name__ != "hf_dspark.models.hub_hooks":
        installed = sys.modules.get("hf_dspark.models.hub_hooks")
        if installed is not None and getattr(installed, "HubHooks", None) is not None:
            return installed.HubHooks
    return HubHooks


__all__ = ["HubHooks", "install_hub_hooks"]
