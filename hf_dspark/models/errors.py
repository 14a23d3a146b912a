"""The errors a user can fix, as hf_dspark raises them: each message names the problem and the fix."""

from __future__ import annotations


class UserInputError(ValueError):
    """A mistake the user can fix (a path, a setting, a file): the message names the problem and the fix. The
    `hf-dspark` command line prints it on one line and exits with code 2; anything else keeps its traceback."""


class DrafterTargetMismatchError(UserInputError):
    """A drafter was used with a target model whose shapes, depth or device it was not built for."""


class DrafterLoadError(UserInputError):
    """A drafter folder that cannot be loaded as it is (another architecture, a missing config field, unreadable
    weights); the message names the file, the field and the fix."""


__all__ = ["DrafterLoadError", "DrafterTargetMismatchError", "UserInputError"]
