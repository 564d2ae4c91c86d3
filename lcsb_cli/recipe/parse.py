"""YAML -> dataclasses: typed coercion with one-line errors, paths made absolute, dotted KEY=VALUE overrides."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path

import yaml

from ..errors import BadInput
from .schema import MOVED_KEYS

PATH_KEYS = ("data.train", "data.train_labels", "data.eval", "data.eval_labels", "lora.init")
# a built-in name, or a path (a "/" in it, or a .gguf file)
NAME_OR_PATH_KEYS = ("model.name", "npu_sim.device")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_paths(raw: dict, base: Path) -> None:
    """Paths written in a recipe file are relative to the file."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = (raw.get(section) or {}).get(name) if isinstance(raw.get(section), dict) else None
        if isinstance(value, str):
            raw[section][name] = str((base / value).resolve())
    for key in NAME_OR_PATH_KEYS:
        section, name = key.split(".")
        node = raw.get(section)
        if isinstance(node, dict) and _path_like(node.get(name)):
            node[name] = _local_path(node[name], base, key)


def _path_like(value) -> bool:
    return isinstance(value, str) and ("/" in value or value.lower().endswith(".gguf"))


def _local_path(text: str, base: Path, key: str) -> str:
    path = (base / Path(text).expanduser()).resolve()
    if key == "model.name" and not path.exists() and HUB_ID.fullmatch(text):
        raise BadInput(
            f"model.name: {text!r} is no local path, and lcsb downloads nothing; fetch it yourself with "
            f"`hf download {text} --local-dir DIR`, then set model.name=DIR"
        )
    return str(path)


def apply_override(raw: dict, item: str, schema: type) -> None:
    """One dotted KEY=VALUE from the command line into the raw recipe; paths in it are relative to the cwd."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise BadInput(f"override {item!r}: write KEY=VALUE, e.g. train.max_steps=20")
    _check_key(schema, key.split("."), f"command line: override {item!r}")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        value = text
    # the text as typed unless YAML read a string (a file named 2024)
    if key in PATH_KEYS and value is not None:
        value = str(Path(value if isinstance(value, str) else text).expanduser().resolve())
    elif key in NAME_OR_PATH_KEYS and _path_like(value):
        value = _local_path(value, Path.cwd(), key)
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise BadInput(f"override {item!r}: {part} is not a section")
        node = child
    node[leaf] = value


def _check_key(cls, parts: list[str], source: str, prefix: str = "") -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    if parts[0] not in names:
        _unknown_key(names, parts[0], prefix, source)
    hint = typing.get_type_hints(cls)[parts[0]]
    if len(parts) > 1 and dataclasses.is_dataclass(hint):
        _check_key(hint, parts[1:], source, f"{prefix}{parts[0]}.")
    elif len(parts) > 1:
        raise BadInput(f"{source}: {prefix}{parts[0]} is not a section")


def _unknown_key(names: list[str], key, prefix: str, source: str):
    if f"{prefix}{key}" in MOVED_KEYS:
        raise BadInput(
            f"{source}: {prefix}{key} moved to {MOVED_KEYS[f'{prefix}{key}']} (a dial the study measured losing or "
            "never measured, docs/RESULTS.md); set it there"
        )
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(names)}"
    raise BadInput(f"{source}: unknown key {prefix}{key}{hint}")


def build(cls, raw, prefix: str, source: str):
    if not isinstance(raw, dict):
        raise BadInput(f"{source}: {prefix.rstrip('.') or 'recipe'} must be a mapping of keys")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in names:
            _unknown_key(names, key, prefix, source)
        values[key] = _coerce(hints[key], value, f"{prefix}{key}", source)
    return cls(**values)


def _coerce(hint, value, key: str, source: str):
    if dataclasses.is_dataclass(hint):
        return build(hint, value if value is not None else {}, key + ".", source)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        if value not in args:
            raise BadInput(f"{key}: {value!r} is not one of {', '.join(args)}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, args[0]) for v in value):
            raise BadInput(f"{source}: {key} must be a list of {args[0].__name__}, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads 1e-4 as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise BadInput(f"{source}: {key} must be a finite number, got {value!r}")
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise BadInput(f"{source}: {key} must be {_type_name(hint)}, got {value!r}")
    return value


def _type_name(hint) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}
    return names.get(hint, str(hint))


def fields_of(cls, prefix: str = ""):
    """(dotted key, dataclass field, type hint) of every leaf key of a recipe schema, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from fields_of(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hints[f.name]


def choices_of(hint) -> tuple[str, ...] | None:
    """The allowed values of a Literal-typed key (optional or not), else None."""
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is typing.Literal:
            return typing.get_args(candidate)
    return None


def explain(recipe) -> str:
    """`lcsb validate --explain`: every key with its value, its allowed values or minimum, and its help."""
    lines = []
    for dotted, f, hint in fields_of(type(recipe)):
        value = recipe
        for part in dotted.split("."):
            value = getattr(value, part)
        allowed, minimum = choices_of(hint), f.metadata.get("min")
        rule = f"  [{' | '.join(allowed)}]" if allowed else f"  [>= {minimum}]" if minimum is not None else ""
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("...\n").strip()
        lines.append(f"{dotted}: {text}{rule}  # {f.metadata.get('help', '')}")
    return "\n".join(lines) + "\n"
