"""`hf-dspark` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hf_dspark.cli.generate import add_device_argument
from hf_dspark.models.errors import UserInputError
from hf_dspark.models.loading import DTYPES, resolve_device
from hf_dspark.targets.loading import load_target


def cmd_regenerate(args) -> int:
    from hf_dspark.training.data import Decontaminator, load_conversations, sharegpt_path
    from hf_dspark.training.output_folder import check_writable, writing_to
    from hf_dspark.training.regenerate import RegenerationConfig, regenerate

    check_writable(args.output, "--output")  # before minutes of loading and decoding
    if args.cache:
        check_writable(args.cache, "--cache")
    sources = [sharegpt_path() if p == "sharegpt" else p for p in args.prompts]
    conversations = load_conversations(sources)
    before = len(conversations)
    if not args.no_decontaminate:
        conversations = Decontaminator.from_benchmarks().filter_conversations(conversations)
    if args.max_prompts is not None:
        conversations = conversations[: args.max_prompts]
    print(f"{before} conversations read, {before - len(conversations)} dropped (eval overlap or --max-prompts), "
          f"{len(conversations)} kept", file=sys.stderr)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    target, tokenizer = load_target(args.target, args.dtype, device=args.device)
    config = RegenerationConfig(
        max_new_tokens=args.max_new_tokens, greedy_fraction=args.greedy_fraction, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, batch_size=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
        max_turns=args.max_turns, seed=args.seed,
    )
    with writing_to(args.output, "--output", "hf-dspark regenerate", "the conversations already written"):
        stats = regenerate(target, tokenizer, conversations, args.output, config, target_name=args.target or "default")
    print(json.dumps(stats))
    if args.cache:
        # Same process, target already loaded: the cache pass costs about a tenth of the regeneration.
        from hf_dspark.training.target_cache import build_target_cache
        from hf_dspark.training.trainer import RegeneratedDataset

        data = RegeneratedDataset(args.output, max_length=args.cache_max_length)
        with writing_to(args.cache, "--cache", "hf-dspark regenerate", "the shards already written"):
            build_target_cache(target, [data[i] for i in range(len(data))], args.cache,
                               args.cache_layers or default_cache_layers(target.config),
                               target_name=args.target or "default")
    return 0


def default_cache_layers(target_config) -> list[int]:
    """The layers DSpark/DFlash and Eagle3 read by default, so one cache serves all three drafters."""
    from hf_dspark.models import DSparkDraftConfig, Eagle3DraftConfig

    dspark = DSparkDraftConfig.from_target_config(target_config).target_layer_ids
    eagle3 = Eagle3DraftConfig.from_target_config(target_config).target_layer_ids
    return sorted(set(dspark) | set(eagle3))


def cmd_cache(args) -> int:
    from hf_dspark.training.output_folder import check_writable, writing_to
    from hf_dspark.training.recipes import assemble_dataset
    from hf_dspark.training.target_cache import build_target_cache

    check_writable(args.output, "--output")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    target, tokenizer = load_target(args.target, args.dtype, device=args.device)
    dataset = assemble_dataset(tokenizer, args.data or [], args.dataset_answers, args.max_length)
    layers = args.target_layers or default_cache_layers(target.config)
    with writing_to(args.output, "--output", "hf-dspark cache", "the shards already written"):
        manifest = build_target_cache(target, [dataset[i] for i in range(len(dataset))], args.output, layers,
                                      max_tokens_per_batch=args.max_tokens_per_batch,
                                      target_name=args.target or "default")
    print(json.dumps(manifest))
    return 0


def cmd_profile(args) -> int:
    from hf_dspark.evaluation.profiling import profile_verification_costs
    from hf_dspark.training.output_folder import check_writable_file

    check_writable_file(args.output, "--output")  # written after the profiling
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target(args.target, args.dtype, device=args.device)
    drafter = None
    if args.drafter:
        from hf_dspark.models.loading import load_drafter

        drafter = load_drafter(args.drafter, target.dtype)
    table = profile_verification_costs(target, max_tokens=args.max_tokens, context_length=args.context_length,
                                       repeats=args.repeats, drafter=drafter, rows=args.rows)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    table.save(args.output)
    over = f" over {args.rows} rows" if args.rows > 1 else ""
    for n, seconds in enumerate(table.seconds, start=1):
        print(f"B = {n:3d} tokens{over}: {1000 * seconds:8.2f} ms  SPS {1 / seconds:7.2f}")
    if drafter is not None:
        print(f"drafter round: {1000 * table.draft_seconds:.2f} ms")
    print(f"written to {args.output}", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise UserInputError("hf-dspark train runs transformers' Trainer, which needs accelerate: install it with "
                             "pip install 'hf-dspark[train]' (or pip install accelerate).")
    from hf_dspark.training.output_folder import check_writable, writing_to
    from hf_dspark.training.recipes import train_drafter

    check_writable(args.output, "--output")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    target, tokenizer = load_target(args.target, args.dtype, device=args.device)
    with writing_to(args.output, "--output", "hf-dspark train", "its newest complete checkpoint"):
        summary = _train(args, target, tokenizer, train_drafter)
    print(json.dumps(summary))
    return 0


def _train(args, target, tokenizer, train_drafter) -> dict:
    return train_drafter(
        target, tokenizer, kind=args.kind, output_dir=args.output, regenerated=args.data or [],
        dataset_answers=args.dataset_answers, cache=args.cache, num_layers=args.num_layers, block_size=args.block_size,
        markov_rank=args.markov_rank, draft_vocab_size=args.draft_vocab_size, target_layer_ids=args.target_layers,
        init_from_target=args.init_from_target_layers, max_length=args.max_length, batch_size=args.batch_size,
        num_anchors=args.num_anchors, learning_rate=args.learning_rate, max_steps=args.max_steps,
        save_steps=args.save_steps, warmup_ratio=args.warmup_ratio, max_seconds=args.max_seconds,
        init_context=args.init_context_from_target, init_markov_bigrams=args.init_markov_from_bigrams, seed=args.seed, resume=not args.no_resume,
        init_from=args.init_from, qk_norm=not args.no_qk_norm, precondition_fusion=not args.no_precondition_fusion,
        sample_from_anchor=not args.no_sample_from_anchor,
        loss_weights={k: v for k, v in {"ce_weight": args.ce_weight, "tv_weight": args.tv_weight,
                                        "bce_weight": args.bce_weight, "kl_weight": args.kl_weight,
                                        "selector_weight": args.selector_weight}.items()
                      if v is not None},
    )


def _add_data_arguments(parser, output_help: str) -> None:
    """Arguments shared by `cache` and `train`: where to write, which target, which training examples."""
    parser.add_argument("--output", required=True, help=output_help)
    parser.add_argument("--target", default=None, help="target model path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    add_device_argument(parser)
    parser.add_argument("--data", nargs="*", help="folders of `hf-dspark regenerate` shards")
    parser.add_argument("--dataset-answers", type=int, default=0,
                        help="also use the first N ShareGPT conversations' own answers (off-policy contexts, "
                             "labelled by the target's distribution)")


def _add_regenerate_parser(sub) -> None:
    """`hf-dspark regenerate`: the target answers training prompts."""
    regen = sub.add_parser("regenerate", help="let the target answer training prompts (resumable JSONL shards)")
    regen.add_argument("--prompts", nargs="+", default=["sharegpt"],
                       help="JSON/JSONL prompt files, or 'sharegpt' for the offline ShareGPT wheel")
    regen.add_argument("--output", required=True, help="output folder (resumes if it already holds shards)")
    regen.add_argument("--target", default=None, help="target model path (default: embedded SmolLM2-135M-Instruct)")
    regen.add_argument("--dtype", default="float32", choices=DTYPES)
    add_device_argument(regen)
    regen.add_argument("--max-prompts", type=int, default=None)
    regen.add_argument("--max-new-tokens", type=int, default=384)
    regen.add_argument("--max-prompt-tokens", type=int, default=512)
    regen.add_argument("--greedy-fraction", type=float, default=0.75,
                       help="share of conversations answered greedily; the rest are sampled (--temperature etc.)")
    regen.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled share (> 0)")
    regen.add_argument("--top-p", type=float, default=0.8)
    regen.add_argument("--top-k", type=int, default=20)
    regen.add_argument("--max-turns", type=int, default=4, help="user turns answered per conversation")
    regen.add_argument("--batch-size", type=int, default=64)
    regen.add_argument("--seed", type=int, default=0)
    regen.add_argument("--threads", type=int, default=None)
    regen.add_argument("--no-decontaminate", action="store_true", help="keep prompts that overlap the eval sets")
    regen.add_argument("--cache", default=None,
                       help="also write the target cache of the regenerated data here (see `hf-dspark cache`)")
    regen.add_argument("--cache-layers", type=int, nargs="*", default=None)
    regen.add_argument("--cache-max-length", type=int, default=768)
    regen.set_defaults(func=cmd_regenerate)


def _add_cache_parser(sub) -> None:
    """`hf-dspark cache`: the target's features over the training data, stored once."""
    cache = sub.add_parser("cache", help="run the target once over the training data and store what training "
                                         "needs (bf16, resumable), so epochs never rerun the target")
    _add_data_arguments(cache, "cache folder (resumes if it already holds shards)")
    cache.add_argument("--max-length", type=int, default=768)
    cache.add_argument("--target-layers", type=int, nargs="*", default=None,
                       help="0-based target layers to store (default: those DSpark/DFlash and Eagle3 read)")
    cache.add_argument("--max-tokens-per-batch", type=int, default=4096)
    cache.add_argument("--threads", type=int, default=None)
    cache.set_defaults(func=cmd_cache)


def _add_train_parser(sub) -> None:
    """`hf-dspark train`: distil a drafter against a frozen target."""
    train = sub.add_parser("train", help="distil a drafter against a frozen target (resumes from checkpoints)")
    train.add_argument("--kind", default="dspark", choices=["dspark", "gated", "rnn", "dflash", "dflash2", "eagle3"])
    _add_data_arguments(train, "folder for the drafter (and trainer checkpoints)")
    train.add_argument("--cache", nargs="+", default=None,
                       help="train from `hf-dspark cache` folders (several train as one dataset) instead of running "
                            "the target every step")
    train.add_argument("--num-layers", type=int, default=2)
    train.add_argument("--block-size", type=int, default=7)
    train.add_argument("--markov-rank", type=int, default=256)
    train.add_argument("--draft-vocab-size", type=int, default=None)
    train.add_argument("--target-layers", type=int, nargs="*", default=None)
    train.add_argument("--init-from-target-layers", type=int, nargs="*", default=None,
                       help="copy these target decoder layers into the drafter's layers before training")
    train.add_argument("--init-context-from-target", action="store_true",
                       help="with --init-from-target-layers L ...: start the fusion as target layer L-1's output "
                            "(it must be fused), so the first drafter layer sees the target's own context keys")
    train.add_argument("--init-markov-from-bigrams", action="store_true",
                       help="start the Markov head at the low-rank bigram log-probabilities of the training answers")
    train.add_argument("--no-qk-norm", action="store_true",
                       help="no q/k norms in the drafter's attention (then vLLM/SGLang/llama.cpp cannot serve a "
                            "Llama-family drafter)")
    train.add_argument("--no-sample-from-anchor", action="store_true",
                       help="block drafters: slot j predicts anchor + j and slot 0 drafts nothing (z-lab's and "
                            "speculators' DFlash convention; `convert --to zlab` needs it)")
    train.add_argument("--no-precondition-fusion", action="store_true",
                       help="train the context fusion on the raw target features (by default each fused feature "
                            "trains at one scale; the saved drafter is the same kind either way)")
    train.add_argument("--max-length", type=int, default=768)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--num-anchors", type=int, default=64)
    train.add_argument("--learning-rate", type=float, default=6e-4)
    train.add_argument("--warmup-ratio", type=float, default=0.04)
    train.add_argument("--max-steps", type=int, default=1000)
    train.add_argument("--max-seconds", type=float, default=None,
                       help="stop (and save) after this much training time: an equal budget for every drafter")
    train.add_argument("--save-steps", type=int, default=50)
    train.add_argument("--ce-weight", type=float, default=None, help="default 0.1 (DSpark) / 1.0 (DFlash)")
    train.add_argument("--tv-weight", type=float, default=None, help="default 0.9 (DSpark) / 0 (DFlash)")
    train.add_argument("--bce-weight", type=float, default=None, help="default 1.0 (DSpark) / 0 (DFlash)")
    train.add_argument("--kl-weight", type=float, default=None, help="soft CE to the target distribution (default 0)")
    train.add_argument("--selector-weight", type=float, default=None,
                       help="DFlash 2: CE over its candidate selector's scores (default 1)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None)
    train.add_argument("--no-resume", action="store_true")
    train.add_argument("--init-from", help="start from this trained drafter folder (its config wins) under a new budget")
    train.set_defaults(func=cmd_train)


def _add_profile_parser(sub) -> None:
    """`hf-dspark profile`: the target's verification cost table on this hardware."""
    profile = sub.add_parser("profile", help="measure SPS(B), the target's verification cost at B tokens, (and the "
                                             "drafter's round) on this hardware and write a cost table")
    profile.add_argument("--output", required=True, help="cost table JSON to write")
    profile.add_argument("--target", default=None, help="target model path (default: embedded SmolLM2-135M-Instruct)")
    profile.add_argument("--drafter", default=None, help="also time one drafting round of this drafter")
    profile.add_argument("--dtype", default="float32", choices=DTYPES)
    add_device_argument(profile)
    profile.add_argument("--max-tokens", type=int, default=16, help="profile B = 1 .. this many tokens")
    profile.add_argument("--rows", type=int, default=1,
                         help="batch size to profile for: B tokens in total over this many rows, as the batched "
                              "scheduler prices a round (default 1)")
    profile.add_argument("--context-length", type=int, default=256)
    profile.add_argument("--repeats", type=int, default=5)
    profile.add_argument("--threads", type=int, default=None)
    profile.set_defaults(func=cmd_profile)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes (an unknown flag, a missing argument, a value of the wrong type) are one
    line and exit code 2, like every other mistake of the command line, instead of the whole usage first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hf-dspark", description="DSpark speculative decoding for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    # Subcommand order is the order `hf-dspark --help` lists them in.
    _add_regenerate_parser(sub)
    _add_cache_parser(sub)
    _add_train_parser(sub)
    _add_profile_parser(sub)

    from hf_dspark.cli.bench import add_parser as add_bench
    from hf_dspark.cli.eval import add_parser as add_eval
    from hf_dspark.cli.generate import add_parser as add_generate
    from hf_dspark.cli.hub import add_parser as add_hub
    from hf_dspark.cli.serve import add_parser as add_serve

    add_generate(sub, list(DTYPES))
    add_bench(sub, list(DTYPES))
    add_eval(sub, list(DTYPES))
    add_hub(sub)
    add_serve(sub, list(DTYPES))
    return parser


def impossible_setting(args) -> str | None:
    """The first flag whose value cannot work (named with the rule it breaks), checked before any model loads."""
    rules = [
        ("temperature", "--temperature", lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
        ("temperatures", "--temperatures", lambda v: all(t >= 0 for t in v), "must all be >= 0 (0 = greedy)"),
        ("top_p", "--top-p", lambda v: 0 < v <= 1, "must be in (0, 1] (1 = off)"),
        ("top_k", "--top-k", lambda v: v >= 0, "must be >= 0 (0 = off)"),
        ("max_new_tokens", "--max-new-tokens", lambda v: v >= 1, "must be at least 1"),
        ("batch_size", "--batch-size", lambda v: v >= 1, "must be at least 1"),
        ("rows", "--rows", lambda v: v >= 1, "must be at least 1"),
        ("max_tokens", "--max-tokens", lambda v: v >= 1, "must be at least 1"),
        ("threads", "--threads", lambda v: v >= 1, "must be at least 1"),
        ("context_length", "--context-length", lambda v: v >= 1, "must be at least 1"),
        ("repeats", "--repeats", lambda v: v >= 1, "must be at least 1"),
        ("prompts_per_benchmark", "--prompts-per-benchmark", lambda v: v >= 1, "must be at least 1"),
        ("max_prompts", "--max-prompts", lambda v: v >= 1, "must be at least 1"),
        ("exec_timeout", "--exec-timeout", lambda v: v > 0, "must be above 0 seconds"),
    ]
    for name, flag, ok, rule in rules:
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            return f"{flag} {rule}, got {' '.join(map(str, value)) if isinstance(value, list) else value}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command. A mistake the user can fix (an impossible flag, a missing or wrong model folder, a drafter
    for another target, unusable data) is one line on stderr and exit code 2; Ctrl-C is one line saying what was
    kept and how to resume, exit code 130; real bugs keep their traceback."""
    args = build_parser().parse_args(argv)
    problem = impossible_setting(args)
    if problem is None:
        try:
            if getattr(args, "device", None) is not None:
                resolve_device(args.device)  # a device that is not here fails before any data or model loads
            return args.func(args)
        except UserInputError as error:
            problem = str(error)
        except KeyboardInterrupt:
            from hf_dspark.cli.interrupts import report_interrupt

            return report_interrupt(args)
    print(f"hf-dspark {args.command}: {' '.join(problem.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
