"""Reading a JSON file the user pointed at (a cost table, an eval results.json): one error naming the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserInputError


def read_json(path, what: str, fix: str, error: type[UserInputError] = UserInputError):
    """The JSON value stored at `path`, which should hold a `what` (e.g. "cost table"). A missing, unreadable or
    malformed file raises `error` naming `what`, the path and `fix`; checking the value's shape is the caller's."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file; {fix}.") from None
    except (OSError, UnicodeDecodeError) as problem:
        raise error(f"{what} {path} cannot be read ({problem}); {fix}.") from None
    except json.JSONDecodeError as problem:
        raise error(f"{what} {path} is not valid JSON ({problem}); {fix}.") from None
