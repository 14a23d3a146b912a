"""`hf-dspark generate`: stream an answer with speculative decoding, print tokens/s and tau (and the speed-up)."""

from __future__ import annotations

import sys
import time

import torch
from transformers import TextStreamer

from hf_dspark.evaluation.prompts import chat_input_ids
from hf_dspark.models.errors import UserInputError
from hf_dspark.models.loading import AUTO_DEVICE, load_drafter, shipped_drafter_path
from hf_dspark.policy.state import DraftingState

DEVICE_HELP = "where the models run: auto (default: the GPU if there is one, else the CPU), cpu, cuda, cuda:1, mps"


def add_device_argument(parser) -> None:
    """`--device`, the same for every command that loads a model (the drafter runs beside its target)."""
    parser.add_argument("--device", default=AUTO_DEVICE, help=DEVICE_HELP)


def cost_table_for(target, drafter, target_name: str):
    """Profile (once, cached on disk) what verifying 1..num_draft_slots + 1 tokens costs here, for the throughput schedule."""
    from hf_dspark.targets.default_target import cache_root
    from hf_dspark.evaluation.profiling import profile_verification_costs
    from hf_dspark.policy import VerificationCostTable
    from hf_dspark.evaluation.profiling import TIMING
    from hf_dspark.models.cost_table import CostTableError

    dtype = str(next(target.parameters()).dtype).replace("torch.", "")
    device = next(target.parameters()).device
    name = target_name.strip("/").replace("/", "--")
    path = cache_root() / "cost-tables" / f"{name}-{dtype}-{device.type}-{torch.get_num_threads()}threads.json"
    if path.is_file():
        try:
            table = VerificationCostTable.load(path)
        except CostTableError:  # a cache: a damaged copy is profiled again like a stale one
            table = None
        if table is not None and table.max_tokens >= drafter.config.block_size + 1 and \
                table.description.get("timing") == TIMING:
            return table
    print(f"profiling verification costs once ({path})...", file=sys.stderr)
    table = profile_verification_costs(target, max_tokens=drafter.config.block_size + 1, drafter=drafter)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)
    return table


def load_drafters(named: dict[str, str], target, schedule: bool, target_name: str) -> dict:
    """Load labelled drafters for `target`. `LABEL` is the drafter alone (every round drafts its block, no suffix
    drafting). With `schedule`, each also runs as `LABEL+suffix` (suffix drafting beside it, no cost table) and as
    `LABEL+schedule`, what `hf-dspark generate` runs by default: the cost table priced per round (draft length from
    the confidences, plain steps when drafting cannot pay) with the checkpoint's own suffix-drafting setting."""

    def loaded(path: str, suffix_drafting: bool | None, planning: bool = True):
        drafter = load_drafter(path, target.dtype)
        drafter.attach_target(target, follow=True)  # beside the target's LM head, in its dtype
        if suffix_drafting is not None:  # None keeps the checkpoint's own setting
            drafter.generation_config.dspark_suffix_drafting = suffix_drafting
        drafter.generation_config.dspark_round_planning = planning
        return drafter

    drafters = {}
    for label, path in named.items():
        drafters[label] = loaded(path, suffix_drafting=False, planning=False)
        if schedule:
            drafters[f"{label}+suffix"] = loaded(path, suffix_drafting=True)
            scheduled = loaded(path, suffix_drafting=None)
            scheduled.generation_config.dspark_cost_table = cost_table_for(target, scheduled, target_name)
            drafters[f"{label}+schedule"] = scheduled
    return drafters


def check_utf8(text: str, what: str) -> None:
    """Python turns command-line bytes that are not valid UTF-8 into lone surrogates, which no tokenizer can encode:
    name where they are and how to fix it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise UserInputError(
            f"{what} is not valid UTF-8 text (a byte at character position {error.start} cannot be decoded); "
            "pass it as UTF-8 (check the terminal's or script's encoding, e.g. LANG=C.UTF-8).") from None


def generate_once(target, tokenizer, drafter, input_ids, args, stream: bool = True, state=None):
    """(new token ids, seconds) of one speculative (drafter given) or plain (drafter None) generation; `state` is
    the `DraftingState` the session's rounds learn into."""
    sampling = {"do_sample": args.temperature > 0}
    if drafter is not None and state is not None:
        sampling["dspark_state"] = state
    if args.temperature > 0:
        sampling.update(temperature=args.temperature, top_p=args.top_p, top_k=0)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    start = time.perf_counter()
    out = target.generate(input_ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, streamer=streamer,
                          pad_token_id=tokenizer.eos_token_id, **sampling)
    return out[0, input_ids.shape[1]:], time.perf_counter() - start


def cmd_generate(args) -> int:
    from hf_dspark.models.loading import DTYPES
    from hf_dspark.targets.loading import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.chat and not args.prompt:
        print("hf-dspark generate: give a prompt, or --chat for an interactive session", file=sys.stderr)
        return 2
    if args.target is not None and args.drafter is None:
        print("hf-dspark generate: a custom --target needs its --drafter", file=sys.stderr)
        return 2
    if args.prompt is not None:
        check_utf8(args.prompt, "the prompt argument")
    costs = None
    if args.cost_table and not args.no_schedule:  # a bad file fails now, not after the models load
        from hf_dspark.policy import VerificationCostTable
        from hf_dspark.models.cost_table import CostTableError

        try:
            costs = VerificationCostTable.load(args.cost_table)
        except CostTableError as error:
            raise UserInputError(f"--cost-table: {error}") from None
    dtype = DTYPES[args.dtype]
    target, tokenizer = load_target(args.target, args.dtype, device=args.device)
    drafter = load_drafter(args.drafter or shipped_drafter_path(), dtype)
    drafter.attach_target(target, follow=True)  # beside the target's LM head, in its dtype
    if args.no_suffix:
        drafter.generation_config.dspark_suffix_drafting = False
    if args.no_schedule:
        drafter.generation_config.dspark_round_planning = False
    else:
        drafter.generation_config.dspark_cost_table = costs or cost_table_for(target, drafter,
                                                                              args.target or "smollm2-135m-instruct")
    state = DraftingState()  # what rounds learn carries over from turn to turn of the session

    messages: list[dict] = []
    prompt = args.prompt
    while True:
        if args.chat:
            try:
                prompt = input("\nyou> ").strip()
            except EOFError:
                return 0
            if prompt in ("", "/exit", "/quit"):
                return 0
        messages.append({"role": "user", "content": prompt})
        input_ids = chat_input_ids(tokenizer, messages) if not args.raw else tokenizer(prompt, return_tensors="pt").input_ids
        input_ids = input_ids.to(target.device)
        if args.chat:
            print("assistant> ", end="", flush=True)
        if args.compare and not messages[:-1]:
            # Pay one-time costs (first forwards, kernel choices, the draft head) outside both timed runs.
            for model in (drafter, None):
                learning = {"dspark_state": state} if model is not None else {}
                target.generate(input_ids[:, :8], assistant_model=model, max_new_tokens=4,
                                pad_token_id=tokenizer.eos_token_id, do_sample=False, **learning)
        tokens, seconds = generate_once(target, tokenizer, drafter, input_ids, args, state=state)
        stats = drafter.last_generation_stats
        rounds = ", ".join(f"{stats.count(source)} {label}" for source, label in
                           (("drafter", "drafter"), ("suffix", "suffix"), ("none", "plain")) if stats.count(source))
        report = (f"[{len(tokens)} tokens in {seconds:.2f} s: {len(tokens) / seconds:.1f} tokens/s, tau {stats.tau:.2f}, "
                  f"mean draft length {stats.mean_draft_length:.2f}; rounds: {rounds}]")
        if args.compare:
            plain, plain_seconds = generate_once(target, tokenizer, None, input_ids, args, stream=False)
            report += (f"\n[plain generate: {len(plain) / plain_seconds:.1f} tokens/s; speed-up "
                       f"{(len(tokens) / seconds) / (len(plain) / plain_seconds):.2f}x")
            if args.temperature == 0:
                report += f"; identical to plain greedy: {'yes' if torch.equal(plain, tokens) else 'NO'}"
            report += "]"
        print(report, file=sys.stderr, flush=True)
        messages.append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})
        if not args.chat:
            return 0


def add_parser(sub, dtypes) -> None:
    gen = sub.add_parser("generate", help="stream an answer with speculative decoding (default: SmolLM2 + the "
                                          "shipped DSpark drafter) and print tokens/s and tau")
    gen.add_argument("prompt", nargs="?", help="the user message (the chat template is applied)")
    gen.add_argument("--chat", action="store_true", help="interactive chat loop (empty line or /exit to quit)")
    gen.add_argument("--compare", action="store_true", help="also run plain decoding and print the speed-up")
    gen.add_argument("--target", default=None, help="target model path (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", default=None, help="drafter path (default: the shipped DSpark drafter)")
    gen.add_argument("--dtype", default="float32", choices=dtypes)
    add_device_argument(gen)
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--no-schedule", action="store_true",
                     help="draft and verify num_draft_slots tokens every round (dspark_round_planning=False, no cost table) "
                          "instead of the verification policy (per round the drafter's block, a suffix proposal or "
                          "a plain step, its width and the confidence-scheduled length, priced on this machine)")
    gen.add_argument("--no-suffix", action="store_true",
                     help="no suffix drafting beside the drafter (measure the drafter alone)")
    gen.add_argument("--cost-table", default=None, help="cost table from `hf-dspark profile` (default: profiled "
                                                         "once on this machine and cached)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--threads", type=int, default=None)
    gen.set_defaults(func=cmd_generate)
