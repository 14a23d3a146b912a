"""Reading a JSON file the user pointed at (a cost table, an eval results.json, a drafting state): one error naming the
file and the fix; checking its fields (`checked_fields`, `FieldCheck`); writing one atomically (`write_json`).

Every read is bounded: a regular file only (never a device such as /dev/zero, a pipe such as /dev/stdin or a folder,
which would block or never end), and at most `max_bytes` bytes of it (at most `max_bytes + 1` are ever read)."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import fields

from .config_checks import is_finite_number
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


def checked_fields(saved, kind, prefix: str, source: str, fix: str, whole: str = "") -> dict:
    """A copy of `saved`, refused unless it is a dict whose keys are fields of the dataclass `kind`."""
    names = [f.name for f in fields(kind)]
    what = prefix.rstrip(".") or whole or f"a {kind.__name__}"
    if not isinstance(saved, dict):
        raise UserInputError(f"{source}: {what} is a {type(saved).__name__}, not an object of {', '.join(names)}; "
                             f"{fix}.")
    unknown = sorted(repr(prefix + str(key))[:60] for key in set(saved) - set(names))
    if unknown:
        raise UserInputError(f"{source}: unknown field(s) {', '.join(unknown[:8])} (the "
                             f"fields of {what} are {', '.join(names)}); {fix}.")
    return dict(saved)


class FieldCheck:
    """Checks of a saved file's fields; each failure is one `UserInputError` naming field, value, source and fix."""

    def __init__(self, source: str, fix: str):
        self.source, self.fix = source, fix

    def require(self, ok: bool, name: str, value, expected: str) -> None:
        if not ok:
            raise UserInputError(f"{self.source}: field {name} is {repr(value)[:80]}, not {expected}; {self.fix}.")

    def value(self, value, name: str, low: float, high: float | None = None) -> float:
        """`value` as a float: a finite number >= low, <= high when given."""
        ok = is_finite_number(value) and value >= low and (high is None or value <= high)
        self.require(ok, name, value, f"a finite number >= {low}" + (f" and <= {high}" if high is not None else ""))
        return float(value)

    def number(self, saved: dict, name: str, low: float, high: float | None = None, default: float | None = None):
        """The float at `saved[name]` (the last part of a dotted name), `default` when left out."""
        return self.value(saved.get(name.rsplit(".", 1)[-1], default), name, low, high=high)

    def counts(self, saved: dict, name: str, low: int, check) -> dict:
        """`saved[name]` as {int >= low: check(value)}; JSON keeps the int keys as strings of digits."""
        table = saved.get(name.rsplit(".", 1)[-1], {})
        self.require(isinstance(table, dict), name, table, f"an object of int keys >= {low}")
        checked = {}
        for key, value in table.items():
            digits = isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,12}", key)
            number = int(key) if digits else key
            self.require(isinstance(number, int) and not isinstance(number, bool) and number >= low,
                         f"{name} key", key, f"an int >= {low}")
            checked[number] = check(value, f"{name}[{key!r}]")
        return checked
