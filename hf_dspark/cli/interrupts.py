"""Ctrl-C on the command line: one line on stderr that says what was kept and how to go on, and exit code 130 (128 +
SIGINT, what a shell reports for a command stopped by Ctrl-C), instead of a KeyboardInterrupt traceback whose last
words are the engine's advice to a Python caller. What was kept is read from the output folders themselves after the
interruption, so the line says what a rerun will find there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

INTERRUPTED = 130


def report_interrupt(args) -> int:
    """Print the one line for Ctrl-C in `args.command` on a line of its own; returns the exit code, 130."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):  # a bar the interruption left open would share the line
        bar.close()
    print(f"hf-dspark {args.command}: {interrupted_line(args)}", file=sys.stderr, flush=True)
    return INTERRUPTED


def interrupted_line(args) -> str:
    """What `hf-dspark <args.command>` kept when Ctrl-C stopped it, and how to resume (one sentence)."""
    describe = _KEPT.get(args.command, _generic)
    try:
        kept = describe(args)
    except Exception:  # a folder that cannot be read now must not turn the one line back into a traceback
        kept = _generic(args)
    return f"interrupted (Ctrl-C); {kept}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _regenerate(args) -> str:
    from hf_dspark.training.regenerate import completed_ids

    output = Path(args.output)
    saved = len(completed_ids(output)) if output.is_dir() else 0
    if saved:
        kept = (f"{_plural(saved, 'conversation')} {'is' if saved == 1 else 'are'} saved in {output}; rerun the same "
                "command to resume: it answers only the conversations not saved yet")
    else:
        kept = f"no conversation was finished yet, so nothing is saved in {output}; rerun the same command to start"
    if args.cache and Path(args.cache).is_dir():
        shards = len(list(Path(args.cache).glob("shard-*.safetensors")))
        kept += f" (and to finish the target cache in {args.cache}, which keeps its {_plural(shards, 'shard')})"
    return kept


def _cache(args) -> str:
    from hf_dspark.training.target_cache import MANIFEST, shard_count

    output = Path(args.output)
    shards = len(list(output.glob("shard-*.safetensors"))) if output.is_dir() else 0
    manifest = output / MANIFEST
    total = f" of {shard_count(json.loads(manifest.read_text()))}" if manifest.is_file() else ""
    return (f"{shards}{total} target-cache shards are saved in {output}; rerun the same command to resume at the "
            "first missing one")


def _train(args) -> str:
    from hf_dspark.training.checkpoints import checkpoint_step, newest_complete_checkpoint

    runs = Path(args.output) / "trainer"
    kept = newest_complete_checkpoint(runs, log=lambda line: None)
    if kept is None:
        return (f"no checkpoint was saved yet in {runs} (one every --save-steps {args.save_steps} steps), so a "
                "rerun starts over")
    how = "the same command without --no-resume" if args.no_resume else "the same command"
    return f"the newest complete checkpoint is {kept} (step {checkpoint_step(kept)}); rerun {how} to resume from it"


def _eval(args) -> str:
    from hf_dspark.evaluation.harness import RECORDS

    records = Path(args.output) / RECORDS
    count = 0
    if records.is_file():
        for line in records.read_text(encoding="utf-8").splitlines():
            try:
                json.loads(line)
                count += 1
            except json.JSONDecodeError:
                continue  # torn by the interruption: that answer is redone
    return (f"{_plural(count, 'answer')} (one per method and prompt) {'is' if count == 1 else 'are'} saved in "
            f"{records}; rerun the same command to resume from them")


def _generate(args) -> str:
    sys.stdout.write("\n")  # end the streamed answer's line, as a finished answer ends it
    sys.stdout.flush()
    if args.chat:
        return "the chat ended; nothing was saved"
    return "nothing was saved; the answer so far is what was printed above"


def _bench(args) -> str:
    where = f" to {args.output}" if args.output else ""
    return (f"nothing was written{where} (the report is written once the whole benchmark has run); the tables "
            "printed above are what was measured so far")


def _profile(args) -> str:
    return f"nothing was written to {args.output} (the table is written once profiling ends); rerun to profile again"


def _convert(args) -> str:
    if not Path(args.output).exists():
        return f"nothing was written to {args.output}; rerun the same command"
    return f"{args.output} may be incomplete; rerun the same command to write it again"


def _push(args) -> str:
    if args.dry_run:
        return f"{args.dry_run} may be incomplete; rerun the same command to stage it again"
    return "the upload is one commit, so no half-uploaded drafter is on the Hub; rerun the same command"


def _generic(args) -> str:
    return "it stopped before it finished; rerun the same command"


_KEPT = {"regenerate": _regenerate, "cache": _cache, "train": _train, "eval": _eval, "generate": _generate,
         "bench": _bench, "profile": _profile, "convert": _convert, "push": _push}
