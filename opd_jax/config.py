"""Experiment configs: ml_collections `get_config(arg)` files, presets and overrides.

    cfg = load_config("configs/sft.py:tiny", overrides=["--config.optim.lr=3e-4"])

* ``path.py`` or ``path.py:arg`` — the file's ``get_config(arg)`` (or ``get_config()``) is
  called; ``arg`` picks a preset.
* ``--config.a.b=value`` — overrides; the value is parsed as a Python literal (falling back to
  a string) and must match the type already there (ints widen to floats). Unknown keys are
  errors: configs are locked, so a typo cannot silently add a field. A dict literal
  replaces a whole map section (``teachers.paths``, ``tasks.families``: only strings and
  sub-maps); for any other section (``optim``) it sets the keys it names, each checked
  like an override.

Every problem raises :class:`ConfigError` with a one-line message naming the key or file.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections


class ConfigError(ValueError):
    """A config file, preset or override is wrong; the message says which and why."""


def load_config(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    path, _, arg = spec.partition(":")
    if not path.endswith(".py"):
        raise ConfigError(f"config {spec!r}: expected a python file 'path.py' or 'path.py:preset'")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(
        f"_opd_config_{abs(hash(os.path.abspath(path)))}", path)
    module = importlib.util.module_from_spec(module_spec)
    # Config files may import their siblings (shared sections), as in big_vision.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} defines no get_config()")
    try:
        cfg = module.get_config(arg) if arg else module.get_config()
    except KeyError as e:
        raise ConfigError(f"config {path!r}: unknown preset {arg!r} ({e})") from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path!r}: get_config() returned {type(cfg).__name__}, "
                          "expected ml_collections.ConfigDict")
    cfg.lock()
    apply_overrides(cfg, overrides)
    return cfg


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
    """Apply ``--config.a.b=v`` (or ``a.b=v``) strings in place."""
    for item in overrides:
        text = item[len("--config."):] if item.startswith("--config.") else item
        key, eq, raw = text.partition("=")
        if not eq:
            raise ConfigError(f"override {item!r}: expected --config.key=value")
        set_value(cfg, key, parse_value(raw))


def parse_value(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def set_value(cfg: ml_collections.ConfigDict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for i, part in enumerate(parents):
        node = _child(node, part, ".".join(parents[:i + 1]))
        if not isinstance(node, ml_collections.ConfigDict):
            raise ConfigError(f"config key {'.'.join(parents[:i + 1])!r} is a "
                              f"{type(node).__name__}, not a section")
    if leaf not in node:
        raise ConfigError(f"unknown config key {dotted!r}{_suggest(leaf, node)}")
    old = node[leaf]
    if isinstance(old, ml_collections.ConfigDict):
        if isinstance(value, dict) and _is_map(old):
            # maps (teacher paths, task families) are replaced whole
            with node.unlocked():
                node[leaf] = ml_collections.ConfigDict(value)
            node[leaf].lock()
            return
        if isinstance(value, dict):     # a structured section: each key set and checked
            for k, v in value.items():
                set_value(cfg, f"{dotted}.{k}", v)
            return
        raise ConfigError(f"config key {dotted!r} is a section; set one of its keys "
                          f"({', '.join(sorted(old.keys()))}) or give a dict to replace it")
    value = _coerce(dotted, old, value)
    try:
        with node.unlocked():
            node[leaf] = value
    except TypeError as e:
        raise ConfigError(f"config key {dotted!r}: {e}") from None


def _is_map(section: ml_collections.ConfigDict) -> bool:
    """A map (keys are data: teacher paths, task families, routing tables) is empty or holds
    only strings and sub-maps; any other section is structured (its keys are fields)."""
    return all(isinstance(v, str) or (isinstance(v, ml_collections.ConfigDict) and _is_map(v))
               for v in section.values())


def _child(node, part, where):
    if part not in node:
        raise ConfigError(f"unknown config key {where!r}{_suggest(part, node)}")
    return node[part]


def _coerce(key: str, old: Any, value: Any) -> Any:
    if old is None:
        return value
    if isinstance(old, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(old, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif isinstance(old, int) and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif isinstance(old, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(old)(value)
    elif isinstance(old, str):
        return str(value)
    elif isinstance(value, type(old)):
        return value
    raise ConfigError(f"config key {key!r} expects {type(old).__name__}, got "
                      f"{type(value).__name__} {value!r}")


def _suggest(name: str, node: ml_collections.ConfigDict) -> str:
    close = difflib.get_close_matches(name, list(node.keys()), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(sorted(node.keys()))}"


def to_dict(cfg: ml_collections.ConfigDict) -> dict:
    """A JSON-safe plain dict (tuples become lists)."""
    return cfg.to_dict()
