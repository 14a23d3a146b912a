"""The tests a newcomer reads: grouped by concern in folders, fixtures in `conftest.py` (never imported by name),
shared helpers in modules beside it, and no test that turns a failure into a skip."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TEST_FILES = sorted(TESTS.rglob("test_*.py"))


def skips_inside_except(source: str) -> list[int]:
    """Lines of `pytest.skip(...)` calls inside an `except` clause: a failure the test would turn into a skip."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler):
            for inner in ast.walk(node):
                if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr == "skip"
                        and getattr(inner.func.value, "id", None) == "pytest"):
                    found.append(inner.lineno)
    return found


def test_the_skip_finder_sees_a_skip_in_an_except_clause():
    source = "import pytest\ntry:\n    x = 1\nexcept ValueError as e:\n    pytest.skip(str(e))\npytest.skip('fine')\n"
    assert skips_inside_except(source) == [5]


def test_every_test_module_lives_in_a_concern_folder():
    assert len(TEST_FILES) > 50
    assert [p.name for p in TEST_FILES if p.parent == TESTS] == []


def test_no_module_imports_conftest():
    offending = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "conftest" or \
                    isinstance(node, ast.Import) and any(alias.name == "conftest" for alias in node.names):
                offending.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert offending == []


def test_no_test_turns_a_failure_into_a_skip():
    found = {str(p.relative_to(TESTS)): lines for p in TEST_FILES if (lines := skips_inside_except(p.read_text()))}
    assert found == {}
