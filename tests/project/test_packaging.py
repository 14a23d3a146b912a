"""An installed copy works with no repository beside it: a non-editable install into a fresh virtual environment
finds the shipped drafters (package data), loads them, renders cards and runs `python -m hf_dspark generate`."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import hf_dspark
    from transformers import AutoModel
    from hf_dspark.hub.model_card import TEMPLATE
    shipped = {kind: hf_dspark.shipped_drafter_path(kind) for kind in ("dspark", "dflash", "eagle3")}
    drafter = hf_dspark.DSparkDraftModel.from_pretrained(shipped["dspark"])
    loaded = {kind: type(AutoModel.from_pretrained(path)).__name__ for kind, path in shipped.items()}
    print(json.dumps({
        "module": hf_dspark.__file__,
        "shipped": {kind: str(path) for kind, path in shipped.items()},
        "files": {kind: sorted(p.name for p in path.rglob("*")) for kind, path in shipped.items()},
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "loaded": loaded,
        "template": TEMPLATE.is_file() and not TEMPLATE.parent.is_symlink(),
    }))
""")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A wheel built from this source tree, installed (not editable) with `pip install --no-deps` into a fresh venv
    that reuses this interpreter's torch and transformers through a .pth file naming this interpreter's
    site-packages folders. (`--system-site-packages` would give the *base* interpreter's packages, which lack them
    when the tests run inside a venv.) The editable copy of the repository stays out of the way: the venv's own
    site-packages come first, and the listed folders' own .pth files (the editable install's among them) are not
    read."""
    import shutil

    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("hf_dspark", "hf_dspark_launch"):  # the library, and the console script's entry point
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path_factory.mktemp("wheels")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)],
                           capture_output=True, text=True, cwd=source, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(wheels.glob("hf_dspark-*.whl"))
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, cwd=venv,
                             timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    # Only now, so that pip cannot take this interpreter's editable hf_dspark for the one to install.
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(venv_site) / "running-interpreter.pth").write_text("".join(f"{folder}\n" for folder in _site_folders()))
    return python


def _site_folders():
    """This interpreter's site-packages folders, in its own search order (a venv's before its base's)."""
    import site

    folders = {os.path.realpath(folder) for folder in [*site.getsitepackages(), site.getusersitepackages()]}
    return [entry for entry in sys.path if entry and os.path.isdir(entry) and os.path.realpath(entry) in folders]


def _run(python, args, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


@pytest.mark.install
def test_installed_copy_finds_and_loads_the_shipped_drafters(installed, tmp_path):
    result = _run(installed, ["-c", CHECK], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    site = installed.parent.parent  # the venv
    assert Path(found["module"]).is_relative_to(site), found["module"]  # the installed copy, not the repository
    for kind, path in found["shipped"].items():
        assert Path(path).is_relative_to(site) and not Path(path).is_relative_to(ROOT), path
        assert found["files"][kind] == sorted(
            ["README.md", "config.json", "model.safetensors", "training_log.jsonl", "training_stages.json",
             "training_summary.json"])
    assert found["parameters"] > 1_000_000
    assert found["loaded"] == {"dspark": "DSparkDraftModel", "dflash": "DSparkDraftModel",
                               "eagle3": "Eagle3DraftModel"}
    assert found["template"]


@pytest.mark.install
def test_installed_copy_runs_the_readme_command(installed, tmp_path):
    """The README's first command (`python -m hf_dspark generate ... --compare`), from a folder with no repository,
    a few tokens long so that it stays inside CI time."""
    result = _run(installed, ["-m", "hf_dspark", "generate", "What is 12 times 12?", "--compare", "--no-schedule",
                              "--max-new-tokens", "12", "--threads", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identical to plain greedy: yes" in result.stderr, result.stderr[-2000:]
