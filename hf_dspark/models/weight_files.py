"""Safetensors only, inside the checkpoint folder: which weight files a `from_pretrained` will read, checked before
it reads any of them.

transformers picks a checkpoint's weights from `config.json`'s `transformers_weights`, else `model.safetensors`,
else the shards that `model.safetensors.index.json` names. With `use_safetensors=True` it still reads whatever the
index or `transformers_weights` names: a pickled `weights.bin` (through torch's unpickler), `../x.safetensors` or an
absolute path outside the folder. `checked_weight_files` resolves the same files the same way (through
transformers' own `cached_file`, so a Hub id is checked on the index its cache holds) and refuses anything but
`.safetensors` files inside the folder, each a regular file there once every symlink is resolved (`folder_files`:
a link out of the folder is never read). `check_floating_weights` (files) and `check_floating_tensors` (tensors
read) refuse integer tensors stored where the model has floating-point weights (loading would cast them silently).
`check_fits_before_building`, shared by every layout's reader, compares the stored shapes (`stored_tensor_headers`:
headers only) with the drafter a config describes, built on the meta device, before any real module exists."""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import DrafterLoadError, UserInputError
from .folder_files import checked_file

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
HUB_OPTIONS = ("cache_dir", "force_download", "proxies", "token", "local_files_only", "revision", "subfolder")
"""The `from_pretrained` keyword arguments that decide where a file is resolved (passed on to `cached_file`)."""

_RESAVE = "download the checkpoint again, or save it again with save_pretrained()"
_FIX = ("hf_dspark reads only .safetensors files inside the checkpoint folder (never a pickle, never a path outside "
        "it): re-save the checkpoint with save_pretrained() so that its safetensors shards are inside the folder")


def _variant(name: str, variant: str | None) -> str:
    """transformers' naming of a weights variant: model.safetensors -> model.fp16.safetensors."""
    if not variant:
        return name
    stem, _, suffix = name.partition(".")
    return f"{stem}.{variant}.{suffix}"


def _resolve(path, name: str, options: dict) -> str | None:
    """The local file transformers reads for `name` of `path` (a folder, or a Hub id through its cache), None
    when there is none: the same call and flags as transformers' own resolution, so both find the same file. A file
    found must be a regular file inside its folder (`checked_file`); so must a name a local folder holds that
    transformers would skip as missing (a pipe, a folder or a broken link in place of the weights)."""
    from transformers.utils.hub import cached_file

    found = cached_file(str(path), name, _raise_exceptions_for_gated_repo=False,
                        _raise_exceptions_for_missing_entries=False, **options)
    local = os.path.join(str(path), options.get("subfolder") or "", name)
    if found is None and os.path.isdir(str(path)) and os.path.lexists(local):
        found = local
    if found is not None:
        checked_file(found, Path(found).parents[len(PurePosixPath(name).parts) - 1])
    return found


def _inside(name, source: str, what: str, suffixes: tuple[str, ...] = (".safetensors",)) -> str:
    """`name` when it is a relative path inside the folder ending in one of `suffixes`, else a UserInputError
    naming `source` (the file and field that named it)."""
    if not isinstance(name, str) or not name.endswith(suffixes):
        problem = f"is not a {' or '.join(suffixes)} file"
    elif os.path.isabs(name) or PureWindowsPath(name).drive or PureWindowsPath(name).root:
        problem = "is an absolute path, outside the folder"
    elif ".." in PurePosixPath(name.replace("\\", "/")).parts:
        problem = "leads outside the folder"
    else:
        return name
    raise UserInputError(f"{source} names {name!r}, which {problem}: the {what}'s weights cannot be loaded. {_FIX}.")


def _index_shards(index_file: str, what: str) -> list[str]:
    """The shard names of a `model.safetensors.index.json`, each checked with `_inside`."""
    try:
        index = json.loads(Path(index_file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserInputError(f"{index_file} is not a valid JSON index ({error}). {_FIX}.") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserInputError(f"{index_file} has no weight_map naming the shards of each weight. {_FIX}.")
    names = []
    for weight, name in weight_map.items():
        names.append(_inside(name, f"{index_file} (weight_map[{weight!r}])", what))
    return sorted(set(names))


def indexed_weight_map(folder, what: str) -> dict[str, Path] | None:
    """{tensor name: shard file} from a local folder's `model.safetensors.index.json` (every shard name checked to be
    a `.safetensors` file inside the folder), None when the folder has no index: reading some tensors of a sharded
    checkpoint (a drafter module inside a target's) then opens only the shards that hold them."""
    index_file = Path(folder) / SAFE_INDEX_NAME
    if not os.path.lexists(index_file):
        return None
    checked_file(index_file, folder)
    _index_shards(str(index_file), what)  # the index is JSON with a weight_map, and every shard name is inside
    weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    return {weight: Path(folder) / name for weight, name in weight_map.items()}


def _explicit_weights(path, config, options: dict) -> tuple[str | None, str]:
    """config.json's `transformers_weights` (from the config object a caller passes, which transformers reads it
    from, else the saved file) and the config.json it came from."""
    config_file = _resolve(path, "config.json", options)
    source = config_file or f"the config of {str(path)!r}"
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return getattr(config, "transformers_weights", None), source
    if config_file is None:
        return None, source
    try:
        saved = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, source  # the loader reports a broken config.json itself
    return (saved.get("transformers_weights") if isinstance(saved, dict) else None), source


def checked_weight_files(path, what: str = "checkpoint", **options) -> list[str]:
    """The safetensors files `from_pretrained(path, use_safetensors=True, ...)` will read, resolved as transformers
    resolves them (a Hub id through its cache: call this with the same `options`), once checked to be `.safetensors`
    files inside the checkpoint folder; a UserInputError naming the index (or config.json), the entry and the fix
    otherwise, or naming the pickled weights a local folder holds instead of safetensors. An empty list when there
    are no weights at all (the loader then says so itself).

    Args:
        path: a local folder or a Hub id. A file is refused: transformers would read it as the weights.
        what: "drafter", "target", ...: named in the error.
        options: `from_pretrained`'s keyword arguments: `HUB_OPTIONS`, `variant`, and `config` (a config object,
            whose `transformers_weights` is read instead of the saved config.json); others are ignored.
    """
    config, variant = options.get("config"), options.get("variant")
    options = {key: value for key, value in options.items() if key in HUB_OPTIONS and value is not None}
    if os.path.isfile(os.path.join(options.get("subfolder") or "", str(path))):
        raise UserInputError(f"{path} is a file: pass the {what}'s folder (config.json and model.safetensors), whose "
                             "weights are safetensors files inside it.")
    explicit, source = _explicit_weights(path, config, options)
    if explicit is not None:
        _inside(explicit, f"{source} (transformers_weights)", what, (".safetensors", ".safetensors.index.json"))
    index_name = explicit if explicit and explicit.endswith(".index.json") else _variant(SAFE_INDEX_NAME, variant)
    if not (explicit or "").endswith(".index.json"):
        single = _resolve(path, explicit or _variant(SAFE_WEIGHTS_NAME, variant), options)
        if single is not None:
            return [single]
    index_file = _resolve(path, index_name, options)
    if index_file is None:
        _refuse_pickled_only(path, what, options.get("subfolder") or "")
        return []
    shards = [_resolve(path, name, options) for name in _index_shards(index_file, what)]
    return [shard for shard in shards if shard is not None]


def _refuse_pickled_only(path, what: str, subfolder: str) -> None:
    """A local folder whose only weights are pickled (what transformers would fall back to without
    use_safetensors=True) gets a clearer error than transformers' "do not set use_safetensors=True"."""
    folder = Path(str(path), subfolder)
    pickled = sorted(file.name for file in folder.glob("pytorch_model*.bin"))  # transformers' pickled weights
    if pickled:
        raise UserInputError(f"{folder} holds pickled weights ({', '.join(pickled[:3])}) and no model.safetensors: "
                             f"hf_dspark never unpickles a {what}'s weights. Re-save it with save_pretrained() "
                             "(safetensors, the default) and pass that folder.")


def check_floating_weights(files: list[str], model, what: str = "checkpoint") -> None:
    """Refuse tensors stored as integers (int8, ...) in `files` where `model` has floating-point weights: a
    quantised or mistyped checkpoint that loading would cast silently into wrong values. Only the headers are read."""
    from safetensors import safe_open

    expected = {name: tensor.is_floating_point() for name, tensor in model.state_dict().items()}
    wrong = []
    for file in files:
        with safe_open(file, framework="pt") as stored:
            for name in stored.keys():
                dtype = stored.get_slice(name).get_dtype()
                if expected.get(name) and not dtype.startswith(("F", "BF")):  # F16, F32, BF16, F8_E4M3, ...
                    wrong.append(f"{name} ({dtype}) in {file}")
    if wrong:
        raise integer_weights_error(wrong, what)


def check_floating_tensors(stored: dict, expected: dict, source, what: str = "checkpoint") -> None:
    """`check_floating_weights` for tensors already read (a converter's `{our name: tensor}` before
    `load_state_dict`, which would cast integers silently): `expected` is the model's state_dict."""
    wrong = [f"{name} ({tensor.dtype}) in {source}" for name, tensor in stored.items()
             if name in expected and expected[name].is_floating_point() and not tensor.is_floating_point()]
    if wrong:
        raise integer_weights_error(wrong, what)


def integer_weights_error(wrong: list[str], what: str) -> UserInputError:
    """The error for floating-point weights stored as integers; `wrong` describes each ("name (dtype) in file")."""
    return DrafterLoadError(
        f"the {what}'s checkpoint stores floating-point weights as integers: {'; '.join(wrong[:4])}"
        f"{' ...' if len(wrong) > 4 else ''}. Quantised drafter weights are not supported (loading would cast the "
        "integers silently into wrong values): save the drafter with float32, bfloat16 or float16 weights.")


def read_checkpoint_tensors(folder, what: str, fix: str) -> dict:
    """Every tensor of a checkpoint folder in another project's layout, from the `.safetensors` files
    transformers would read (`checked_weight_files`: inside the folder, never a pickle). `fix` says how to get a
    readable folder when there is none."""
    from safetensors.torch import load_file

    files = checked_weight_files(folder, what)
    if not files:
        raise DrafterLoadError(f"{folder} has no model.safetensors (nor a model.safetensors.index.json naming its "
                               f"shards); hf_dspark reads safetensors only: {fix}.")
    tensors = {}
    for file in files:
        with _unreadable_named(file, fix):
            tensors.update(load_file(file))
    return tensors


@contextmanager
def _unreadable_named(file, fix: str):
    """A safetensors file that cannot be read (truncated, corrupt: safetensors' own error names no file) becomes a
    `DrafterLoadError` naming `file` and `fix`."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        raise DrafterLoadError(f"{file} cannot be read as safetensors ({error}): the file is truncated or corrupt, "
                               f"e.g. by an interrupted download or copy; {fix.rstrip('.')}.") from None


def check_state_fits(expected: dict, state: dict, source, what: str, fix: str, stored_name=lambda name: name,
                     shapes_only: bool = False) -> None:
    """A converted checkpoint's tensors (`state`, our names) are exactly the model's (`expected`, its state_dict):
    the same names, shapes, and floating point where the model's are, else a `DrafterLoadError` naming them by the
    checkpoint's own names (`stored_name`) and `fix`. load_state_dict would cast integers silently. `shapes_only`:
    the shapes of the tensors both have only (transformers' own loading reports names, `check_floating_weights`
    dtypes)."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if not shapes_only and (missing or unexpected):
        raise DrafterLoadError(
            f"the weights of {source} do not fit the {what} its config.json describes: missing "
            f"{[stored_name(n) for n in missing[:8]]}, unexpected {[stored_name(n) for n in unexpected[:8]]}. {fix}")
    wrong = [f"{stored_name(name)} {tuple(state[name].shape)} stored, {tuple(tensor.shape)} for the config"
             for name, tensor in expected.items() if name in state and state[name].shape != tensor.shape]
    if wrong:
        raise DrafterLoadError(f"{source}'s config.json does not describe its weights, which have the wrong shape "
                               f"for it: {'; '.join(wrong[:4])}. {fix}")
    if not shapes_only:
        check_floating_tensors(state, expected, source, what)


_HEADER_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                  "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def stored_tensor_headers(files: list[str]) -> dict:
    """Every tensor of the safetensors `files` as an empty meta tensor of its stored shape and dtype, read from the
    files' headers: no tensor data is read and nothing is allocated (`check_fits_before_building` compares them)."""
    import torch
    from safetensors import safe_open

    headers = {}
    for file in files:
        with _unreadable_named(file, _RESAVE), safe_open(file, framework="pt") as stored:
            for name in stored.keys():
                part = stored.get_slice(name)
                kind = part.get_dtype()
                dtype = getattr(torch, _HEADER_DTYPES.get(kind, "float32" if kind.startswith("F") else "int64"))
                headers[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    return headers


_LAYER = re.compile(r"^layers\.(\d+)\.")


def check_fits_before_building(model_class, config, stored: dict, source, what: str, fix: str,
                               stored_name=lambda name: name, shapes_only: bool = False,
                               heads: dict | None = None) -> None:
    """Refuse a config whose drafter would not hold exactly the `stored` tensors (our names; real tensors or the
    `stored_tensor_headers` of the files) before any module is built, so that config.json sizes that its weights
    do not have (a vocab_size of 10**12 beside a 350 KB checkpoint) are one `DrafterLoadError`, never an allocation:
    the decoder layer count from the names alone (a huge one would make even an empty model slow to build), then
    every shape of the model built on the meta device (no memory), then the stored copies of the target's
    embedding and LM head (`heads`, (vocab_size or draft_vocab_size, hidden_size)). Arguments as `check_state_fits`.
    """
    import torch

    layers = {int(found.group(1)) for name in stored if (found := _LAYER.match(name))}
    if config.num_hidden_layers != len(layers):
        raise DrafterLoadError(f"{source}'s config.json has num_hidden_layers={config.num_hidden_layers}, but its "
                               f"weights hold {len(layers)} decoder layers (layers.<i>.*). {fix}")
    try:
        with torch.device("meta"):
            expected = model_class(config).state_dict()
    except RuntimeError as error:  # e.g. "Storage size calculation overflowed": sizes no tensor can have
        raise DrafterLoadError(f"{source}'s config.json describes tensors too large to exist ({error}). {fix}"
                               ) from None
    check_state_fits(expected, stored, source, what, fix, stored_name, shapes_only=shapes_only)
    for name, tensor in (heads or {}).items():
        rows = (config.vocab_size,) if name.startswith("embed") else (config.vocab_size, config.draft_vocab_size)
        if tensor.dim() != 2 or tensor.shape[0] not in rows or tensor.shape[1] != config.hidden_size:
            raise DrafterLoadError(
                f"{source}'s config.json does not describe its stored {name} {tuple(tensor.shape)}: the target's "
                f"embedding and LM head are (vocab_size={config.vocab_size}, hidden_size={config.hidden_size}) "
                f"(an LM head may hold the draft_vocab_size rows only). {fix}")
