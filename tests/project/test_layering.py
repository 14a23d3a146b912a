"""Dependencies run one way, at every level. Between the top-level packages: transformers_internals (every use of transformers' private API) at the bottom, then
models, targets (the default target and `load_target`), policy, generation, evaluation (prompt sets, harness), training
(which decontaminates against the evaluation sets), hub, the package itself, then the command line. Checked on the
source (ast), so lazy imports inside functions count too, as do `importlib.import_module("hf_dspark....")` calls. No
two modules import each other, directly or round a longer circle, when they are imported; and the core imports no
optional dependency at module level.

Inside every package the same holds between its parts (its modules and sub-packages): no circle, so each part
imports only parts below it. `generation/`'s parts are named in their order: the round and its steps (`round/`),
what a call resolves (`call/`: settings, plan, outputs), the two loops (`one_prompt/`, `engine/`, neither importing
the other), and the routing of a call at the top (`routing/`)."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_dspark"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every hf_dspark module `path` imports, anywhere in the file (absolute, relative or through importlib)."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every hf_dspark module `source` (the text of module `name`) imports, anywhere in it."""
    return _imported_by(ast.walk(ast.parse(source)), name, is_package)


def module_level_imports_of(source: str, name: str, is_package: bool = False) -> set[str]:
    """The hf_dspark modules `source` imports when it is itself imported: every import but those inside functions,
    which run only when the function is called."""
    return _imported_by(_outside_functions(ast.parse(source)), name, is_package)


def _outside_functions(tree: ast.AST):
    """Every node of `tree` except the bodies of functions (and lambdas)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        pending.extend(child for child in ast.iter_child_nodes(node)
                       if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _imported_by(nodes, name: str, is_package: bool) -> set[str]:
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in nodes:
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
    """`hf_dspark.models.errors` -> `models`; the package itself -> `hf_dspark`; top-level modules stay themselves."""
    parts = module.split(".")
    return "hf_dspark" if len(parts) == 1 else parts[1]


SOURCES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(p) for p in SOURCES}


def existing_module(target: str) -> str:
    """`from .models import X` names a module or an attribute: the longest existing module name in `target`."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        source = layer(module_name(path))
        for target in imported_modules(path):
            target = existing_module(target)
            if layer(target) != source:
                edges.setdefault(source, set()).add(layer(target))
    return edges


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports at module level (`module_level_imports_of`)."""
    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        source = module_name(path)
        targets = module_level_imports_of(path.read_text(), source, path.name == "__init__.py")
        edges[source] = {existing_module(t) for t in targets} - {source}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm): the import circles."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


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
    assert module_level_imports_of(sample, "hf_dspark.models.fake") == {"hf_dspark.models.common",
                                                                        "hf_dspark.models.common.X"}


def test_the_circle_finder_finds_circles_of_any_length():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_models_import_nothing_above_them():
    above = {"targets", "hub", "generation", "training", "evaluation", "cli", "policy", "hf_dspark"}
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
    order = ["_version", "transformers_internals", "models", "targets", "policy", "generation", "evaluation", "training",
             "hub", "hf_dspark", "serve", "cli", "__main__"]
    for source, targets in edges.items():
        for target in targets:
            assert order.index(target) < order.index(source), f"{source} imports {target}"


def test_there_are_no_module_level_import_circles():
    """No module imports, when it is imported, a module that imports it back, directly or round a longer circle:
    such a circle works or fails by which module a user happens to import first. Counted: every import outside a
    function body (a module's top level, its `if`/`try` blocks and class bodies), including relative imports,
    `from package import name` (an edge to the package's `__init__`) and `importlib.import_module` calls.
    Imports inside functions run only when called, so they are left out here (the layer tests above count them)."""
    found = circles(module_graph())
    assert found == [], " ; ".join(" <-> ".join(group) for group in found)


def test_there_are_no_import_circles_through_lazy_imports_either():
    """The same with every import counted, those inside functions too: a lazy import that closes a circle still
    ties the modules together (neither can be changed or moved alone), even when it cannot fail at import time."""
    edges = {}
    for path in SOURCES:
        source = module_name(path)
        edges[source] = {existing_module(t) for t in imported_modules(path)} - {source}
    found = circles(edges)
    assert found == [], " ; ".join(" <-> ".join(group) for group in found)


PACKAGES = sorted(module_name(p) for p in SOURCES if p.name == "__init__.py")
GENERATION_ORDER = ["round", "call", "one_prompt", "engine", "routing"]


def part_graph(package: str) -> dict[str, set[str]]:
    """The parts of `package` (its direct modules and sub-packages, by name) -> the parts each imports, every
    import counted (lazy ones too); a package's `__init__` is not one of its parts."""
    def part(module: str) -> str | None:
        return module[len(package) + 1:].split(".")[0] if module.startswith(package + ".") else None

    edges: dict[str, set[str]] = {}
    for path in SOURCES:
        source = part(module_name(path))
        if source is None:
            continue
        for target in imported_modules(path):
            target = part(existing_module(target))
            if target is not None and target != source:
                edges.setdefault(source, set()).add(target)
    return edges


def test_the_part_graph_sees_parts_of_a_package():
    edges = part_graph("hf_dspark.generation")
    assert edges["routing"] >= {"call", "engine", "one_prompt"} and "round" in edges["engine"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_has_a_circle_between_its_parts(package):
    found = circles(part_graph(package))
    assert found == [], " ; ".join(" <-> ".join(group) for group in found)


def test_generation_imports_only_downward():
    edges = part_graph("hf_dspark.generation")
    assert set(edges) | {t for targets in edges.values() for t in targets} <= set(GENERATION_ORDER)
    for source, targets in edges.items():
        for target in targets:
            assert GENERATION_ORDER.index(target) < GENERATION_ORDER.index(source), f"{source} imports {target}"
    assert "engine" not in edges.get("one_prompt", set()), "the loops share steps through round/, not each other"


@pytest.mark.parametrize("optional", ["accelerate", "peft", "matplotlib"])
def test_the_core_imports_no_optional_dependency(optional):
    """With the extra missing, the package, its generation, hub, convert, eval harness and command line import."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules[{optional!r}] = None  # `import {optional}` now raises ImportError
        import hf_dspark, hf_dspark.cli.main, hf_dspark.hub.convert, hf_dspark.hub.push, hf_dspark.evaluation.harness
        import hf_dspark.evaluation.report, hf_dspark.generation.engine.speculative_engine, hf_dspark.evaluation.simulation
        hf_dspark.cli.main.build_parser()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
