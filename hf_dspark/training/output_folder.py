"""Output folders a user can fix: one that cannot be written (no permission, read-only, a file in the way) or a disk
that fills up. Each becomes an `OutputWriteError` naming the folder, the cause and how to resume, so the command
line prints one line instead of a traceback; any other error keeps its own type and traceback."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..models.errors import UserInputError

# Errors of the folder, not of the program: the user frees space, fixes permissions or picks another folder.
_CAUSES = {errno.ENOSPC: "no space left on its disk", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied", errno.ENOTDIR: "a file is in the way of a folder on its path",
           errno.EEXIST: "a file is in the way of a folder on its path", errno.EFBIG: "a file grew over the size limit"}
# How torch (RuntimeError) and safetensors (SafetensorError) word a full disk: they raise no OSError.
_FULL_DISK_WORDS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
_NEARLY_FULL = 1 << 20  # bytes: a write that failed with less than this free failed for lack of space


class OutputWriteError(UserInputError, OSError):
    """Writing to an output folder failed for a reason the user can fix (a full disk, no permission); the message
    names the folder, the cause and how to resume. Still an OSError for code that catches those."""


def _inside(path, folder: Path) -> bool:
    try:
        Path(os.fsdecode(path)).resolve().relative_to(folder.resolve())
        return True
    except (ValueError, OSError, TypeError):
        return False


def write_problem(error: BaseException, folder: str | os.PathLike, saving: bool = False) -> str | None:
    """Why writing under `folder` failed when `error` says the folder is at fault (a full disk, no permission, a
    read-only disk, a file in the way), else None: then it is not the folder's fault and `error` stands.

    torch.save on a full disk raises a RuntimeError that does not say so; with `saving` (the error came from a call
    that only saves files) a disk left with under 1 MiB free counts as the cause too."""
    folder = Path(folder)
    if isinstance(error, OSError) and error.errno in _CAUSES:
        # A copy names its source first and the file it was writing second (`filename2`): either may be ours.
        named = [name for name in (error.filename, getattr(error, "filename2", None)) if name is not None]
        if not named or any(_inside(name, folder) or _inside(folder, Path(os.fsdecode(name))) for name in named):
            return _CAUSES[error.errno]
        return None
    if isinstance(error, (RuntimeError, OSError)) or type(error).__name__ == "SafetensorError":
        if any(words in str(error).lower() for words in _FULL_DISK_WORDS):
            return _CAUSES[errno.ENOSPC]
        if not saving:
            return None
        try:
            existing = next(p for p in (folder, *folder.parents) if p.exists())
            if shutil.disk_usage(existing).free < _NEARLY_FULL:
                return _CAUSES[errno.ENOSPC]
        except (OSError, StopIteration):
            return None
    return None


def check_writable(folder: str | os.PathLike, flag: str) -> None:
    """Create `folder` (and its parents) and a probe file in it, then remove what it created: a folder that cannot
    be written is an `OutputWriteError` before any model loads, not after minutes of work, and a command that
    fails later for another reason leaves no empty folder behind."""
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as error:
        cause = write_problem(error, folder) or (error.strerror or str(error))
        raise OutputWriteError(f"cannot write to {flag} {folder}: {cause}; fix that or pass another folder.") from None
    finally:
        for path in created:  # deepest first; only folders this probe made, and only while empty
            try:
                path.rmdir()
            except OSError:
                break


def check_writable_file(path: str | os.PathLike, flag: str) -> None:
    """A file a command writes when its work is done: refused before the work when a folder (or anything but a
    regular file) is in its place or its folder cannot be written (`check_writable`), so no result is lost."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise OutputWriteError(f"cannot write to {flag} {path}: it is a folder, not a file; pass the path of the file "
                               "to write (e.g. inside that folder).")
    check_writable(path.parent, flag)


@contextmanager
def writing_to(folder: str | os.PathLike, flag: str, command: str, kept: str):
    """Turn a write failure in `folder` (see `write_problem`) into an `OutputWriteError` that names the folder, the
    cause, and that rerunning `command` resumes from what is `kept`."""
    try:
        yield
    except OutputWriteError:
        raise
    except Exception as error:
        cause = write_problem(error, folder)
        if cause is None:
            raise
        raise OutputWriteError(f"writing to {flag} {folder} failed: {cause}. Free space or fix that, then rerun the "
                               f"same `{command}` command: it resumes from {kept}.") from error
