"""Task quality of an answer: final-answer extraction (math sets) and test execution (code sets).

Speculative decoding is lossless, so its answers must score exactly as plain decoding's do; for greedy decoding
they must be the same answers. The harness reports the *agreement* of extracted answers between speculative and
plain decoding for every set, and accuracy / pass@1 for prompts that carry references or tests: the shipped
gsm8k and math500 carry reference answers, humaneval and mbpp their tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
SINGLE_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
UNIT = re.compile(r"^(-?[\d.,]+)\s*\\(?:text|mbox)\{\s*[A-Za-z][A-Za-z ]*\}(?:\^\{?\d\}?)?$")
"""A number followed by a unit word (`5.4 \\text{ cents}`, `15\\mbox{ cm}^2`): the number is the answer."""
CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included; None if there is none or
    it is cut off (an unfinished answer is no answer)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators dropped and integral floats written as integers
    (`1,000.00` -> `1000`), so `$18.` and `18` agree."""
    matches = NUMBER.findall(text)
    if not matches:
        return None
    value = matches[-1].replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".") or "0"
    return "0" if value in ("-0", "") else value


def extract_number_answer(text: str) -> str | None:
    """GSM8K: the last number. The shipped prompts ask for `\\boxed{}`, so a boxed answer is preferred (the model
    often restates units or checks its work after it); without one, the last number of the whole answer."""
    boxed = last_boxed(text)
    if boxed is not None and last_number(boxed) is not None:
        return last_number(boxed)
    return last_number(text)


def normalize_math(answer: str) -> str:
    """Light LaTeX normalisation so that `\\dfrac{1}{2}`, `\\frac12 ` and `$\\frac{1}{2}$.` compare equal, and `\\$36`,
    `36\\%` or `5.4 \\text{ cents}` equal `36` / `5.4`; not a symbolic equivalence check. A list such as `3, 5, 7`
    stays a list (commas are read as thousands separators only in `1,000`-style numbers)."""
    answer = UNIT.sub(r"\1", answer.strip())
    answer = re.sub(r"\\(?:text|mbox|textbf)\{\s*([^}]*)\}", r"\1", answer)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", ""),
                     ("\\,", ""), ("\\;", ""), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("^\\circ", ""),
                     ("^{\\circ}", "")):
        answer = answer.replace(old, new)
    answer = re.sub(r"\s+", "", answer).rstrip(".")
    answer = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", answer)
    answer = re.sub(r"\\frac\{([^{}]+)\}(\d)", r"\\frac{\1}{\2}", answer)
    answer = re.sub(r"^\(([A-Ea-e])\)$", r"\1", answer)  # a multiple-choice letter, with or without parentheses
    number = last_number(answer) if SINGLE_NUMBER.fullmatch(answer) else None
    return number if number is not None else answer


def extract_boxed_answer(text: str) -> str | None:
    """MATH-500 / AIME: the last `\\boxed{}`, normalised."""
    boxed = last_boxed(text)
    return None if boxed is None else normalize_math(boxed)


def extract_auto_answer(text: str) -> str | None:
    """Prompt files with references but no known format: a boxed answer if any, else the last number."""
    boxed = extract_boxed_answer(text)
    return boxed if boxed is not None else last_number(text)


EXTRACTORS = {"number": extract_number_answer, "boxed": extract_boxed_answer, "auto": extract_auto_answer}
ANSWER_FORMATS = {"gsm8k": "number", "math500": "boxed", "aime25": "boxed"}


def answer_format(benchmark: str, has_references: bool) -> str | None:
    """Which extractor a set gets: known math sets by name, `auto` for any other set carrying references, none
    otherwise (open-ended chat answers have no final answer to extract)."""
    for prefix, kind in ANSWER_FORMATS.items():
        if benchmark.startswith(prefix):
            return kind
    return "auto" if has_references else None


def reference_answer(reference: str, kind: str) -> str | None:
    """A reference in the extractor's form: GSM8K-style `... #### 72` references keep what follows `####`; for
    boxed sets, a bare LaTeX answer (MATH-500's `\\frac{\\pi}{2}`) gets the normalisation a boxed model answer gets."""
    if "####" in reference:
        reference = reference.rsplit("####", 1)[1]
    if kind == "boxed" and last_boxed(reference) is None:
        return normalize_math(reference)
    extracted = EXTRACTORS[kind](reference)
    return extracted if extracted is not None else reference.strip()


# -- code ------------------------------------------------------------------------------------------------------


def extract_code(text: str) -> str:
    """The longest fenced code block (models often add a short usage example in a second block), else the text."""
    blocks = CODE_BLOCK.findall(text)
    return max(blocks, key=len) if blocks else text


def run_tests(completion: str, tests: list[str], entry_point: str | None = None, timeout: float = 10.0) -> bool:
    """Whether the completion's code passes its tests, run in a fresh Python subprocess with a timeout.

    This executes model-written code on this machine without a sandbox (only a separate process, an empty working
    folder and a time limit), which is why the harness runs it only behind an explicit `--execute-code`.
    """
    program = [extract_code(completion), *tests]
    if entry_point and any("def check(" in t for t in tests):
        program.append(f"check({entry_point})")
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "program.py")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write("\n\n".join(program) + "\n")
        try:
            result = subprocess.run([sys.executable, "-I", script], cwd=folder, capture_output=True,
                                    timeout=timeout, env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0
