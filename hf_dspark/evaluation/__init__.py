"""Evaluation prompt sets shipped with hf_dspark (gsm8k, math500, aime25, humaneval, mbpp, livecodebench,
mt-bench, alpaca, arena-hard-v2; one `{"turns": [...]}` object per line), and the evaluation harness
(`evaluate`, behind `hf-dspark eval`)."""

from .prompts import BENCHMARKS, EVAL_DATA_DIR, benchmark_path  # noqa: F401  (the package's API)

_HARNESS = ("evaluate", "EvalSettings", "OutputMismatchError", "SettingsMismatchError")


def __getattr__(name: str):
    # Imported on first use: the prompt-set names above are read by training code that needs no harness.
    if name in _HARNESS:
        from . import harness

        return getattr(harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
