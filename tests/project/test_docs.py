"""The documents claim only what runs: every code block in the README, CONTRIBUTING.md and docs/ that says it runs
does, every command line in them names what exists, every path and link they cite is there, and benchmarks/ keeps
one folder per benchmark (benchmarks/README.md).

* A ```python block runs here, in a fresh interpreter; or a `<!-- run by tests/X.py -->` comment right before it
  names the test that runs it (the first python block of its section, which that test reads); or a
  `<!-- not run: reason -->` comment says why not (the block still compiles).
* Each line of a ```bash block is checked, unless the block is marked not run: `hf-dspark` / `python -m hf_dspark`
  lines are parsed by the real command line (subcommand and options); `python path.py` and `bash path.sh` name a
  file of the repository and only options it defines; `python -m pytest` names declared markers, options
  `tests/conftest.py` defines and paths that exist; `pip install` names extras `pyproject.toml` declares.
"""

import contextlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS = ROOT / "benchmarks"
PATH_DOCS = [*DOCS, BENCHMARKS / "README.md"]  # documents whose cited paths and links must exist
MARKER = re.compile(r"<!--\s*(run by|not run:)\s*(.*?)\s*-->")


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    section: str  # the heading line above it, e.g. "## Python API"
    marker: tuple[str, str] | None  # ("run by", "tests/x.py") or ("not run:", reason)

    def __str__(self):
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    found, section, lines = [], "", doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```") and len(line) > 3:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.fullmatch(before.strip())
            found.append(Block(doc, i + 1, line[3:].strip(), "\n".join(lines[i + 1:end]) + "\n", section,
                               marker.groups() if marker else None))
            i = end + 1
            continue
        if line.startswith("#"):
            section = line.strip()
        i += 1
    return found


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]
BASH_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "bash"]


def prose(doc: Path) -> str:
    """The document without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)


# -- the documents ------------------------------------------------------------------------------------------------


def test_the_readme_is_for_users_and_links_the_contributor_documents():
    text = README.read_text()
    assert len(text.splitlines()) < 250, "the README is for users: the details go to docs/, the history to RESULTS.md"
    first = ALL_BLOCKS[0]
    assert first.doc == README and first.lang == "bash", "the README opens with its two commands"
    assert first.code.startswith("bash scripts/setup.sh && python -m hf_dspark generate ")
    assert first.code.splitlines()[1] == "python -m pytest -q tests"
    for linked in ("docs/ARCHITECTURE.md", "CONTRIBUTING.md", "benchmarks/policy-regimes/"):
        assert f"]({linked}" in text, f"the README links {linked}"
    commit_ids = [t for t in re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/.-])", prose(README))
                  if re.search(r"\d", t) and re.search(r"[a-f]", t)]
    assert commit_ids == [], f"no commit ids (run-by-run history) in the README: {commit_ids}"


def test_every_python_block_is_run_somewhere_or_says_why_not():
    for block in PYTHON_BLOCKS:
        compile(block.code, str(block), "exec")  # even a block that is not run is Python
        if block.marker is None:
            continue  # run below
        kind, detail = block.marker
        if kind == "not run:":
            assert len(detail.split()) >= 3, f"{block}: say why the block is not run"
            continue
        test = ROOT / detail
        assert test.is_file() and test.relative_to(ROOT).parts[0] == "tests", f"{block}: {detail} is not a test file"
        source = test.read_text()
        assert block.doc.name in source and block.section in source, \
            f"{block}: {detail} does not read {block.doc.name}'s section {block.section!r}"
        first = next(b for b in PYTHON_BLOCKS if b.doc == block.doc and b.section == block.section)
        assert first is block, f"{block}: {detail} reads the first python block of {block.section!r}, not this one"


def test_unmarked_python_blocks_run_as_written(tmp_path):
    for block in [b for b in PYTHON_BLOCKS if b.marker is None]:
        done = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, f"{block}: {done.stderr[-2000:]}"


# -- command lines ------------------------------------------------------------------------------------------------


def command_lines(code: str) -> list[str]:
    """The block's lines, continuations joined."""
    return [line for line in code.replace("\\\n", " ").splitlines() if line.strip()]


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, without comments, redirections and leading variable assignments."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found, current, tokens = [], [], list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("&&", "||", ";", "|", "&"):
            found.append(current)
            current = []
        elif token in (">", ">>", "<", "2>", ">&"):
            i += 1  # the redirection's target
        elif not current and re.fullmatch(r"[A-Za-z_]\w*=.*", token):
            pass  # FULL=1, OMP_NUM_THREADS=1, busy=$!
        else:
            current.append(token)
        i += 1
    return [c for c in found + [current] if c]


def options(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


@pytest.fixture(scope="module")
def cli():
    from hf_dspark.cli.main import build_parser

    return build_parser()


def check_cli(parser, args: list[str]) -> str | None:
    """None if `hf-dspark ARGS` parses (subcommand, options, their values), else argparse's complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exit_:
        if exit_.code != 0:
            return err.getvalue().strip().splitlines()[-1]
    return None


def declared(path: Path, flags: list[str]) -> list[str]:
    text = path.read_text()
    return [f for f in flags if f'"{f}"' not in text and f"'{f}'" not in text]


def check_command(parser, words: list[str]) -> str | None:
    """None if the simple command names what exists, else what does not."""
    head, args = words[0], words[1:]
    if head == "hf-dspark":
        return check_cli(parser, args)
    if head in ("python", "python3"):
        if args[:2] == ["-m", "hf_dspark"]:
            return check_cli(parser, args[2:])
        if args[:2] == ["-m", "pytest"]:
            return check_pytest(args[2:])
        if args[:1] == ["-c"]:
            return None
        if args[:1] == ["-m"]:
            return f"python -m {args[1]} is not a module of this repository"
        script = ROOT / args[0]
        if not script.is_file():
            return f"{args[0]} does not exist"
        missing = declared(script, options(args[1:]))
        return f"{args[0]} defines no {missing}" if missing else None
    if head in ("bash", "sh"):
        script = ROOT / args[0]
        if not script.is_file():
            return f"{args[0]} does not exist"
        missing = declared(script, options(args[1:]))
        return f"{args[0]} takes no {missing}" if missing else None
    if head == "pip" and args[:1] == ["install"]:
        return check_extras(args[1:])
    if head in ("kill", "cd", "git"):
        return None
    return f"{head}: not a command of this repository (mark the block <!-- not run: reason -->)"


def check_pytest(args: list[str]) -> str | None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    conftest = ROOT / "tests" / "conftest.py"
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            i += 1
            for word in re.findall(r"\w+", args[i]):
                if word not in ("not", "and", "or") and f'"{word}:' not in pyproject:
                    return f"pytest marker {word} is not declared in pyproject.toml"
        elif arg.split("=", 1)[0] in ("--ignore", "--deselect"):  # pytest's own: a path that must exist
            path = arg.split("=", 1)[1] if "=" in arg else args[(i := i + 1)]
            if not (ROOT / path.split("::")[0]).exists():
                return f"{path} does not exist"
        elif arg.startswith("--"):
            if declared(conftest, [arg.split("=", 1)[0]]):
                return f"tests/conftest.py defines no {arg}"
            if "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1  # its value
        elif not arg.startswith("-") and not (ROOT / arg.split("::")[0]).exists():
            return f"{arg} does not exist"
        i += 1
    return None


def check_extras(args: list[str]) -> str | None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    for arg in args:
        for extra in re.findall(r"\[([\w,-]+)\]", arg):
            for name in extra.split(","):
                if not re.search(rf"^{re.escape(name)} = ", section, re.M):
                    return f"pyproject.toml declares no extra {name!r}"
    return None


def test_every_command_line_names_what_exists(cli):
    checked, wrong = 0, []
    for block in BASH_BLOCKS:
        if block.marker and block.marker[0] == "not run:":
            assert len(block.marker[1].split()) >= 3, f"{block}: say why the block is not run"
            continue
        for line in command_lines(block.code):
            for words in commands(line):
                checked += 1
                if (problem := check_command(cli, words)) is not None:
                    wrong.append(f"{block}: {' '.join(words)[:80]}: {problem}")
    assert checked >= 10 and wrong == [], "\n".join(wrong)


def benchmark_rows() -> list[list[str]]:
    rows = []
    for line in (BENCHMARKS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| `") and len(cells) == 4:
            rows.append(cells)
    return rows


def test_the_benchmark_commands_name_what_exists(cli):
    wrong = []
    for benchmark, _, _, command in benchmark_rows():
        for span in re.findall(r"`([^`]+)`", command):
            if re.match(r"(python|hf-dspark|bash|OMP_NUM_THREADS=)", span):
                for words in commands(span):
                    if (problem := check_command(cli, words)) is not None:
                        wrong.append(f"{benchmark}: {span[:80]}: {problem}")
    assert wrong == [], "\n".join(wrong)


# -- paths and links ----------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.lstrip("#").strip().lower()))


@pytest.mark.parametrize("doc", PATH_DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_cited_path_and_link_exists(doc):
    text, wrong = prose(doc), []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            wrong.append(f"link {target}")
        elif anchor and linked.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ .*$", prose(linked), re.M)}
            if anchor not in headings:
                wrong.append(f"link {target}: no such heading")
    bases = [doc.parent, ROOT, ROOT / "hf_dspark", ROOT / "hf_dspark" / "generation"]
    for span in re.findall(r"`([^`\n]+)`", text):
        if "/" not in span or not re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", span):
            continue  # not a path: a command, a Hub id with a placeholder, a glob
        rooted = [base for base in bases if (base / span.split("/")[0]).exists()]
        if rooted and not any((base / span).exists() for base in rooted):
            wrong.append(f"path {span}")
    assert wrong == [], f"{doc.relative_to(ROOT)} cites what is not there: {wrong}"


# -- benchmarks/: one folder per benchmark ------------------------------------------------------------------------

HELPERS = {"serving_common.py", "oracle.py"}  # imported by the benchmarks, not benchmarks themselves


def test_benchmarks_keep_one_folder_per_benchmark_and_no_loose_results():
    entries = [p for p in BENCHMARKS.iterdir() if not p.name.startswith((".", "__pycache__"))]
    loose = [p.name for p in entries if p.is_file() and p.suffix != ".py" and p.name not in ("README.md", "RESULTS.md")]
    assert loose == [], f"results belong in their benchmark's folder (benchmarks/README.md): {loose}"
    rows = benchmark_rows()
    listed_scripts = {re.findall(r"`([^`]+)`", r[0])[0] for r in rows}
    listed_folders = set()
    for benchmark, folder, _, _ in rows:
        spans = re.findall(r"`([^`]+)`", folder)
        if folder.startswith("none"):  # a benchmark whose first results are not committed yet: the folder it writes
            listed_folders.update(s.split("/")[0] for s in spans)
            continue
        assert spans and (BENCHMARKS / spans[0]).is_dir(), f"{benchmark}: {folder} is not a folder"
        listed_folders.add(spans[0].split("/")[0])
    scripts = {p.name for p in entries if p.suffix == ".py"} - HELPERS
    assert scripts <= listed_scripts, f"benchmarks/README.md lists no row for {sorted(scripts - listed_scripts)}"
    folders = {p.name for p in entries if p.is_dir()}
    assert folders <= listed_folders, f"benchmarks/README.md lists no row for {sorted(folders - listed_folders)}"
