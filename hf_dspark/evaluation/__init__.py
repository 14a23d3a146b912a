"""Evaluation prompt sets shipped with hf_dspark (gsm8k, math500, aime25, humaneval, mbpp, livecodebench,
mt-bench, alpaca, arena-hard-v2; one `{"turns": [...]}` object per line)."""

from pathlib import Path

EVAL_DATA_DIR = Path(__file__).parent / "data"
BENCHMARKS = (
    "gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2",
)


def benchmark_path(name: str) -> Path:
    path = EVAL_DATA_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"unknown benchmark {name!r}; shipped: {', '.join(BENCHMARKS)}")
    return path
