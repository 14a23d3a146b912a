"""`hf-dspark push` (upload a drafter with its card) and `hf-dspark convert` (DeepSpec layout <-> ours)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_push(args) -> int:
    from hf_dspark.hub.push import push_drafter, read_eval_results, stage_drafter
    from hf_dspark.models.errors import UserInputError
    from hf_dspark.models.loading import load_drafter
    from hf_dspark.training.output_folder import check_writable

    card = None
    if args.card:
        try:
            card = Path(args.card).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = "no such file" if isinstance(error, FileNotFoundError) else error
            raise UserInputError(f"--card {args.card}: {reason}; pass a Markdown card file.") from None
    results = read_eval_results(args.eval) if args.eval else None  # a bad file fails before anything loads
    if args.dry_run:
        check_writable(Path(args.dry_run).parent, "--dry-run")
    drafter = load_drafter(args.drafter, None)  # refuses another kind of model before reading its weights
    options = dict(card=card, base_model=args.base_model, eval_results=results, eval_method=args.eval_method)
    if args.dry_run:
        folder = stage_drafter(drafter, args.dry_run, **options)
        print(f"staged {len(list(folder.rglob('*')))} files in {folder} (nothing uploaded)", file=sys.stderr)
        return 0
    commit = push_drafter(drafter, args.repo_id, private=args.private, **options)
    print(json.dumps({"repo_id": args.repo_id, "commit_url": str(getattr(commit, "commit_url", commit))}))
    return 0


def cmd_convert(args) -> int:
    """Read a drafter in any layout hf_dspark reads and write it in another (`--to`; default: an hf_dspark drafter
    goes to DeepSpec's layout, or a DFlash 2 one to speculators', anything else to hf_dspark's). Every failure (an
    unreadable or missing folder, a refused drafter, a target that does not fit, a write error) is one line on
    stderr and exit code 2, and leaves no half-written output; neither does Ctrl-C."""
    import shutil

    from safetensors import SafetensorError

    from hf_dspark.hub.convert import convert_drafter
    from hf_dspark.training.output_folder import check_writable

    check_writable(args.output, "the output folder")  # a file in the way fails before the drafter loads
    output = Path(args.output)
    existed = output.exists()
    try:
        found, written = convert_drafter(args.source, args.output, args.to, target=args.target)
        print(f"read {found} layout, wrote {written}'s to {args.output}", file=sys.stderr)
    except (ValueError, OSError, RuntimeError, KeyError, TypeError, SafetensorError) as error:
        # ValueError includes refused drafters, target mismatches and broken JSON; OSError unreadable folders.
        if not existed and output.exists():
            shutil.rmtree(output, ignore_errors=True)
        message = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, KeyError):
            message = f"{args.source}/config.json has no field {message}; is it a drafter checkpoint?"
        print(f"hf-dspark convert: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # main() prints the one line; a half-written new folder is not left behind
        if not existed and output.exists():
            shutil.rmtree(output, ignore_errors=True)
        raise
    return 0


def add_parser(sub) -> None:
    push = sub.add_parser("push", help="upload a drafter folder with its model card to the Hub (HF_ENDPOINT, HF_TOKEN)")
    push.add_argument("drafter", help="drafter folder (save_pretrained output)")
    push.add_argument("repo_id", help="org/name of the model repository (created if missing)")
    push.add_argument("--eval", default=None, help="`hf-dspark eval` results.json whose numbers fill the card")
    push.add_argument("--eval-method", default=None,
                      help="which method of that results.json is this drafter (default: its kind)")
    push.add_argument("--card", default=None, help="card text to use (default: the folder's README.md, else rendered)")
    push.add_argument("--base-model", default=None, help="the target's Hub id, for a card rendered from scratch")
    push.add_argument("--private", action="store_true")
    push.add_argument("--dry-run", metavar="DIR", default=None, help="write what would be uploaded to DIR instead")
    push.set_defaults(func=cmd_push)

    convert = sub.add_parser("convert", help="write a drafter in another layout: hf_dspark's, DeepSpec's "
                                             "(Qwen3DSparkModel: vLLM, SGLang, llama.cpp), vllm-project/speculators' "
                                             "(vLLM) or z-lab DFlash's (DFlash / DFlash 2); reads those")
    convert.add_argument("source", help="drafter folder in any layout hf_dspark reads")
    convert.add_argument("output", help="folder to write")
    convert.add_argument("--target", default=None,
                         help="target model folder: checks the drafter against it (architecture, shapes, stored "
                              "embedding/LM head); a DeepSpec export includes them (needed with a draft vocabulary)")
    convert.add_argument("--to", choices=["deepspec", "speculators", "zlab", "hf_dspark"], default=None,
                         help="layout to write (default: deepspec for an hf_dspark drafter, speculators for its "
                              "DFlash 2; else hf_dspark)")
    convert.set_defaults(func=cmd_convert)
