"""The `hf-dspark` console script. Importing hf_dspark (torch, transformers) takes seconds before `hf_dspark.cli.main`
can catch anything, so Ctrl-C then printed a traceback of the import and the process died of the signal. Here it
ends the command quietly with exit code 130, as Ctrl-C does once a command runs (`hf_dspark.cli.interrupts`). This
module lives outside the hf_dspark package because importing that package is what gets interrupted."""

import sys

INTERRUPTED = 130
"""128 + SIGINT: the exit code a shell gives a command that Ctrl-C stopped."""


def main() -> int:
    try:
        from hf_dspark.cli.main import main as run_command

        return run_command()
    except KeyboardInterrupt:  # while importing or parsing: a running command reports its own interrupt
        print("hf-dspark: interrupted before the command started; nothing was done.", file=sys.stderr)
        return INTERRUPTED


__all__ = ["INTERRUPTED", "main"]
