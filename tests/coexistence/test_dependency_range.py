"""The transformers releases hf_dspark declares are the ones its tests ran on, and the installed one is among them."""

import tomllib
import warnings
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from hf_dspark.generation.routing import integration, route_checks
from hf_dspark.generation.routing.route_checks import SUPPORTED_TRANSFORMERS, TESTED_TRANSFORMERS, untested_release_message

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> Requirement:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = [r for r in pyproject["project"]["dependencies"] if Requirement(r).name == "transformers"]
    assert found == [SUPPORTED_TRANSFORMERS], "pyproject.toml and route_checks.SUPPORTED_TRANSFORMERS differ"
    return Requirement(found[0])


def test_the_installed_transformers_is_a_tested_release():
    message = untested_release_message()
    assert message is None, f"{message} (bash scripts/setup.sh installs a tested one)"


def test_the_declared_range_is_the_tested_set_and_its_ends_are_tested():
    declared = _declared()
    tested = sorted(Version(v) for v in TESTED_TRANSFORMERS)
    assert [str(v) for v in tested] == list(TESTED_TRANSFORMERS), "TESTED_TRANSFORMERS must be sorted"
    assert all(declared.specifier.contains(v) for v in tested)
    # The range ends at tested releases: nothing newer than the newest, nothing older than the oldest.
    bounds = {spec.operator: Version(spec.version) for spec in declared.specifier}
    assert bounds == {">=": tested[0], "<=": tested[-1]}


def test_ci_runs_the_tests_on_the_oldest_declared_release():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test_transformers_range.sh" in ci
    script = (ROOT / "scripts" / "test_transformers_range.sh").read_text()
    assert "TESTED_TRANSFORMERS[0]" in script


def test_an_untested_release_is_named_with_the_fix():
    assert untested_release_message(TESTED_TRANSFORMERS[-1]) is None
    message = untested_release_message("5.99.0")
    for part in ("transformers 5.99.0", *TESTED_TRANSFORMERS, SUPPORTED_TRANSFORMERS,
                 "scripts/test_transformers_range.sh 5.99.0"):
        assert part in message, part


def test_import_warns_once_on_an_untested_release(monkeypatch):
    class Mixin(integration.GenerationMixin):
        pass

    # The module the check reads: importing some models (Qwen3.5) makes transformers replace its module object in
    # sys.modules, so a test's own `import transformers` may be another object than hf_dspark's.
    monkeypatch.setattr(route_checks.transformers, "__version__", "5.99.0")
    monkeypatch.setattr(integration, "GenerationMixin", Mixin)  # a fresh class: installing is once per class
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        integration.install_generate_hooks(Mixin)
        integration.install_generate_hooks(Mixin)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "transformers 5.99.0 is not a release" in messages[0]


def test_hf_dspark_never_hands_transformers_the_deprecated_cache_name():
    """transformers 5.24+ names the KV cache `cache` and deprecates `past_key_values` (removal announced for 5.40):
    no call in hf_dspark passes it and no output is read through it (the suite also turns the warning into an error,
    pyproject.toml)."""
    import ast

    found = []
    for path in sorted((ROOT / "hf_dspark").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.keyword) and node.arg == "past_key_values" or (
                    isinstance(node, ast.Attribute) and node.attr == "past_key_values"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno if hasattr(node, 'lineno') else '?'}")
    assert found == []
