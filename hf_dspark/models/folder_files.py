"""Which files a checkpoint folder may make a reader open: regular files that, every symlink resolved, still lie
inside the folder, or, when the folder is a Hub cache snapshot, in the `blobs/` folder of the same repository (where
huggingface_hub keeps the files its snapshot links point to). A folder is data from the Hub or from someone else: a
link in it to /etc/passwd or to another checkpoint must never be read as its config, settings or weights, and a pipe
or a device in place of a file must never be opened (a read would block or never end). Every reader of a checkpoint
folder checks each file with `checked_file` before it opens it; nothing is opened by the check."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UserInputError

LINK_FIX = "copy the file itself into the folder in place of the link, or restore the folder from its original copy"
REGULAR_FIX = "put the file itself back in its place: restore the folder from its original copy, or save it again"


def resolves_inside(path, folder) -> bool:
    """Whether `path`, every symlink resolved, lies inside `folder` (or, when `folder` is in a Hub cache snapshot, in
    the `blobs/` folder of the same repository, where huggingface_hub links its files)."""
    real = os.path.realpath(path)
    roots = [os.path.realpath(folder)]
    for ancestor in (Path(folder), *Path(folder).parents):
        repository = ancestor.parent.parent
        if ancestor.parent.name == "snapshots" and repository.name.startswith("models--"):
            blobs = os.path.join(os.path.realpath(repository), "blobs")
            if os.path.realpath(blobs) == blobs:  # blobs/ itself no link elsewhere
                roots.append(blobs)
            break
    try:
        return any(os.path.commonpath([real, root]) == root for root in roots)
    except ValueError:  # another drive
        return False


def checked_file(path, folder, error: type[UserInputError] = UserInputError) -> str:
    """`path` (a file a reader found in the checkpoint folder `folder`), once it is a regular file inside `folder`
    (`resolves_inside`); else `error` naming the file, what is wrong and the fix, before anything is opened."""
    path = str(path)
    if not resolves_inside(path, folder):
        raise error(f"{path} is a link that leads outside the folder {folder} (to {os.path.realpath(path)}), and a "
                    f"checkpoint folder is read only from files inside itself; {LINK_FIX}.")
    if not os.path.isfile(path):
        raise error(f"{path} is not a regular file (a folder, pipe, device or broken link in a checkpoint folder is "
                    f"never read); {REGULAR_FIX}.")
    return path


__all__ = ["LINK_FIX", "REGULAR_FIX", "checked_file", "resolves_inside"]
