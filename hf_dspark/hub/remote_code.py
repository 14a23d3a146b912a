"""Make a saved drafter folder usable by stock `transformers`, without hf_dspark installed.

`save_pretrained` of our drafters already copies their modeling code and writes `auto_map` (the classes are
registered for the Auto classes), so `AutoModel.from_pretrained(folder, trust_remote_code=True)` loads them.
This module adds the other half, a `custom_generate/` folder: then
`target.generate(ids, assistant_model=drafter, custom_generate=folder, trust_remote_code=True)` runs hf_dspark's
own verification loop.

The folder holds verbatim copies of the hf_dspark modules that the decoding loop imports, with package-relative
imports (`from ..models.errors import X`) flattened to sibling imports (`from .errors import X`), because
`transformers` loads remote code as one flat folder. Copying instead of rewriting by hand keeps a single source
for the lossless rule (`generation/round/verification.py`); a test runs the folder in a process where hf_dspark cannot
be imported. A copied drafter class saves and pushes through hf_dspark's hooks when hf_dspark is loaded beside it:
its copy of `models/hub_hooks.py` looks up `hf_dspark.models.hub_hooks` in `sys.modules`.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
ENTRY_MODULE = PACKAGE_ROOT / "generation" / "routing" / "dispatch.py"
_RELATIVE_IMPORT = re.compile(r"^(\s*from\s+)(\.+)([\w.]*)(\s+import\b)", flags=re.MULTILINE)

GENERATE_PY = '''"""DSpark / DFlash / Eagle3 speculative decoding for stock `transformers` (no hf_dspark install needed).

    target.generate(input_ids, assistant_model=drafter, custom_generate=<this repo>, trust_remote_code=True)

`drafter` is the drafter of this repository, loaded with `AutoModel.from_pretrained(repo, trust_remote_code=True)`.
The files beside this one are copies of hf_dspark {version}'s decoding loop; the lossless verification rule is in
`verification.py`.
"""

import functools

from .dispatch import speculative_decoding
from .settings import SETTING_NAMES, call_settings


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
            streamer=None, drafter=None, passed_settings=None, **model_kwargs):
    return speculative_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                drafter=drafter, streamer=streamer,
                                drafting_settings=call_settings(generation_config, passed_settings),
                                **model_kwargs)


def generate(model, *args, assistant_model=None, **kwargs):
    if assistant_model is None:
        raise ValueError(
            "This custom_generate runs speculative decoding: pass the drafter as assistant_model=, loaded with "
            "AutoModel.from_pretrained(<repo>, trust_remote_code=True)."
        )
    if getattr(getattr(assistant_model, "config", None), "model_type", None) not in {model_types}:
        raise ValueError(
            f"assistant_model is a {{type(assistant_model).__name__}}, not an hf_dspark drafter "
            "(config.model_type must be one of {model_types})."
        )
    # generate() hands a callable custom_generate everything it prepared (processors, stopping criteria, cache);
    # the drafter, the streamer and the drafting settings (num_assistant_tokens, dspark_*) travel bound to it
    # because generate() drops the first two for callables and would refuse the others as model inputs.
    passed = {{name: kwargs.pop(name) for name in SETTING_NAMES if name in kwargs}}
    decode = functools.partial(_decode, drafter=assistant_model, streamer=kwargs.get("streamer"),
                               passed_settings=passed)
    return model.generate(*args, assistant_model=assistant_model, custom_generate=decode, **kwargs)
'''


def module_closure(entry: Path = ENTRY_MODULE) -> list[Path]:
    """`entry` and every hf_dspark module it imports relatively, transitively."""
    seen: list[Path] = []
    pending = [entry]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.append(path)
        for _, dots, dotted, _ in _RELATIVE_IMPORT.findall(path.read_text()):
            base = path.parent
            for _ in range(len(dots) - 1):
                base = base.parent
            target = base.joinpath(*dotted.split(".")) if dotted else base
            module = target.with_suffix(".py") if target.with_suffix(".py").exists() else target / "__init__.py"
            if not module.exists():
                raise FileNotFoundError(f"{path} imports {dots}{dotted}, which is not a module of hf_dspark")
            pending.append(module)
    return sorted(seen)


def flatten_imports(source: str) -> str:
    """`from ..models.errors import X` -> `from .errors import X` (every copied module sits in one folder)."""

    def flat(match: re.Match) -> str:
        head, dots, dotted, tail = match.groups()
        return f"{head}.{dotted.split('.')[-1]}{tail}"

    return _RELATIVE_IMPORT.sub(flat, source)


def write_custom_generate(folder: str | Path) -> Path:
    """Write `folder/custom_generate/` (generate.py, the copied modules, requirements.txt) and return its path."""
    from .._version import __version__
    from ..models.identity import OWN_DRAFTER_TYPES

    modules = module_closure()
    names = [m.name for m in modules]
    if "__init__.py" in names or len(set(names)) != len(names):
        raise RuntimeError(f"the decoding loop's modules cannot be flattened into one folder: {names}")
    out = Path(folder) / "custom_generate"
    out.mkdir(parents=True, exist_ok=True)
    for module in modules:
        (out / module.name).write_text(flatten_imports(module.read_text()))
    model_types = repr(sorted(OWN_DRAFTER_TYPES))
    (out / "generate.py").write_text(GENERATE_PY.format(version=__version__, model_types=model_types))
    import transformers

    (out / "requirements.txt").write_text(f"torch>=2.5\ntransformers>={transformers.__version__.split('+')[0]}\n")
    return out
