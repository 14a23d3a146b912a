"""The evaluation harness behind `hf-dspark eval` and `hf_dspark.evaluation.evaluate`.

Every prompt is answered by plain decoding and by each drafter in turn, one prompt after the other, so machine
noise hits all methods alike and every drafter is judged on identical prompts. Each finished (method, benchmark,
prompt) is appended to `records.jsonl` at once: an interrupted run resumes where it stopped, and the summaries
(`results.json`, `results.md`, plots) are always recomputed from all records, never accumulated in memory.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..generation.round.stats import SpeculativeStats
from ..policy.state import DraftingState
from .prompts import EvalPrompt, chat_input_ids, load_prompt_sets
from .speed import PLAIN

RECORDS = "records.jsonl"
SETTINGS = "settings.json"
DEFAULT_TARGET_NAME = "smollm2-135m-instruct (embedded)"


class SettingsMismatchError(ValueError):
    """The output folder holds records made with other settings; mixing them would make every number wrong."""


class OutputMismatchError(AssertionError):
    """A drafter changed a greedy output: speculative decoding is no longer lossless."""


@dataclass(frozen=True)
class EvalSettings:
    """Everything that changes the outputs or timings of a record. `--max-prompts` and the benchmark list are not
    part of it: a later run may evaluate more prompts, or more sets, into the same folder."""

    target: str
    dtype: str
    drafters: dict
    max_new_tokens: int
    temperature: float
    top_p: float
    multi_turn: bool
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def differences(self, other: "EvalSettings") -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [f"{key}: {theirs[key]!r} there, {mine[key]!r} now" for key in mine if mine[key] != theirs[key]]


class RecordStore:
    """`records.jsonl` (one JSON object per finished method x prompt) and the `settings.json` it was made with.

    The settings are written with the first record, and a folder that holds no record yet takes any settings: a
    run that failed before its first record (a wrong flag, a missing file) never blocks its corrected rerun."""

    def __init__(self, folder: str | Path, settings: EvalSettings):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / RECORDS
        self.settings = settings
        self.records: dict[tuple[str, str, int], dict] = {}
        self.fingerprints: dict[tuple[str, int], str] = {}
        if self.path.is_file():
            self._load()
        settings_path = self.folder / SETTINGS
        self._settings_written = False
        if self.records and settings_path.is_file():
            stored = EvalSettings(**json.loads(settings_path.read_text()))
            differences = settings.differences(stored)
            if differences:
                raise SettingsMismatchError(
                    f"{self.folder} holds records made with different settings ({'; '.join(differences)}). "
                    "Use another output folder, or the same settings to resume.")
            self._settings_written = True
        elif self.records:
            raise SettingsMismatchError(f"{self.path} exists without {SETTINGS}; use another output folder.")

    def _load(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        valid = []
        for number, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines) - 1:  # torn by an interruption mid-write: drop it, it will be redone
                    continue
                raise ValueError(f"{self.path}: line {number + 1} is not JSON") from None
            valid.append(line)
            self._index(record)
        if len(valid) != len(lines):
            self.path.write_text("".join(line + "\n" for line in valid), encoding="utf-8")

    @staticmethod
    def key(method: str, benchmark: str, index: int) -> tuple[str, str, int]:
        return method, benchmark, int(index)

    def _index(self, record: dict) -> None:
        self.records[self.key(record["method"], record["benchmark"], record["index"])] = record
        self.fingerprints[record["benchmark"], int(record["index"])] = record["fingerprint"]

    def get(self, method: str, prompt: EvalPrompt) -> dict | None:
        return self.records.get(self.key(method, prompt.benchmark, prompt.index))

    def check_prompt(self, prompt: EvalPrompt) -> None:
        """Refuse a prompt whose text changed since its records were written (an edited prompt file)."""
        stored = self.fingerprints.get((prompt.benchmark, prompt.index))
        if stored is not None and stored != prompt.fingerprint:
            raise SettingsMismatchError(
                f"{self.path} holds another prompt as {prompt.benchmark} #{prompt.index} (the prompt file changed); "
                "use another output folder.")

    def add(self, record: dict) -> None:
        if not self._settings_written:  # before the first record: the records are never without their settings
            (self.folder / SETTINGS).write_text(json.dumps(asdict(self.settings), indent=1) + "\n")
            self._settings_written = True
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        self._index(record)


def location(path: str | Path) -> str:
    """A local path made absolute (so `./x` and `/work/x` resume alike); a Hub id unchanged."""
    return str(Path(path).resolve()) if Path(path).exists() else str(path)


def model_identity(model, path: str | Path | None = None) -> str:
    """How settings name a model: its path, plus any drafting option that changes the draft length."""
    name = path if path is not None else getattr(model, "name_or_path", "")
    name = location(name) if name else type(model).__name__
    options, defaults = [], getattr(model, "generation_config", None)
    if getattr(defaults, "num_assistant_tokens", None):
        options.append(f"draft_length={defaults.num_assistant_tokens}")
    if getattr(defaults, "assistant_confidence_threshold", None) is not None:
        options.append(f"threshold={defaults.assistant_confidence_threshold}")
    if getattr(defaults, "dspark_cost_table", None) is not None:
        options.append("throughput-schedule")
    return name + (f" ({', '.join(options)})" if options else "")


def prompt_seed(seed: int, prompt: EvalPrompt, turn: int) -> int:
    """The same sampling seed for every method on a prompt and turn, stable across runs and resumptions."""
    return (seed + zlib.crc32(f"{prompt.benchmark}/{prompt.index}/{turn}".encode())) % 2**31


def generate_record(target, tokenizer, drafter, method: str, prompt: EvalPrompt, settings: EvalSettings,
                    max_new_tokens: int | None = None, state: DraftingState | None = None) -> dict:
    """Answer the prompt (first turn, or every turn fed with this method's own earlier answers) and describe it as
    a record: per turn the new token ids, text and seconds; for a drafter, its round statistics. `state` is what the
    method's rounds learnt so far (a drafter's `DraftingState`, shared by its prompts)."""
    sampling = {"do_sample": False} if settings.greedy else {
        "do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
    turns = prompt.turns if settings.multi_turn else prompt.turns[:1]
    messages, outputs, stats = [], [], SpeculativeStats()
    device = next(target.parameters()).device
    for turn, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        input_ids = chat_input_ids(tokenizer, messages).to(device)
        torch.manual_seed(prompt_seed(settings.seed, prompt, turn))
        start = time.perf_counter()
        learning = {"dspark_state": state} if drafter is not None and state is not None else {}
        out = target.generate(input_ids, assistant_model=drafter, pad_token_id=tokenizer.eos_token_id,
                              max_new_tokens=max_new_tokens or settings.max_new_tokens, **sampling, **learning)
        seconds = time.perf_counter() - start
        new = out[0, input_ids.shape[1]:].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        outputs.append({"ids": new, "text": text, "seconds": seconds})
        if drafter is not None:
            stats = stats.merge(drafter.last_generation_stats)
    record = {"method": method, "benchmark": prompt.benchmark, "index": prompt.index,
              "fingerprint": prompt.fingerprint, "turns": outputs}
    if drafter is not None:
        record["stats"] = {"draft_lengths": stats.draft_lengths, "accepted": stats.accepted,
                           "confidences": [[round(c, 6) for c in cs] for cs in stats.confidences],
                           "sources": stats.sources, "seconds": stats.seconds}
    if prompt.reference is not None or prompt.tests:
        record["task"] = {"reference": prompt.reference, "tests": prompt.tests, "entry_point": prompt.entry_point}
    return record


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_identical(record: dict, plain: dict, folder: Path, allow_mismatch: bool) -> bool:
    """Greedy speculative output must equal plain greedy output, turn by turn. A difference is written to
    `mismatch-*.json` and, unless allowed, raised with the prompt id: a lossy drafter must not go unnoticed."""
    for turn, (mine, theirs) in enumerate(zip(record["turns"], plain["turns"])):
        if mine["ids"] != theirs["ids"]:
            where = f"{record['benchmark']} #{record['index']}"
            (folder / f"mismatch-{record['method']}-{record['benchmark']}-{record['index']}.json").write_text(
                json.dumps({"speculative": record, "plain": plain}, indent=1))
            message = (f"{record['method']} changed the greedy output of {where} (turn {turn + 1}, first "
                       f"difference at new token {first_difference(mine['ids'], theirs['ids'])})")
            if not allow_mismatch:
                raise OutputMismatchError(message + f"; both outputs are in {folder}/mismatch-*.json")
            print(f"WARNING: {message}", file=sys.stderr, flush=True)
            return False
    return True


def run_records(target, tokenizer, drafters: dict, prompts: list[EvalPrompt], store: RecordStore,
                settings: EvalSettings, *, allow_mismatch: bool = False, progress: bool = True) -> int:
    """Generate every missing (method, prompt) record, interleaved prompt by prompt; returns how many were made."""
    from tqdm.auto import tqdm

    methods = {PLAIN: None, **drafters}
    for prompt in prompts:
        store.check_prompt(prompt)
    pending = [p for p in prompts if any(store.get(m, p) is None for m in methods)]
    if not pending:
        return 0
    # What each drafter's rounds learn carries over from prompt to prompt, as it would in a serving process.
    states = {method: DraftingState() for method in drafters}
    # Untimed warm-up per method, so one-off costs (allocations, kernel selection) land on no method's clock.
    for method, drafter in methods.items():
        generate_record(target, tokenizer, drafter, method, pending[0], settings, max_new_tokens=4,
                        state=states.get(method))
    made, running = 0, {label: SpeculativeStats() for label in drafters}
    bar = tqdm(pending, desc="eval", unit="prompt", disable=not progress, file=sys.stderr)
    for prompt in bar:
        for method, drafter in methods.items():
            if store.get(method, prompt) is not None:
                continue
            record = generate_record(target, tokenizer, drafter, method, prompt, settings, state=states.get(method))
            if drafter is not None:
                if settings.greedy:
                    record["identical"] = check_identical(record, store.get(PLAIN, prompt), store.folder,
                                                          allow_mismatch)
                running[method] = running[method].merge(SpeculativeStats(
                    record["stats"]["draft_lengths"], record["stats"]["accepted"],
                    sources=record["stats"]["sources"]))
            store.add(record)
            made += 1
        bar.set_postfix({f"tau[{label}]": f"{stats.tau:.2f}" for label, stats in running.items() if stats.num_rounds})
    return made


def _default_drafters() -> dict:
    from ..models.loading import shipped_drafter_path

    return {"dspark": shipped_drafter_path("dspark")}


def evaluate(benchmarks=("gsm8k", "humaneval", "mt-bench"), *, output_dir: str | Path, target=None, tokenizer=None,
             drafters=None, max_prompts: int | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, multi_turn: bool = False, seed: int = 0, dtype: str = "float32",
             execute_code: bool = False, exec_timeout: float = 10.0, allow_mismatch: bool = False,
             progress: bool = True, command: str | None = None, target_name: str | None = None,
             device: str | None = None) -> dict:
    """Evaluate drafters against plain decoding and write `records.jsonl`, `results.json`, `results.md` and plots
    to `output_dir`; returns the results (as in `results.json`).

    `benchmarks`: shipped set names or prompt files (see `prompts.load_prompt_sets`), `max_prompts` per set.
    `target`: None for the embedded SmolLM2 default, a path, or a loaded model (then pass its `tokenizer`).
    `drafters`: None for the shipped DSpark drafter, a list of paths, or {label: path or loaded drafter}.
    `target_name` names a loaded target in the settings (default: its `name_or_path`); `device` places a target
    loaded here ("auto", "cpu", "cuda:1", ...; None = the CPU), and the drafters run beside its LM head.
    Rerunning with the same settings resumes; other settings in the same folder raise `SettingsMismatchError`.
    Greedy outputs that differ from plain greedy raise `OutputMismatchError` unless `allow_mismatch`.
    """
    from ..models.loading import load_drafter
    from ..targets.loading import load_target
    from .report import write_report
    from .summary import summarize

    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}.")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    if target is None or isinstance(target, (str, Path)):
        target_name = target_name or (DEFAULT_TARGET_NAME if target is None else location(target))
        target, tokenizer = load_target(None if target is None else str(target), dtype, device=device)
    elif tokenizer is None:
        raise ValueError("a loaded target needs its tokenizer")
    if drafters is None:
        drafters = _default_drafters()
    if not isinstance(drafters, dict):
        names = [Path(p).name for p in drafters]
        if len(names) != len(set(names)):
            raise ValueError("two drafters share a folder name; pass {label: path}")
        drafters = dict(zip(names, drafters))
    if PLAIN in drafters:
        raise ValueError(f"{PLAIN!r} is reserved for plain decoding; rename that drafter")
    loaded, identities = {}, {}
    for label, drafter in drafters.items():
        path = None
        if isinstance(drafter, (str, Path)):
            path, drafter = drafter, load_drafter(drafter, target.dtype)
        drafter.attach_target(target, follow=True)  # beside the target's LM head, in its dtype
        loaded[label], identities[label] = drafter, model_identity(drafter, path)

    settings = EvalSettings(
        target=target_name or model_identity(target), dtype=str(target.dtype).replace("torch.", ""),
        drafters=identities, max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
        multi_turn=multi_turn, seed=seed)
    prompt_sets = load_prompt_sets(list(benchmarks), max_prompts)
    store = RecordStore(output_dir, settings)
    prompts = [p for name in prompt_sets for p in prompt_sets[name]]
    run_records(target, tokenizer, loaded, prompts, store, settings, allow_mismatch=allow_mismatch,
                progress=progress)
    results = summarize(list(store.records.values()), settings, [PLAIN, *loaded], execute_code=execute_code,
                        exec_timeout=exec_timeout)
    results["command"] = command
    write_report(results, Path(output_dir))
    return results
