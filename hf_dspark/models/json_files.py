"""Reading a JSON file the user pointed at (a cost table, an eval results.json): one error naming the file and the fix.

Every read is bounded: a regular file only (never a device such as /dev/zero, a pipe such as /dev/stdin or a folder,
which would block or never end), and at most `max_bytes` bytes of it (at most `max_bytes + 1` are ever read)."""

from __future__ import annotations

import json
import os
import stat

from .errors import UserInputError

MAX_JSON_BYTES = 16 * 2**20
"""The largest JSON file `read_json` reads unless told otherwise (16 MiB; an eval results.json is a few dozen KiB)."""
SMALL_JSON_BYTES = 2**20
"""The limit for the small files a drafter folder and its settings carry (generation config, cost table: 1 MiB)."""


class _NotRegular(OSError):
    """The path is not a regular file."""


class _TooLarge(OSError):
    """The file holds more than the limit."""


def read_bounded(path, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` of them. Raises `FileNotFoundError`, another
    `OSError`, or `_NotRegular` / `_TooLarge` (both `OSError`s) without reading a device, pipe or folder: the file is
    checked before it is opened and again once open (non-blocking, so a pipe's open cannot hang)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise _NotRegular(path)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(descriptor, "rb") as opened:
        if not stat.S_ISREG(os.fstat(opened.fileno()).st_mode):  # replaced between the check and the open
            raise _NotRegular(path)
        data = opened.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _TooLarge(path)
    return data


def read_json(path, what: str, fix: str, error: type[UserInputError] = UserInputError,
              max_bytes: int = MAX_JSON_BYTES):
    """The JSON value stored at `path`, which should hold a `what` (e.g. "cost table"). A missing, unreadable,
    non-regular, larger than `max_bytes` or malformed file raises `error` naming `what`, the path and `fix`; checking
    the value's shape is the caller's."""
    try:
        data = read_bounded(path, max_bytes)
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file; {fix}.") from None
    except _NotRegular:
        raise error(f"{what} {path} is not a regular file (a folder, device or pipe is never read); {fix}.") from None
    except _TooLarge:
        raise error(f"{what} {path} is larger than {max_bytes} bytes, more than such a file ever holds; "
                    f"{fix}.") from None
    except (OSError, ValueError) as problem:  # ValueError: a path with a NUL byte
        raise error(f"{what} {path} cannot be read ({problem}); {fix}.") from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as problem:
        raise error(f"{what} {path} cannot be read ({problem}); {fix}.") from None
    except (ValueError, RecursionError) as problem:  # JSONDecodeError, a number too long, nesting too deep
        raise error(f"{what} {path} is not valid JSON ({problem}); {fix}.") from None


def write_json(path, value, indent: int = 1) -> None:
    """Write `value` as JSON to `path` atomically: a process stopped midway leaves the old file or the new one,
    never half of one (the temporary file sits beside it, so the rename stays on one file system)."""
    temporary = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(value, handle, indent=indent)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
