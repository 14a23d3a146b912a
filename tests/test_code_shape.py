"""The package stays changeable by a newcomer: files of one concern under 450 lines, functions under 80, and no
decoding setting or learning state kept on the drafter object."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dspark"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 80


def test_no_file_is_over_450_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"split these by concern: {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert long == {}, f"split these into named steps: {long}"


def test_generation_code_reads_no_setting_off_the_drafter():
    """Settings come from the call's `DraftingPlan`; a `drafter.<setting>` read would bring back hidden state."""
    settings = {"num_draft_tokens", "confidence_threshold", "confidence_threshold_rule", "verification_costs",
                "learn_round_costs", "round_planning", "suffix_drafting", "verification_policy", "time_phases",
                "proposal_statistics", "last_batch_output"}
    found = []
    for path in SOURCES:
        if path.parent.name in ("models", "formats"):  # configs keep the two fields that seed generation_config
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in settings and \
                    isinstance(node.value, ast.Name) and node.value.id in ("drafter", "model", "self"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in settings:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} getattr(..., {node.args[1].value!r})")
    assert found == []
