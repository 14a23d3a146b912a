"""Repack the transformers wheel with only the model families the GPU check uses, so it fits the device call.

The device call carries the working tree and its carried paths in 64 MiB, and the tree alone (the shipped
drafters' weights) takes most of that, while the full transformers wheel is 13.5 MB. Its 550 model folders are 52 of
its 60 MB and are found by scanning the `models/` folder at import time (`define_import_structure`), so a copy
without the families nobody here loads imports and runs like the full one. This keeps every non-model module and
the families named on the command line plus whatever sibling model folders those import, writes a fresh RECORD,
and marks the file with the build tag `0trimmed` so that nobody mistakes it for the published wheel.

    python benchmarks/gpu/trim_wheel.py transformers-5.24.0-py3-none-any.whl --keep auto llama qwen3 gemma3 \
        --output .gpu-carry/wheels
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path, PurePosixPath

MODELS = "transformers/models/"
SIBLING_IMPORT = re.compile(r"^\s*from \.\.([a-z0-9_]+)(?:\.| import)", re.MULTILINE)


def model_folder(name: str) -> str | None:
    """The model family a wheel entry belongs to, or None for files outside `transformers/models/<family>/`."""
    if not name.startswith(MODELS):
        return None
    parts = name[len(MODELS):].split("/")
    return parts[0] if len(parts) > 1 else None


def families_to_keep(wheel: zipfile.ZipFile, requested: list[str]) -> set[str]:
    """The requested families plus every model folder their modules import (`from ..other import ...`), transitively.
    Modular sources (`modular_*.py`) are generated-from inputs that nothing imports at run time, so they are not
    followed."""
    present = {f for f in map(model_folder, wheel.namelist()) if f}
    missing = sorted(set(requested) - present)
    if missing:
        raise SystemExit(f"these model families are not in the wheel: {missing}; check the names against "
                         f"transformers/models/ (e.g. qwen3, llama, gemma3)")
    keep, todo = set(requested), list(requested)
    while todo:
        family = todo.pop()
        for name in wheel.namelist():
            path = PurePosixPath(name)
            if model_folder(name) != family or path.suffix != ".py" or path.name.startswith("modular_"):
                continue
            for imported in SIBLING_IMPORT.findall(wheel.read(name).decode("utf-8")):
                if imported in present and imported not in keep:
                    keep.add(imported)
                    todo.append(imported)
    return keep


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(source: str, keep_requested: list[str], output_dir: str) -> str:
    """Write the trimmed wheel into `output_dir`; returns its path."""
    match = re.match(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-(?:\d[^-]*-)?(?P<tags>py3-none-any)\.whl$",
                     PurePosixPath(source).name)
    if not match:
        raise SystemExit(f"{source} is not a pure-Python wheel file name (NAME-VERSION-py3-none-any.whl)")
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    target = f"{output_dir}/{match['name']}-{match['version']}-0trimmed-{match['tags']}.whl"
    with zipfile.ZipFile(source) as wheel:
        keep = families_to_keep(wheel, keep_requested)
        records, kept_bytes = [], 0
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            record_name = None
            for info in wheel.infolist():
                family = model_folder(info.filename)
                if family is not None and family not in keep:
                    continue
                if info.filename.endswith(".dist-info/RECORD"):
                    record_name = info.filename
                    continue
                data = wheel.read(info.filename)
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                records.append(record_line(info.filename, data))
                kept_bytes += len(data)
            if record_name is None:
                raise SystemExit(f"{source} has no .dist-info/RECORD; is it a wheel?")
            out.writestr(record_name, "\n".join(records + [f"{record_name},,"]) + "\n")
    print(f"kept model families: {' '.join(sorted(keep))}; {kept_bytes / 2**20:.1f} MiB unpacked -> {target}")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="the published transformers wheel (pip download transformers==VERSION)")
    parser.add_argument("--keep", nargs="+", required=True, help="model families (folders of transformers/models/)")
    parser.add_argument("--output", required=True, help="folder for the trimmed wheel")
    args = parser.parse_args(argv)
    trim(args.wheel, args.keep, args.output)


if __name__ == "__main__":
    sys.exit(main())
