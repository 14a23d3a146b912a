"""Upload a drafter to the Hugging Face Hub (or any server `HF_ENDPOINT` points at) with its model card.

The uploaded folder is what `save_pretrained` writes (config, safetensors, the modeling code with `auto_map`, and
`custom_generate/`) plus a `README.md` card: the card given, else the one in the folder the drafter was loaded
from, else one rendered from
`hf_dspark/hub/templates/drafter_card.md`; `eval_results` (an `hf-dspark eval` results.json) replaces its Measured section.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from huggingface_hub import HfApi

from ..models.common import drafter_kind
from .model_card import default_model_card, eval_results_table, replace_measured


def stage_drafter(drafter, folder: str | Path, *, card: str | None = None, base_model: str | None = None,
                  eval_results=None, eval_method: str | None = None) -> Path:
    """Write everything that gets uploaded into `folder` and return it (a dry run of `push_drafter`)."""
    folder = Path(folder)
    drafter.save_pretrained(folder)
    loaded_from = Path(getattr(drafter, "name_or_path", "") or "nonexistent") / "README.md"
    if card is None and loaded_from.is_file():
        card = loaded_from.read_text()
    if card is None:
        card = default_model_card(drafter.config, base_model=base_model, eval_results=eval_results,
                                  eval_method=eval_method)
    elif eval_results is not None:
        card = replace_measured(card, eval_results_table(eval_results, eval_method or drafter_kind(drafter.config)))
    (folder / "README.md").write_text(card)
    return folder


def push_drafter(drafter, repo_id: str, *, card: str | None = None, base_model: str | None = None,
                 eval_results=None, eval_method: str | None = None, private: bool | None = None,
                 token: str | None = None, endpoint: str | None = None, commit_message: str | None = None,
                 revision: str | None = None, create_pr: bool = False):
    """Create `repo_id` if needed and upload the staged drafter folder; returns the commit info."""
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT"), token=token)
    with tempfile.TemporaryDirectory() as tmp:
        stage_drafter(drafter, tmp, card=card, base_model=base_model, eval_results=eval_results,
                      eval_method=eval_method)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        return api.upload_folder(
            repo_id=repo_id, folder_path=tmp, revision=revision, create_pr=create_pr,
            commit_message=commit_message or f"Upload {type(drafter).__name__} with hf_dspark",
        )
