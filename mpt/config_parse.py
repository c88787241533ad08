"""Reading config values: `key=value` words and YAML mappings set on a typed config dataclass with a type
check (set_key, apply_mapping, parse_overrides), a command's own options (parse_options), and the YAML
files themselves (safe_load refuses a repeated key; load_experiment_yaml reads an experiment's
config.yaml). Works on any dataclass: the schema itself is mpt.config's."""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import pathlib
import types
import typing
from typing import Any

import yaml

from mpt.errors import UserError


def _coerce(value, tp, key: str, what: str = "config key"):
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):  # e.g. num_workers: an integer or auto
        for alt in typing.get_args(tp):
            try:
                return _coerce(value, alt, key, what)
            except UserError:
                pass
        show = " or ".join(_describe(a) for a in typing.get_args(tp))
        raise UserError(f"{what} {key!r} expects {show}, got {value!r}")
    if origin is typing.Literal:  # a closed set of values, e.g. channels_last: auto | true | false
        args = typing.get_args(tp)
        for a in args:
            if value == a and type(value) is type(a):
                return a
        show = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
        raise UserError(f"{what} {key!r} expects one of {show}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, item_tp, key, what) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{what} {key!r} expects true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"{what} {key!r} expects an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # yaml reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{what} {key!r} expects a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{what} {key!r} expects a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp} for {key}")


def _describe(tp) -> str:
    """A type as an error message names it: an integer, auto, ..."""
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _field_types(dc) -> dict[str, Any]:
    return _class_field_types(type(dc))


@functools.lru_cache(maxsize=None)
def _class_field_types(cls) -> dict[str, Any]:
    # get_type_hints is slow, and a grid resolves every cell: once per class.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def set_key(cfg, dotted: str, value, *, where: str = "override") -> None:
    """Set cfg.<dotted> = value with a type check. Unknown keys are an error naming the valid ones."""
    obj, parts = cfg, dotted.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(obj):
            raise UserError(f"unknown config key {dotted!r} ({where}): {'.'.join(parts[:i])} has no sub-keys")
        types = _field_types(obj)
        if part not in types:
            prefix = ".".join(parts[:i])
            valid = ", ".join((f"{prefix}.{k}" if prefix else k) for k in types)
            raise UserError(f"unknown config key {dotted!r} ({where}); valid keys here: {valid}")
        if i == len(parts) - 1:
            cur = getattr(obj, part)
            if dataclasses.is_dataclass(cur):
                if not isinstance(value, dict):
                    raise UserError(f"config key {dotted!r} ({where}) is a section; give a mapping or set {dotted}.<key>")
                for k, v in value.items():
                    set_key(cfg, f"{dotted}.{k}", v, where=where)
            else:
                try:
                    setattr(obj, part, _coerce(value, types[part], dotted))
                except UserError as e:  # name where the value came from: a config.yaml section, the command line
                    raise UserError(f"{e} ({where})") from None
        else:
            obj = getattr(obj, part)


def apply_mapping(cfg, mapping: dict | None, where: str) -> None:
    if mapping is not None and not isinstance(mapping, dict):
        raise UserError(f"{where} must be a mapping of config keys, not a {type(mapping).__name__}")
    for k, v in (mapping or {}).items():
        set_key(cfg, k, v, where=where)


def parse_overrides(overrides: list[str], example: str = "precision=mixed optim.lr=0.1") -> list[tuple[str, Any]]:
    """`key=value` words -> [(key, value)], each value read as YAML (numbers, true/false, lists)."""
    out = []
    for o in overrides:
        if "=" not in o:
            raise UserError(f"bad argument {o!r}: write key=value, e.g. {example}")
        k, v = o.split("=", 1)
        try:
            val = safe_load(v) if v != "" else ""
        except yaml.YAMLError:
            val = v
        out.append((k.strip(), val))
    return out


def parse_options(argv: list[str], defaults: dict[str, Any], prog: str, example: str = "") -> dict[str, Any]:
    """A command's own `key=value` options (a benchmark's, not a run's config), typed like their
    defaults and read like config overrides. `-h` lists the keys; an unknown key is a UserError."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: python -m {prog} [key=value ...]\nkeys (default):")
        for k, v in defaults.items():
            print(f"  {k}={str(v).lower() if isinstance(v, bool) else v}")
        raise SystemExit(0)
    out = dict(defaults)
    for k, v in parse_overrides(argv, example or " ".join(f"{k}={v}" for k, v in list(defaults.items())[:2])):
        if k not in defaults:
            raise UserError(f"unknown key {k!r}; valid keys: {', '.join(defaults)}")
        out[k] = _coerce(v, type(defaults[k]), k, "option")
        if isinstance(out[k], float) and not math.isfinite(out[k]):
            raise UserError(f"option {k!r} expects a finite number, got {v!r}")
    return out


# ------------------------------------------------------------------ YAML that refuses a repeated key


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping naming a key twice. PyYAML keeps the last value without a
    word, so a grid listing `model:` twice under axes lost the first list's cells, and a config.yaml
    setting a key twice silently used the second. Merge keys (`<<: *base`) may still be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if seen is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (first at line {seen.line + 1})",
                        key_node.start_mark)
        return super().construct_mapping(node, deep)


def safe_load(stream):
    """yaml.safe_load that refuses a repeated key (UniqueKeyLoader): every config and grid file goes
    through it."""
    return yaml.load(stream, Loader=UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def yaml_error(e: yaml.YAMLError) -> str:
    """A YAML parse error on one line: what is wrong and where ("line 3, column 7")."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def load_experiment_yaml(path: pathlib.Path) -> dict:
    try:
        st = path.stat()
        # A grid resolves every cell from the same file: parsed once per version of it (a copy each time).
        data = copy.deepcopy(_parse_yaml(str(path), st.st_mtime_ns, st.st_size))
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {yaml_error(e)}; fix that line") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must be a mapping with base:, models: and profiles:, not a {type(data).__name__}")
    unknown = set(data) - {"base", "models", "profiles"}
    if unknown:
        raise UserError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: base, models, profiles")
    for key in ("base", "models", "profiles"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise UserError(f"{path}: {key}: must be a mapping, not a {type(data[key]).__name__}")
    return data


@functools.lru_cache(maxsize=32)
def _parse_yaml(path: str, mtime_ns: int, size: int):
    with open(path) as f:
        return safe_load(f) or {}
