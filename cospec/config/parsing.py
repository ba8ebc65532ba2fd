"""Building configs from nested dicts (files, overrides), with every value coerced to its field's
type or a `ConfigError` naming the field; and `describe`, the fields' documentation."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from cospec.config.run import RunConfig
from cospec.config.sections import ConfigError, _check


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Coerce a parsed YAML/TOML/JSON value to the declared field type, or raise naming the field."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None:  # an empty section in a file ("grpo:" with nothing under it)
            value = {}
        _check(isinstance(value, dict), name, f"expected a table of fields, got {value!r}")
        return _build(tp, value, name)
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        _check(isinstance(value, (list, tuple)), name, f"expected a list, got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], name)
    if tp is bool:
        _check(isinstance(value, bool), name, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), name,
               f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), name,
               f"expected a number, got {value!r}")
        _check(math.isfinite(value), name, f"must be finite, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, (str, int, float)) and not isinstance(value, bool), name,
               f"expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"{dotted}: unknown field (known: {', '.join(sorted(names))})")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _nested_update(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _nested_update(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"model.num_layers=4"`` -> ``{"model": {"num_layers": 4}}`` (value parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    """The nested dict of a YAML, TOML or JSON config file (by suffix; YAML otherwise).

    A file that is missing, unreadable, not parseable (the message gives the parser's line and
    column) or whose top level is not a table of sections raises ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path}: not found")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: cannot be read: {e}") from e
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)  # its message ends "(at line L, column C)"
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: not valid TOML: {e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"config file {path}{where}: not valid YAML: {problem}") from e
    if data is None:  # an empty YAML file: nothing to lay over the recipe
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a table of sections "
                          f"(model:, grpo:, ...), got a {type(data).__name__}")
    return data


def apply(cfg: RunConfig, data: dict[str, Any]) -> RunConfig:
    """A new config: `cfg` with the nested `data` laid over it, validated."""
    return _build(RunConfig, _nested_update(dataclasses.asdict(cfg), data))


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) for every field, read from the ``#:`` comments above them."""
    import inspect

    docs: dict[str, str] = {}
    try:
        lines = inspect.getsource(cls).splitlines()
    except OSError:
        lines = []
    pending = ""
    for line in lines:
        s = line.strip()
        if s.startswith("#:"):  # a doc may run over several lines
            pending = f"{pending} {s[2:].strip()}".strip()
        elif ":" in s and pending:
            docs[s.split(":", 1)[0].strip()] = pending
            pending = ""
    rows = []
    default = cls()
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        v = getattr(default, f.name)
        if dataclasses.is_dataclass(v):
            rows.extend(describe(type(v), dotted + "."))
        else:
            rows.append((dotted, repr(v), docs.get(f.name, "")))
    return rows
