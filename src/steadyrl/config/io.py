"""Configuration files and ``key=value`` overrides for a pydantic model, with errors that name the key.

The scheme (used by ``steadyrl train``):

1. Start from the model's defaults, or from a YAML file (``yaml.safe_load``; its top level must be a mapping).
2. Apply command-line overrides in order. ``a.b.c=value`` sets a nested key; ``value`` is parsed as YAML, safely
   (``runtime.lag.k=32`` is an int, ``lr=3e-4`` a float, ``optim.betas=[0.9,0.99]`` a list, ``out_dir=runs/x`` a
   string). Files and values use ``yaml.SafeLoader`` with one addition: ``3e-4`` (no dot) is a float, as in YAML 1.2.
3. A section that has a ``name`` field (``task``, ``model``, ``method``, ``proximal``) accepts a bare value as its
   name: ``task: chain_sum`` in YAML and ``task=chain_sum`` on the command line set ``task.name`` and keep the
   section's other keys. A section with an ``enabled`` switch (``tools``, ``log.wandb``, ...) accepts a bare true or
   false as it: ``log.wandb=true`` sets ``log.wandb.enabled``.
4. Validate once. Every error names the dotted key; an unknown key lists the valid keys at its level and suggests
   the closest one (also a same-named key at another level, e.g. ``optim.lr`` → ``lr``).

:func:`format_help` renders every key of the model (type, bounds, default, description) for ``--help``.
"""

from __future__ import annotations

import difflib
import json
import re
import textwrap
import types
import typing
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from steadyrl.config.renamed import RenamedKeyWarning, move_renamed, renamed_message

#: The field that a bare value of a section stands for (``task=chain_sum`` means ``task.name=chain_sum``).
NAME_FIELD = "name"
#: The field a bare true/false of a section without a name stands for (``log.wandb=true``).
SWITCH_FIELD = "enabled"

#: Width of the key column, and of the whole text, in ``--help``.
HELP_KEY_WIDTH = 34
HELP_WIDTH = 118


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads exponent floats without a dot (``3e-4``) as numbers, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` semantics (no object construction), with ``3e-4`` read as a float."""
    return yaml.load(text, Loader=_Loader)


class ConfigError(ValueError):
    """A configuration file, override or value is wrong; the message names the file, key or value."""


# --------------------------------------------------------------------------------------------- model walking
def _variants(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation admits (one for a section, several for a discriminated union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        return [cls for arg in get_args(annotation) for cls in _variants(arg)]
    return []


def _tag(cls: type[BaseModel], field: str) -> str | None:
    """The literal value of ``cls``'s discriminator ``field`` (None when it is not a single literal)."""
    info = cls.model_fields.get(field)
    if info is None:
        return None
    args = get_args(info.annotation)
    return str(args[0]) if len(args) == 1 else None


def _discriminator(info: FieldInfo) -> str | None:
    disc = info.discriminator
    if isinstance(disc, str):
        return disc
    for meta in info.metadata:
        if isinstance(getattr(meta, "discriminator", None), str):
            return meta.discriminator
    return None


def _has_name(info: FieldInfo) -> bool:
    variants = _variants(info.annotation)
    return bool(variants) and all(NAME_FIELD in cls.model_fields for cls in variants)


def _has_switch(info: FieldInfo | None) -> bool:
    variants = _variants(info.annotation) if info is not None else []
    return bool(variants) and not _has_name(info) and all(SWITCH_FIELD in cls.model_fields for cls in variants)


def _resolve_loc(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """Map a pydantic error location to the dotted key the user wrote and the model class holding its last part.

    Discriminated unions put the tag into the location (``('task', 'chain_sum', 'x')``): it is dropped.
    """
    path: list[str] = []
    cls: type[BaseModel] | None = model
    i = 0
    while i < len(loc):
        part = str(loc[i])
        path.append(part)
        i += 1
        if cls is None or part not in cls.model_fields:
            cls = None
            continue
        info = cls.model_fields[part]
        variants = _variants(info.annotation)
        disc = _discriminator(info)
        if len(variants) > 1 and disc is not None and i < len(loc):
            tags = {_tag(v, disc): v for v in variants}
            cls = tags.get(str(loc[i]))
            i += 1  # the tag is pydantic's, not a key the user wrote
        elif len(variants) == 1:
            cls = variants[0]
        else:
            cls = None
    return path, cls


def _all_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        yield key
        for cls in _variants(info.annotation):
            yield from _all_keys(cls, prefix=f"{key}.")


# ---------------------------------------------------------------------------------------------------- errors
def _describe(model: type[BaseModel], err: Mapping[str, Any]) -> str:
    path, _ = _resolve_loc(model, tuple(err["loc"]))
    key = ".".join(path) or "<top level>"
    kind = err["type"]
    if kind == "extra_forbidden":
        parent_path, parent = _resolve_loc(model, tuple(err["loc"])[:-1])
        leaf = path[-1]
        valid = sorted(parent.model_fields) if parent is not None else []
        close = difflib.get_close_matches(leaf, valid, n=1)
        elsewhere = sorted(k for k in _all_keys(model) if k.split(".")[-1] == leaf)
        former = getattr(model, "former_keys", {})  # a misspelt former name: suggest its current key
        moved = difflib.get_close_matches(key, list(former), n=1, cutoff=0.75)
        hint = ""
        if close:
            hint = f"; did you mean {'.'.join([*parent_path, close[0]])!r}?"
        elif elsewhere:
            hint = f"; did you mean {' or '.join(repr(k) for k in elsewhere)}?"
        elif moved:
            hint = f"; did you mean {former[moved[0]]!r}?"
        where = f"under {'.'.join(parent_path)!r}" if parent_path else "at the top level"
        return f"unknown key {key!r}{hint}\n    valid keys {where}: {', '.join(valid)}"
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "missing":
        return f"{key}: a value is required"
    value = err.get("input")
    shown = "" if isinstance(value, (dict, BaseModel)) else f" (got {value!r})"
    return f"invalid value for {key!r}: {msg}{shown}"


def validation_message(model: type[BaseModel], err: ValidationError, *, source: str) -> str:
    """A readable multi-line message for ``err``: one line per error, each naming its dotted key."""
    lines = [f"invalid configuration ({source}):"]
    lines += [f"  - {_describe(model, e)}" for e in err.errors()]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ loading, overrides
def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file, a syntax error or a non-mapping raises :class:`ConfigError`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = parse_yaml(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"config file {str(p)!r}{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """``'optim.lr=3e-4'`` → ``(['optim', 'lr'], 0.0003)``; the value is parsed with ``yaml.safe_load``."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"override {item!r} is not of the form key=value (e.g. runtime.lag.k=32, optim.weight_decay=0.1)"
        )
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {item!r}: empty part in the key {key!r}")
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"override {item!r}: the value {raw!r} is not valid YAML") from None
    return parts, value


def _is_mapping(annotation: Any) -> bool:
    return annotation is dict or get_origin(annotation) is dict


def _default_name(info: FieldInfo) -> Any:
    default = info.get_default(call_default_factory=True)
    return getattr(default, NAME_FIELD, None)


def _normalize_names(model: type[BaseModel], data: dict[str, Any]) -> None:
    """For sections with a ``name`` field: ``section: value`` → ``{name: value}``, and a section given without a
    name keeps the default's name (``task.max_terms=4`` edits the default task). In place."""
    for key, info in model.model_fields.items():
        value = data.get(key)
        if value is None:
            continue
        if _has_name(info):
            if not isinstance(value, dict):
                data[key] = {NAME_FIELD: value}
            elif NAME_FIELD not in value and _default_name(info) is not None:
                value[NAME_FIELD] = _default_name(info)
        elif isinstance(value, bool) and _has_switch(info):
            data[key] = {SWITCH_FIELD: value}
        elif isinstance(value, dict):
            variants = _variants(info.annotation)
            if len(variants) == 1:
                _normalize_names(variants[0], value)


def _set_name(section: Any, info: FieldInfo, name: Any) -> dict[str, Any]:
    """The section with ``name`` set: its other keys are kept if the name stays, dropped if it changes (unless the
    section's class sets ``keeps_keys_on_rename``: its other keys hold for every name, as ``optim``'s do)."""
    keys = section if isinstance(section, dict) else {}
    if all(getattr(cls, "keeps_keys_on_rename", False) for cls in _variants(info.annotation)):
        return {**keys, NAME_FIELD: name}
    current = keys.get(NAME_FIELD, _default_name(info))
    return {**keys, NAME_FIELD: name} if current == name else {NAME_FIELD: name}


def apply_override(model: type[BaseModel], data: dict[str, Any], parts: list[str], value: Any) -> None:
    """Set ``data[parts[0]][parts[1]]... = value`` (in place).

    On a named section (``task``, ``model``, ``method``), a bare value sets its name, and so does ``<section>.name``;
    changing the name starts the section afresh (its other keys belonged to the previous choice).
    """
    node = data
    cls: type[BaseModel] | None = model
    parent_info: FieldInfo | None = None
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        info = cls.model_fields.get(part) if cls is not None else None
        if last:
            if info is not None and _has_name(info) and not isinstance(value, dict):
                node[part] = _set_name(node.get(part), info, value)
            elif _has_switch(info) and isinstance(value, bool):
                keys = node.get(part)
                node[part] = {**(keys if isinstance(keys, dict) else {}), SWITCH_FIELD: value}
            elif part == NAME_FIELD and parent_info is not None and _has_name(parent_info) and i > 0:
                fresh = _set_name(node, parent_info, value)
                node.clear()
                node.update(fresh)
            else:
                node[part] = value
            return
        child = node.get(part)
        is_section = info is None or bool(_variants(info.annotation)) or _is_mapping(info.annotation)
        bare = NAME_FIELD if info is not None and _has_name(info) else SWITCH_FIELD if _has_switch(info) else None
        if not is_section or (child is not None and not isinstance(child, dict) and bare is None):
            raise ConfigError(f"override {'.'.join(parts)!r}: {'.'.join(parts[: i + 1])!r} is a value, not a section")
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            child = {bare: child}
        node[part] = child
        node = child
        parent_info = info
        variants = _variants(info.annotation) if info is not None else []
        cls = variants[0] if len(variants) == 1 else None


def load_config(
    model: type[BaseModel], *, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Any:
    """Build a validated ``model`` from an optional YAML file plus ``key=value`` overrides (see the module doc)."""
    former: Mapping[str, str] = getattr(model, "former_keys", {})
    data: dict[str, Any] = read_yaml(path) if path is not None else {}
    if former:  # a file written with moved keys' former names: moved (one notice each)
        try:
            data = move_renamed(data, renamed=former)
        except ValueError as err:
            raise ConfigError(f"config file {str(path)!r}: {err}") from None
    _normalize_names(model, data)
    for item in overrides:
        parts, value = parse_override(item)
        dotted = ".".join(parts)
        if dotted in former:
            warnings.warn(renamed_message(dotted, former[dotted]), RenamedKeyWarning, stacklevel=2)
            parts = former[dotted].split(".")
        apply_override(model, data, parts, value)
    _normalize_names(model, data)
    source = f"file {str(path)!r}" if path is not None else "defaults"
    if overrides:
        source += " + overrides " + " ".join(overrides)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(validation_message(model, err, source=source)) from None


# ------------------------------------------------------------------------------------------------------ help
def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def _bounds(info: FieldInfo) -> str:
    out = []
    for meta in info.metadata:
        for kind, attr, sym in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"{sym} {getattr(meta, attr)}")
    return f" ({', '.join(out)})" if out else ""


_NO_DEFAULT = object()


def _default_value(info: FieldInfo) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return _NO_DEFAULT


def _default(info: FieldInfo, value: Any = _NO_DEFAULT) -> str:
    """The default shown in ``--help``: ``value`` (from an enclosing section's default) or the field's own."""
    if value is _NO_DEFAULT:
        value = _default_value(info)
    if value is _NO_DEFAULT:
        return "required"
    if isinstance(value, BaseModel):
        return f"{NAME_FIELD}={getattr(value, NAME_FIELD)}" if hasattr(value, NAME_FIELD) else "(section)"
    plain = to_jsonable_python(value)
    return plain if isinstance(plain, str) else json.dumps(plain)


def _help_lines(model: type[BaseModel], prefix: str, indent: str, defaults: BaseModel | None = None) -> Iterator[str]:
    """Help lines of ``model``'s fields; ``defaults`` is the enclosing default instance (its values are shown)."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        variants = _variants(info.annotation)
        desc = info.description or ""
        value = getattr(defaults, name, _NO_DEFAULT) if isinstance(defaults, model) else _default_value(info)
        if variants:
            disc = _discriminator(info)
            if len(variants) > 1 and disc is not None:
                tags = [_tag(v, disc) for v in variants]
                yield (
                    f"{indent}{key}  [section; {key}.{disc} = {'|'.join(str(t) for t in tags)}; default "
                    f"{_default(info, value)}]  {desc}".rstrip()
                )
                for v in variants:
                    yield f"{indent}  when {key}.{disc}={_tag(v, disc)}:"
                    yield from _help_lines(v, f"{key}.", indent + "    ", value if isinstance(value, v) else None)
            else:
                yield f"{indent}{key}  [section]  {desc}".rstrip()
                yield from _help_lines(variants[0], f"{key}.", indent + "  ", value)
            continue
        head = f"{indent}{key}"
        spec = f"{_type_name(info.annotation)}{_bounds(info)} = {_default(info, value)}"
        pad = max(1, HELP_KEY_WIDTH - len(head))
        yield f"{head}{' ' * pad}{spec}"
        if desc:
            yield from textwrap.wrap(
                desc, width=HELP_WIDTH, initial_indent=indent + " " * 4, subsequent_indent=indent + " " * 4
            )


def format_help(model: type[BaseModel]) -> str:
    """Every key of ``model``: dotted name, type, bounds, default and description (generated from the model)."""
    return "\n".join(_help_lines(model, "", "  "))


# ------------------------------------------------------------------------------------- command lines of YAML commands
def shipped_yaml(root: Any) -> dict[str, Path]:
    """The ``*.yaml`` files in a package resource directory ``root``, by name (file name without ``.yaml``)."""
    if not root.is_dir():
        return {}
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_named_file(arg: str, shipped: Mapping[str, Path], *, kind: str) -> Path:
    """``arg`` as a file if it exists, else the shipped ``kind`` of that name; otherwise a ``ConfigError``."""
    path = Path(arg)
    if path.is_file():
        return path
    if arg in shipped:
        return shipped[arg]
    names = ", ".join(sorted(shipped)) or "none"
    if path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        raise ConfigError(f"{kind} file {arg!r} does not exist (shipped {kind}s, usable by name: {names})")
    raise ConfigError(f"{kind} {arg!r} is neither a file nor a shipped {kind} ({names})")


def parse_command_line(
    argv: list[str], *, flag: str, command: str, kind: str, resolve: Any
) -> tuple[Path | None, list[str], bool]:
    """``[FILE_OR_NAME] [key=value ...] [flag]`` → (path or None, overrides, whether ``flag`` was given).

    ``resolve`` turns the one positional argument into a path (:func:`resolve_named_file`); errors name the option.
    """
    path, overrides, flagged = None, [], False
    for arg in argv:
        if arg == flag:
            flagged = True
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r} (see {command} --help)")
        elif "=" in arg:
            overrides.append(arg)
        elif path is None:
            path = resolve(arg)
        else:
            raise ConfigError(f"more than one {kind} file: {str(path)!r} and {arg!r}; other settings are key=value")
    return path, overrides, flagged


def flatten(config: Mapping[str, Any], prefix: str = "", *, opaque: tuple[str, ...] = ()) -> dict[str, Any]:
    """A nested config as ``{"a.b.c": value}``; mappings under a key in ``opaque``, and empty mappings, stay values.

    One flattening for comparing configs (a resume's changed keys) and for trackers' flat parameters."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and key not in opaque:
            out |= flatten(value, f"{name}.", opaque=opaque)
        else:
            out[name] = value
    return out
