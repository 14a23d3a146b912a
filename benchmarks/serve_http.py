"""Issue 43: serving over HTTP, in the form `vllm bench serve` / GuideLLM use: each method is a real server process
on loopback, driven by the official `openai` client (streaming chat completions with usage, greedy).

    python benchmarks/serve_http.py --output benchmarks/serve-http/results.json
    python benchmarks/serve_http.py --rates 1 --concurrency 1,4 --requests 6 --max-tokens 32 --output /tmp/http.json

Methods (`--methods`): `dspark` (`hf-dspark serve`, its defaults: the shipped DSpark drafter, cost table and round
planning), `plain` (`hf-dspark serve --drafter none`: the same engine, one target token per row per round),
`transformers-cb` (`transformers serve --continuous-batching`) and `transformers` (`transformers serve`), all on the
embedded SmolLM2-135M-Instruct in float32 with `--threads` torch threads (OMP_NUM_THREADS too), the same prompts
and settings. Loads: Poisson arrivals at `--rates` requests/s (the same exponential draws at every rate, scaled),
then a closed loop at each `--concurrency` (that many clients, each sending its next request when its last one
ends), `--requests` chat prompts of mixed lengths (held-out math, code and chat first turns) per load.

`--repeats` passes; a pass starts a fresh server per method (idle while another is measured) and runs each load on
every method back to back, the order rotated load by load and pass by pass, so that the machine's slow spells (the
same method here runs 0.75-1.25x its median a minute apart) fall on the methods alike. Each pass's runs are in the
table and `dspark` is compared with each other method paired by pass and load (the median ratio and every pass's).

Per method and load: completed and failed requests, time to first token and inter-token latency (the gaps between
streamed chunks, as `vllm bench serve`; a chunk may carry several tokens) p50 / p99, end-to-end latency, per-user
tokens/s (a request's tokens / (its end - its arrival)) and aggregate tokens/s (all tokens / (last end - first
arrival)). Written: `--output` JSON, a .md beside it and a Pareto plot (.png: per-user against aggregate tokens/s,
one line per method across the loads, medians over the passes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from serving_common import (command_line, draw_sequences, environment, fmt, git_state, md_table, percentile,
                            prompt_pools, unit_arrival_times, write_report, add_prompt_arguments)

METHODS = ("dspark", "plain", "transformers-cb", "transformers")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--methods", default=",".join(METHODS), help=f"subset of {', '.join(METHODS)}")
parser.add_argument("--rates", default="0.25,0.5,1", help="Poisson arrival rates (requests/s), comma-separated")
parser.add_argument("--concurrency", default="1,4,16", help="closed-loop client counts, comma-separated")
parser.add_argument("--requests", type=int, default=16, help="requests per load")
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--repeats", type=int, default=1,
                    help="passes (fresh servers each; every load on every method back to back, rotated)")
parser.add_argument("--startup-timeout", type=float, default=600)
parser.add_argument("--output", default="benchmarks/serve-http/results.json")
add_prompt_arguments(parser, max_prompt_tokens=384)
args = parser.parse_args()
methods = args.methods.split(",")
if not set(methods) <= set(METHODS):
    raise SystemExit(f"--methods must name only {', '.join(METHODS)}")
rates = [float(r) for r in args.rates.split(",") if r]
concurrencies = [int(c) for c in args.concurrency.split(",") if c]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(method: str, port: int, model_dir: str) -> list[str]:
    if method in ("dspark", "plain"):
        extra = ["--drafter", "none"] if method == "plain" else []
        return [sys.executable, "-m", "hf_dspark", "serve", "--port", str(port), "--threads", str(args.threads),
                "--log-level", "warning", *extra]
    extra = ["--continuous-batching"] if method == "transformers-cb" else []
    return ["transformers", "serve", model_dir, "--port", str(port), "--host", "127.0.0.1", "--device", "cpu",
            "--dtype", "float32", "--log-level", "warning", *extra]


def start_server(method: str, model_dir: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(args.output).with_name(f"server-{method}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    process = subprocess.Popen(server_command(method, port, model_dir), stdout=log.open("w"),
                               stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{method}: the server exited with {process.returncode}; see {log}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                return process, f"http://127.0.0.1:{port}/v1", log
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{method}: not healthy after {args.startup_timeout} s; see {log}")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


async def one_request(client, model: str, text: str, arrival: float, clock_start: float) -> dict:
    record = {"arrival": arrival, "ok": False, "chunks": [], "tokens": 0, "error": None}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=args.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        pieces = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                record["chunks"].append(time.perf_counter() - clock_start)
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage:
                record["tokens"] = chunk.usage.completion_tokens
        record.update(ok=True, end=time.perf_counter() - clock_start, text="".join(pieces))
    except Exception as error:  # a failed request counts as failed, the run goes on
        record.update(error=f"{type(error).__name__}: {error}", end=time.perf_counter() - clock_start)
    return record


async def poisson_load(url: str, model: str, texts: list[str], arrivals: list[float]) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=900) as client:
        start = time.perf_counter()

        async def at(text, arrival):
            await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - start)))
            return await one_request(client, model, text, arrival, start)

        return await asyncio.gather(*(at(t, a) for t, a in zip(texts, arrivals)))


async def closed_loop(url: str, model: str, texts: list[str], clients: int) -> list[dict]:
    import openai

    queue = list(enumerate(texts))
    records = [None] * len(texts)
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=900) as client:
        start = time.perf_counter()

        async def worker():
            while queue:
                index, text = queue.pop(0)
                records[index] = await one_request(client, model, text, time.perf_counter() - start, start)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return records


def summarise(method: str, load: str, records: list[dict], tokenizer) -> dict:
    done = [r for r in records if r["ok"] and r["chunks"]]
    for r in done:
        if not r["tokens"]:  # a server without usage in its stream: count the text's tokens
            r["tokens"] = len(tokenizer(r["text"], add_special_tokens=False).input_ids)
    ttft = [r["chunks"][0] - r["arrival"] for r in done]
    itl = [b - a for r in done for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["end"] - r["arrival"] for r in done]
    per_user = [r["tokens"] / (r["end"] - r["arrival"]) for r in done]
    span = max((r["end"] for r in done), default=0) - min((r["arrival"] for r in records), default=0)
    tokens = sum(r["tokens"] for r in done)
    return {"method": method, "load": load, "completed": len(done), "failed": len(records) - len(done),
            "errors": sorted({r["error"] for r in records if r["error"]})[:3], "tokens": tokens,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
            "e2e_p50_s": percentile(e2e, 0.5), "e2e_p99_s": percentile(e2e, 0.99),
            "per_user_tokens_per_s_mean": sum(per_user) / len(per_user) if per_user else float("nan"),
            "per_user_tokens_per_s_p50": percentile(per_user, 0.5),
            "aggregate_tokens_per_s": tokens / span if span > 0 else float("nan"),
            "texts": [r.get("text") for r in records]}


def identical_to_dspark(runs: list[dict]) -> dict:
    """Per method, how many of its greedy answers equal `dspark`'s to the same prompt under the same load."""
    reference = {(r["load"], r.get("repeat", 0)): r["texts"] for r in runs if r["method"] == "dspark"}
    counts = {}
    for run in runs:
        key = (run["load"], run.get("repeat", 0))
        if run["method"] == "dspark" or key not in reference:
            continue
        same, total = counts.get(run["method"], (0, 0))
        pairs = list(zip(run["texts"], reference[key]))
        counts[run["method"]] = (same + sum(a is not None and a == b for a, b in pairs), total + len(pairs))
    return {method: f"{same}/{total}" for method, (same, total) in counts.items()}


def ratio_lines(runs: list[dict]) -> list[str]:
    """`dspark` against each other method, load by load, paired by pass: aggregate and mean per-user tokens/s, each
    pass's ratio and their median (the comparison the issue's Must asks, with its spread)."""
    by = {(r["method"], r["load"], r.get("repeat", 0)): r for r in runs}
    loads = list(dict.fromkeys(r["load"] for r in runs))
    others = [m for m in dict.fromkeys(r["method"] for r in runs) if m != "dspark"]
    passes = sorted({r.get("repeat", 0) for r in runs})
    rows = []
    for load in loads:
        for other in others:
            pairs = [(by["dspark", load, k], by[other, load, k]) for k in passes
                     if ("dspark", load, k) in by and (other, load, k) in by]
            if not pairs:
                continue
            cells = [load, other]
            for metric in ("aggregate_tokens_per_s", "per_user_tokens_per_s_mean"):
                ratios = [mine[metric] / theirs[metric] for mine, theirs in pairs]
                cells.append(f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})")
            rows.append(cells)
    if not rows:
        return []
    return ["", "`dspark` / the other method, paired by pass: median (each pass)", ""] + md_table(
        ["load", "against", "aggregate tok/s", "per-user tok/s (mean)"], rows)


def report(results: dict) -> list[str]:
    lines = [f"# HTTP serving benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Command: `{results['command']}`", "", f"Environment: {results['environment']}", ""]
    header = ["load", "method", "pass", "ok / failed", "TTFT p50 / p99 s", "ITL p50 / p99 ms", "e2e p50 / p99 s",
              "per-user tok/s (mean)", "aggregate tok/s"]
    rows = [[r["load"], r["method"], r.get("repeat", 0) + 1, f"{r['completed']} / {r['failed']}",
             f"{fmt(r['ttft_p50_s'])} / {fmt(r['ttft_p99_s'])}",
             f"{fmt(1000 * r['itl_p50_s'], 1)} / {fmt(1000 * r['itl_p99_s'], 1)}",
             f"{fmt(r['e2e_p50_s'])} / {fmt(r['e2e_p99_s'])}", fmt(r["per_user_tokens_per_s_mean"]),
             fmt(r["aggregate_tokens_per_s"])] for r in results["runs"]]
    lines += md_table(header, rows)
    lines += ratio_lines(results["runs"])
    for method, reason in results["not_run"].items():
        lines += ["", f"`{method}` did not run: {reason}"]
    same = results.get("identical_to_dspark")
    if same:
        lines += ["", "Greedy answers identical to `dspark`'s, per method: " +
                  ", ".join(f"{m} {v}" for m, v in same.items())]
    return lines


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 5))
    for method in {r["method"] for r in results["runs"]}:
        loads = {}
        for r in results["runs"]:
            if r["method"] == method:
                loads.setdefault(r["load"], []).append(r)
        points = sorted((statistics.median(r["aggregate_tokens_per_s"] for r in runs),
                         statistics.median(r["per_user_tokens_per_s_mean"] for r in runs)) for runs in loads.values())
        axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=method)
    axis.set_xlabel("aggregate tokens/s")
    axis.set_ylabel("per-user tokens/s (mean)")
    axis.set_title("HTTP serving, SmolLM2-135M-Instruct, CPU")
    axis.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    from hf_dspark.targets.default_target import default_target_dir, load_default_target

    _, tokenizer = load_default_target()  # materialises the cached copy transformers serve loads
    pools = prompt_pools(args, tokenizer)
    texts = [p.text for p in draw_sequences(pools, 1, args.requests, args.seed)[0]]
    unit = unit_arrival_times(len(texts), args.seed + 1)
    output = Path(args.output)
    loads = [f"poisson {rate:g}/s" for rate in rates] + [f"closed {c}" for c in concurrencies]

    def run_load(url: str, model: str, load: str):
        kind, value = load.split()
        if kind == "poisson":
            rate = float(value.removesuffix("/s"))
            return poisson_load(url, model, texts, [a / rate for a in unit])
        return closed_loop(url, model, texts, int(value))

    results = {"command": command_line(), "git": git_state(), "environment": environment(args.threads),
               "settings": vars(args), "runs": [], "not_run": {}}
    for repeat in range(args.repeats):
        servers = {}  # method -> (process, url, model), started together: a load runs on each back to back
        try:
            for method in methods:
                if method in results["not_run"]:
                    continue
                try:
                    process, url, _ = start_server(method, str(default_target_dir()))
                except RuntimeError as error:
                    results["not_run"][method] = str(error)
                    continue
                model = ("HuggingFaceTB/SmolLM2-135M-Instruct" if method in ("dspark", "plain")
                         else str(default_target_dir()))
                servers[method] = process, url, model
                asyncio.run(closed_loop(url, model, texts[:2], 1))  # warm-up: first forwards, kernel choices
            order = list(servers)
            for index, load in enumerate(loads):
                shift = (repeat + index) % max(1, len(order))
                for method in order[shift:] + order[:shift]:
                    _, url, model = servers[method]
                    print(f"== pass {repeat + 1}/{args.repeats}, {method}: {load}", file=sys.stderr, flush=True)
                    results["runs"].append({**summarise(method, load, asyncio.run(run_load(url, model, load)),
                                                        tokenizer), "repeat": repeat})
                    write_report(output, results, report(results))
        finally:
            for process, _, _ in servers.values():
                stop_server(process)
    results["identical_to_dspark"] = identical_to_dspark(results["runs"])
    md = write_report(output, results, report(results))
    plot(results, output.with_suffix(".png"))
    print(f"written to {output} and {md}", file=sys.stderr)


if __name__ == "__main__":
    main()
