"""`hf-dspark push` (upload a drafter with its card) and `hf-dspark convert` (DeepSpec layout <-> ours)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_push(args) -> int:
    from transformers import AutoModel

    from hf_dspark.hub.push import push_drafter, stage_drafter

    drafter = AutoModel.from_pretrained(args.drafter)
    card = Path(args.card).read_text() if args.card else None
    options = dict(card=card, base_model=args.base_model, eval_results=args.eval, eval_method=args.eval_method)
    if args.dry_run:
        folder = stage_drafter(drafter, args.dry_run, **options)
        print(f"staged {len(list(folder.rglob('*')))} files in {folder} (nothing uploaded)", file=sys.stderr)
        return 0
    commit = push_drafter(drafter, args.repo_id, private=args.private, **options)
    print(json.dumps({"repo_id": args.repo_id, "commit_url": str(getattr(commit, "commit_url", commit))}))
    return 0


def cmd_convert(args) -> int:
    """Convert one way or the other. Every failure (an unreadable or missing folder, a refused drafter, a target
    that does not fit, a write error) is one line on stderr and exit code 2, and leaves no half-written output."""
    import shutil

    from safetensors import SafetensorError
    from transformers import AutoModel, AutoModelForCausalLM

    from hf_dspark.hub.convert import export_deepspec, import_deepspec

    output = Path(args.output)
    existed = output.exists()
    try:
        config_path = Path(args.source) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{args.source} has no config.json: pass a DeepSpec checkpoint folder or an "
                                    "hf_dspark drafter folder")
        config = json.loads(config_path.read_text())
        target = AutoModelForCausalLM.from_pretrained(args.target) if args.target else None
        direction = args.to or ("deepspec" if config.get("model_type") in ("dspark", "eagle3_draft") else "hf_dspark")
        if direction == "deepspec":
            export_deepspec(AutoModel.from_pretrained(args.source), args.output, target=target)
            print(f"wrote DeepSpec's layout to {args.output}", file=sys.stderr)
        else:
            import_deepspec(args.source, target=target).save_pretrained(args.output)
            print(f"wrote hf_dspark drafter to {args.output}", file=sys.stderr)
    except (ValueError, OSError, RuntimeError, KeyError, TypeError, SafetensorError) as error:
        # ValueError includes SlotConventionError, target mismatches and broken JSON; OSError unreadable folders.
        if not existed and output.exists():
            shutil.rmtree(output, ignore_errors=True)
        message = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, KeyError):
            message = f"{args.source}/config.json has no field {message}; is it a DeepSpec or hf_dspark checkpoint?"
        print(f"hf-dspark convert: {message}", file=sys.stderr)
        return 2
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

    convert = sub.add_parser("convert", help="DeepSpec checkpoint (Qwen3DSparkModel, what vLLM/SGLang serve) <-> "
                                             "hf_dspark drafter; the direction follows the source's config")
    convert.add_argument("source", help="DeepSpec checkpoint folder, or an hf_dspark drafter folder to export")
    convert.add_argument("output", help="folder to write")
    convert.add_argument("--target", default=None,
                         help="target model folder: import checks the stored embedding/LM head against it; export "
                              "includes them (needed with a draft vocabulary)")
    convert.add_argument("--to", choices=["deepspec", "hf_dspark"], default=None, help="force the direction")
    convert.set_defaults(func=cmd_convert)
