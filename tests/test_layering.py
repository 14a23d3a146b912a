"""Dependencies run one way: models at the bottom, then scheduling, generation, evaluation (prompt sets, harness),
training (which decontaminates against the evaluation sets), hub, the package itself, then the command line. Checked on the source (ast), so lazy imports inside functions count too, as do
`importlib.import_module("hf_dspark....")` calls; and the core imports no optional dependency at module level."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dspark"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every hf_dspark module `path` imports, anywhere in the file (absolute, relative or through importlib)."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of(source: str, name: str, is_package: bool = False) -> set[str]:
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}  # `from . import harness`
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return {m for m in found if m == "hf_dspark" or m.startswith("hf_dspark.")}


def layer(module: str) -> str:
    """`hf_dspark.models.common` -> `models`; the package itself -> `hf_dspark`; top-level modules stay themselves."""
    parts = module.split(".")
    return "hf_dspark" if len(parts) == 1 else parts[1]


SOURCES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(p) for p in SOURCES}


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        source = layer(module_name(path))
        for target in imported_modules(path):
            # `from .models import X` names a module or an attribute: keep the longest existing module name
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if layer(target) != source:
                edges.setdefault(source, set()).add(layer(target))
    return edges


def test_the_parser_sees_lazy_relative_and_importlib_imports():
    sample = textwrap.dedent("""
        import importlib
        from .common import X
        def save():
            from ..hub.remote_code import write_custom_generate
            from .. import __version__
            importlib.import_module("hf_dspark.training.trainer")
    """)
    found = imports_of(sample, "hf_dspark.models.fake")
    assert {"hf_dspark.models.common", "hf_dspark.hub.remote_code", "hf_dspark", "hf_dspark.training.trainer"} <= found
    assert layer("hf_dspark.hub.remote_code") == "hub" and layer("hf_dspark") == "hf_dspark"


def test_models_import_nothing_above_them():
    above = {"hub", "generation", "training", "evaluation", "cli", "scheduling", "hf_dspark"}
    offending = {}
    for path in (PACKAGE / "models").rglob("*.py"):
        bad = sorted(m for m in imported_modules(path) if layer(m) in above)
        if bad:
            offending[str(path.relative_to(PACKAGE))] = bad
    assert offending == {}


def test_there_are_no_package_level_cycles():
    edges = graph()

    def cycle_from(start):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in (cycle_from(n) for n in sorted(edges)) if c]
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)
    # The order the layers form (each imports only layers to its left):
    order = ["_version", "models", "scheduling", "generation", "evaluation", "training", "hub", "hf_dspark", "cli",
             "__main__"]
    for source, targets in edges.items():
        for target in targets:
            assert order.index(target) < order.index(source), f"{source} imports {target}"


@pytest.mark.parametrize("optional", ["accelerate", "peft", "matplotlib"])
def test_the_core_imports_no_optional_dependency(optional):
    """With the extra missing, the package, its generation, hub, convert, eval harness and command line import."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules[{optional!r}] = None  # `import {optional}` now raises ImportError
        import hf_dspark, hf_dspark.cli.main, hf_dspark.hub.convert, hf_dspark.hub.push, hf_dspark.evaluation.harness
        import hf_dspark.evaluation.report, hf_dspark.generation.batched, hf_dspark.scheduling.simulation
        hf_dspark.cli.main.build_parser()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
