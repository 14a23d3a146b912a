"""The README's Python API block runs as written, in a fresh interpreter, on the embedded target and shipped drafter."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_api_block() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_python_api_block_names_only_what_it_defines():
    block = python_api_block()
    assert "import hf_dspark" in block and "load_default_target" in block and "shipped_drafter_path" in block
    assert "org/" not in block, "the block must not load a placeholder repository"


@pytest.mark.slow
def test_the_python_api_block_runs_as_written(tmp_path):
    # A fresh process from another folder: nothing but the installed package and the block itself.
    done = subprocess.run([sys.executable, "-c", python_api_block()], cwd=tmp_path, capture_output=True, text=True,
                          timeout=1800, env={**__import__("os").environ, "OMP_NUM_THREADS": "2",
                                             "PYTHONPATH": str(README.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch.Size([" in done.stdout
