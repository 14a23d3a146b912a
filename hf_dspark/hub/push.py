"""Upload a drafter to the Hugging Face Hub (or any server `HF_ENDPOINT` points at) with its model card.

The uploaded folder is what `save_pretrained` writes (config, safetensors, the modeling code with `auto_map`, and
`custom_generate/`) plus a `README.md` card: the card given, else the one in the folder the drafter was loaded
from, else one rendered from
`hf_dspark/hub/templates/drafter_card.md`; `eval_results` (an `hf-dspark eval` results.json) replaces its Measured section.

Everything a user can get wrong (a missing or malformed results file, no card and no `base_model`, an invalid repo
id, no network, no or a read-only token) is a `UserInputError` naming the fix, raised before anything is written
or after nothing is left behind: a folder is staged whole under a temporary name, or not at all.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi

from ..models.errors import UserInputError
from ..models.folder_files import checked_file
from ..models.identity import drafter_kind
from ..models.json_files import read_json
from .model_card import default_model_card, eval_results_table, replace_measured


class HubPushError(UserInputError):
    """The Hub could not be reached, or refused the upload (no token, no write access); the message says which."""


def read_eval_results(results) -> dict:
    """An `hf-dspark eval` results.json (a path, or the dict already read), checked to be one."""
    if isinstance(results, dict):
        return results
    fix = "pass the results.json that `hf-dspark eval --output DIR` wrote"
    results = read_json(results, "eval results (--eval)", fix)
    if not isinstance(results, dict) or not {"results", "methods", "settings"} <= set(results):
        raise UserInputError(f"eval results (--eval): the file is not an `hf-dspark eval` results.json (no results, "
                             f"methods and settings); {fix}.")
    return results


def drafter_card(drafter, *, card: str | None = None, base_model: str | None = None, eval_results=None,
                 eval_method: str | None = None) -> str:
    """The README.md to upload with `drafter` (see the module docstring), checked before anything is written."""
    loaded_from = Path(getattr(drafter, "name_or_path", "") or "nonexistent") / "README.md"
    if card is None and os.path.lexists(loaded_from):  # a link out of the folder is never read (nor uploaded)
        card = Path(checked_file(loaded_from, loaded_from.parent)).read_text()
    if eval_results is not None:
        eval_results = read_eval_results(eval_results)
        method = eval_method or drafter_kind(drafter.config)
        if method not in eval_results["results"]:
            raise UserInputError(f"the eval results (--eval) hold no method {method!r} (they hold "
                                 f"{', '.join(map(str, eval_results['results']))}); pass --eval-method NAME.")
    if card is None:
        if not base_model:
            raise UserInputError("the drafter's folder has no README.md card: pass the target's Hub id as "
                                 "base_model (--base-model ORG/NAME) to render one, or a card (--card FILE).")
        return default_model_card(drafter.config, base_model=base_model, eval_results=eval_results,
                                  eval_method=eval_method)
    if eval_results is not None:
        card = replace_measured(card, eval_results_table(eval_results, eval_method or drafter_kind(drafter.config)))
    return card


def _write_staged(drafter, folder: Path, card: str) -> None:
    drafter.save_pretrained(folder)
    (folder / "README.md").write_text(card)


def stage_drafter(drafter, folder: str | Path, *, card: str | None = None, base_model: str | None = None,
                  eval_results=None, eval_method: str | None = None) -> Path:
    """Write everything that gets uploaded into `folder` (new, or empty) and return it: a dry run of
    `push_drafter`. It is written under a temporary name beside `folder` and renamed once complete, so a failure
    leaves no half-staged folder."""
    folder = Path(folder)
    text = drafter_card(drafter, card=card, base_model=base_model, eval_results=eval_results, eval_method=eval_method)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UserInputError(f"{folder} already exists and is not empty; stage into a new or empty folder.")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)  # this process's own leftover: nothing of a user's
    staging.mkdir()
    try:
        _write_staged(drafter, staging, text)
        if folder.exists():
            folder.rmdir()  # empty, checked above
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection failures, whichever HTTP client this huggingface_hub uses (requests' are OSErrors)."""
    errors: list[type[BaseException]] = [OSError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def push_drafter(drafter, repo_id: str, *, card: str | None = None, base_model: str | None = None,
                 eval_results=None, eval_method: str | None = None, private: bool | None = None,
                 token: str | None = None, endpoint: str | None = None, commit_message: str | None = None,
                 revision: str | None = None, create_pr: bool = False):
    """Create `repo_id` if needed and upload the staged drafter folder; returns the commit info."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise UserInputError(f"{repo_id!r} is not a Hub repo id ({error}); use ORG/NAME.") from None
    text = drafter_card(drafter, card=card, base_model=base_model, eval_results=eval_results, eval_method=eval_method)
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT"), token=token)
    with tempfile.TemporaryDirectory() as tmp:
        _write_staged(drafter, Path(tmp), text)
        try:
            repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
            return api.upload_folder(
                repo_id=repo_id, folder_path=tmp, revision=revision, create_pr=create_pr,
                commit_message=commit_message or f"Upload {type(drafter).__name__} with hf_dspark",
            )
        except HfHubHTTPError as error:
            status = getattr(error.response, "status_code", None)
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if status in (401, 403):
                raise HubPushError(f"the Hub at {api.endpoint} refused to create or write {repo_id} ({status}: no "
                                   "token, or one without write access); set HF_TOKEN to a write token (or run `hf "
                                   "auth login`), then rerun.") from error
            raise HubPushError(f"the Hub at {api.endpoint} refused the upload to {repo_id} ({first}); check the "
                               "repo id and your access, then rerun.") from error
        except _transport_errors() as error:
            raise HubPushError(f"could not reach the Hub at {api.endpoint} ({error or type(error).__name__}); "
                               "check the network connection or HF_ENDPOINT, then rerun.") from error
