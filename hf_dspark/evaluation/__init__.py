"""Evaluation prompt sets shipped with hf_dspark (gsm8k, math500, aime25, humaneval, mbpp, livecodebench,
mt-bench, alpaca, arena-hard-v2; one `{"turns": [...]}` object per line), and the evaluation harness
(`evaluate`, behind `hf-dspark eval`)."""

from pathlib import Path

EVAL_DATA_DIR = Path(__file__).parent / "data"
BENCHMARKS = (
    "gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2",
)
_HARNESS = ("evaluate", "EvalSettings", "OutputMismatchError", "SettingsMismatchError")


def benchmark_path(name: str) -> Path:
    path = EVAL_DATA_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"unknown benchmark {name!r}; shipped: {', '.join(BENCHMARKS)}")
    return path


def __getattr__(name: str):
    # Imported on first use: the prompt-set names above are read by training code that needs no harness.
    if name in _HARNESS:
        from . import harness

        return getattr(harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
