"""`hf-dspark serve`: an OpenAI-compatible server (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
`/v1/models`, `/health`, `/metrics`) on the speculative engine. With no arguments: the embedded SmolLM2-135M-Instruct target with
the shipped DSpark drafter on http://127.0.0.1:8000/v1."""

from __future__ import annotations

import importlib.util

import torch

from hf_dspark.models.errors import UserInputError

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "openai")
POLICY_HELP = "how many drafted tokens each round verifies: all, fixed:K or threshold:T (default: the drafter's own)"


def _policy(value: str | None):
    """`--verification-policy` as `dspark_verification_policy`: "all", ("fixed", K) or ("threshold", T)."""
    if value is None or value == "all":
        return value
    name, _, argument = value.partition(":")
    try:
        if name == "fixed" and argument:
            return ("fixed", int(argument))
        if name == "threshold" and argument:
            return ("threshold", float(argument))
    except ValueError:
        pass
    raise UserInputError(f"--verification-policy {value}: {POLICY_HELP.split(': ', 1)[1]}")


def check_arguments(args) -> None:
    """The flags that cannot work, named before anything loads."""
    rules = [
        ("--port", args.port, 0 <= args.port <= 65535, "must be 0..65535 (0: any free port)"),
        ("--max-running", args.max_running, args.max_running >= 1, "must be at least 1"),
        ("--max-queued", args.max_queued, args.max_queued >= 0, "must be at least 0"),
        ("--threads", args.threads, args.threads is None or args.threads >= 1, "must be at least 1"),
        ("--shutdown-timeout", args.shutdown_timeout, args.shutdown_timeout >= 0, "must be at least 0 seconds"),
        ("--draft-length", args.draft_length, args.draft_length is None or args.draft_length >= 1,
         "must be at least 1"),
        ("--confidence-threshold", args.confidence_threshold,
         args.confidence_threshold is None or args.confidence_threshold >= 0, "must be >= 0"),
    ]
    for flag, value, ok, rule in rules:
        if not ok:
            raise UserInputError(f"{flag} {rule}, got {value}")
    if args.target is not None and args.drafter is None:
        raise UserInputError("a custom --target needs its --drafter (or --drafter none for plain continuous batching)")
    if args.api_key is not None and not args.api_key.strip():
        raise UserInputError("--api-key is empty")
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserInputError(f"hf-dspark serve needs {', '.join(missing)}: install them with "
                             "pip install 'hf-dspark[serve]'")
    _policy(args.verification_policy)


def load_drafter_for(args, target, costs=None):
    """The drafter `--drafter` names (a folder, a shipped kind, or none), with the command's drafting settings in
    its `generation_config`, where the engine reads them as `generate()` does."""
    from hf_dspark.cli.generate import cost_table_for
    from hf_dspark.models.loading import SHIPPED_KINDS, load_drafter, shipped_drafter_path

    if args.drafter is not None and args.drafter.lower() == "none":
        return None
    path = args.drafter
    if path is None or path in SHIPPED_KINDS:
        path = shipped_drafter_path(path or "dspark")
    drafter = load_drafter(path, target.dtype)
    drafter.attach_target(target, follow=True)
    config = drafter.generation_config
    settings = {"num_assistant_tokens": args.draft_length, "assistant_confidence_threshold": args.confidence_threshold,
                "dspark_confidence_threshold_rule": args.threshold_rule,
                "dspark_verification_policy": _policy(args.verification_policy)}
    for name, value in settings.items():
        if value is not None:
            setattr(config, name, value)
    if args.no_suffix:
        config.dspark_suffix_drafting = False
    if args.no_round_planning:
        config.dspark_round_planning = False
    if costs is not None:
        config.dspark_cost_table = costs
    elif not args.no_schedule:
        config.dspark_cost_table = cost_table_for(target, drafter, args.target or "smollm2-135m-instruct")
    return drafter


def cmd_serve(args) -> int:
    check_arguments(args)
    from hf_dspark.serve import bind_socket, build_state, run
    from hf_dspark.targets.loading import load_target

    try:
        sock = bind_socket(args.host, args.port)  # before minutes of loading: a port in use fails now
    except OSError as error:
        raise UserInputError(f"--host {args.host} --port {args.port}: cannot listen there ({error.strerror or error})"
                             ) from None
    costs = None
    if args.cost_table and not args.no_schedule:  # a bad file fails now, not after the models load
        from hf_dspark import VerificationCostTable

        costs = VerificationCostTable.load(args.cost_table)
    with sock:
        if args.threads:
            torch.set_num_threads(args.threads)
        target, tokenizer = load_target(args.target, args.dtype, device=args.device)
        drafter = load_drafter_for(args, target, costs)
        try:
            state = build_state(target, tokenizer, drafter, model_name=args.served_model_name or args.target or
                                DEFAULT_MODEL_NAME, max_running=args.max_running, max_queued=args.max_queued,
                                api_key=args.api_key)
        except ValueError as error:  # a drafting setting the engine refuses
            raise UserInputError(str(error)) from None
        run(state, sock, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
    return 0


def add_parser(sub, dtypes) -> None:
    from hf_dspark.cli.generate import add_device_argument

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the speculative engine (default: SmolLM2 + "
                                         "the shipped DSpark drafter on 127.0.0.1:8000)")
    serve.add_argument("--target", default=None, help="target model path (default: embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--drafter", default=None,
                       help="drafter folder, a shipped kind (dspark, dflash, eagle3), or none for plain continuous "
                            "batching (default: the shipped DSpark drafter)")
    serve.add_argument("--served-model-name", default=None,
                       help=f"the model name clients ask for (default: --target, or {DEFAULT_MODEL_NAME})")
    serve.add_argument("--dtype", default="float32", choices=dtypes)
    add_device_argument(serve)
    serve.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-running", type=int, default=32,
                       help="sequences decoded together (each choice of a request counts); more wait in the queue")
    serve.add_argument("--max-queued", type=int, default=256,
                       help="sequences that may wait beyond the running ones; past it requests get 429 + Retry-After")
    serve.add_argument("--api-key", default=None, help="require this bearer token on /v1 (Authorization: Bearer KEY)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM / Ctrl-C: seconds the requests in flight may take to finish before they "
                            "are cancelled (then the server exits 0)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    drafting = serve.add_argument_group("drafting (as generate(); unset: the drafter's generation_config)")
    drafting.add_argument("--no-schedule", action="store_true",
                          help="no cost table (by default one is profiled once on this machine and cached, as "
                               "`hf-dspark generate` does)")
    drafting.add_argument("--cost-table", default=None, help="cost table from `hf-dspark profile`")
    drafting.add_argument("--no-suffix", action="store_true", help="no suffix drafting beside the drafter")
    drafting.add_argument("--no-round-planning", action="store_true",
                          help="draft with the drafter every round (no per-round choice of drafter / suffix / plain)")
    drafting.add_argument("--draft-length", type=int, default=None, help="drafted slots per round (num_assistant_tokens)")
    drafting.add_argument("--confidence-threshold", type=float, default=None,
                          help="stop drafting below this confidence (assistant_confidence_threshold)")
    drafting.add_argument("--threshold-rule", default=None, choices=["cumulative", "per_slot"],
                          help="what the threshold compares: c_1...c_j or c_j")
    drafting.add_argument("--verification-policy", default=None, help=POLICY_HELP)
    serve.set_defaults(func=cmd_serve)
