"""Experiment configs: ml_collections `get_config(arg)` files, presets and overrides.

    cfg = load_config("configs/sft.py:tiny", overrides=["--config.optim.lr=3e-4"])

* ``path.py`` or ``path.py:arg`` — the file's ``get_config(arg)`` (or ``get_config()``) is
  called; ``arg`` picks a preset. A path that exists is used as given (a user's config);
  ``configs/NAME.py`` that does not exist relative to the current directory is the config
  shipped in the package (``opd_jax/configs/NAME.py``, `PACKAGED_CONFIGS`), so the
  documented commands work from any directory once the package is installed.
* ``--config.a.b=value`` — overrides; the value is parsed as a Python literal (falling back to
  a string) and must match the type already there (ints widen to floats). Unknown keys are
  errors: configs are locked, so a typo cannot silently add a field. A dict literal
  replaces a whole free-form map (`FREE_FORM_MAPS`: ``tasks.families``, ``teachers.paths``,
  ``teachers.table``, ``teachers.weights``, ``domains``, ``stage_teachers``, whose keys are
  names the user picks); for any other section (``optim``, ``rollout``) it sets the keys
  it names, nested dicts for sub-sections, every key checked like an override
  (recursively, all before anything is set): an unknown key fails naming it, its section
  and the known keys.

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

from opd_jax.schema import ConfigError   # noqa: F401 - the one config error, re-exported


# The trainer configs shipped in the package (sft.py, grpo.py, opd.py, eval.py and their
# shared sections, _sections.py): what ``configs/NAME.py`` names when no such file exists
# relative to the current directory.
PACKAGED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def resolve_config_path(path: str) -> str:
    """The config file `path` names: `path` itself when it exists, else for
    ``configs/NAME.py`` the packaged ``opd_jax/configs/NAME.py`` when that exists.

    Raises ConfigError when neither does."""
    if os.path.isfile(path):
        return path
    folder, name = os.path.split(os.path.normpath(path))
    packaged = os.path.join(PACKAGED_CONFIGS, name)
    if folder == "configs" and os.path.isfile(packaged):
        return packaged
    shipped = sorted(f for f in os.listdir(PACKAGED_CONFIGS)
                     if f.endswith(".py") and not f.startswith("_"))
    raise ConfigError(f"config file {path!r} does not exist (the packaged configs are "
                      f"configs/{{{','.join(shipped)}}})")


def load_config(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    path, _, arg = spec.partition(":")
    if not path.endswith(".py"):
        raise ConfigError(f"config {spec!r}: expected a python file 'path.py' or 'path.py:preset'")
    path = resolve_config_path(path)
    module_spec = importlib.util.spec_from_file_location(
        f"_opd_config_{abs(hash(os.path.abspath(path)))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        _exec_with_siblings(module_spec, module, os.path.dirname(os.path.abspath(path)))
    except Exception as e:  # noqa: BLE001 - any error in the user's file: one line naming it
        raise ConfigError(f"config file {path!r} failed to import: {_where(e, path)}"
                          f"{type(e).__name__}: {e}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} defines no get_config()")
    try:
        cfg = module.get_config(arg) if arg else module.get_config()
    except KeyError as e:
        raise ConfigError(f"config {path!r}: unknown preset {arg!r} ({e})") from None
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config file {path!r}: get_config({arg!r}) raised "
                          f"{_where(e, path)}{type(e).__name__}: {e}") from e
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path!r}: get_config() returned {type(cfg).__name__}, "
                          "expected ml_collections.ConfigDict")
    cfg.lock()
    apply_overrides(cfg, overrides)
    return cfg


def _where(e: BaseException, path: str) -> str:
    """"line N: " of the deepest frame of `e` in the config file `path` (or "")."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f"line {e.lineno}: "
    line = None
    tb = e.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"line {line}: " if line else ""


def _exec_with_siblings(module_spec, module, folder: str) -> None:
    """Run a config file that may import its siblings (shared sections, as in big_vision:
    ``from _sections import ...``) from its own folder. What it imports from that folder is
    dropped from ``sys.modules`` afterwards, so two folders' ``_sections.py`` (the packaged
    one, a user's) never stand in for each other."""
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
        for name in set(sys.modules) - before:
            file = getattr(sys.modules[name], "__file__", None)
            if "." not in name and file and os.path.dirname(os.path.abspath(file)) == folder:
                del sys.modules[name]


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
        if not isinstance(value, dict):
            raise ConfigError(f"config key {dotted!r} is a section; set one of its keys "
                              f"({', '.join(sorted(old.keys()))}) or give a dict to replace it")
        if is_free_form(dotted):     # names -> values: replaced whole, any keys
            with node.unlocked():
                node[leaf] = ml_collections.ConfigDict(value)
            node[leaf].lock()
            return
        _check_section(dotted, old, value)      # every key, before anything is set
        for k, v in value.items():
            set_value(cfg, f"{dotted}.{k}", v)
        return
    value = _coerce(dotted, old, value)
    try:
        with node.unlocked():
            node[leaf] = value
    except TypeError as e:
        raise ConfigError(f"config key {dotted!r}: {e}") from None


# Sections whose keys are data, not fields: task family per domain (``tasks.families``,
# an experiment's ``domains``), teacher key -> checkpoint (``teachers.paths``), cell or
# domain -> teacher key (``teachers.table``), cell or domain -> {teacher key: weight}
# (``teachers.weights``), served teacher key -> parameter count (``teachers.served.params``),
# domain -> stage (``stage_teachers``, experiments/glm). A dict
# literal replaces them whole and may name any keys. Matched as a dotted suffix
# (``data.tasks.families``, ``student.teachers.paths`` are ones too). Every other section,
# however few or string-valued its fields (``merge``), is structured.
FREE_FORM_MAPS = ("tasks.families", "teachers.paths", "teachers.table", "teachers.weights",
                  "teachers.served.params", "teachers.tokenizers", "domains", "stage_teachers", "corpus.dose")


def is_free_form(dotted: str) -> bool:
    return any(dotted == m or dotted.endswith("." + m) for m in FREE_FORM_MAPS)


def _check_section(dotted: str, section: ml_collections.ConfigDict, value: dict) -> None:
    """Raise ConfigError unless every key of `value` (recursively) is a key of the
    structured `section` with a value of a fitting type."""
    for k, v in value.items():
        key = f"{dotted}.{k}"
        if not isinstance(k, str) or k not in section:
            close = difflib.get_close_matches(str(k), list(section.keys()), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint} in section {dotted!r}; "
                              f"known keys: {', '.join(sorted(section.keys()))}")
        old = section[k]
        if isinstance(old, ml_collections.ConfigDict):
            if not isinstance(v, dict):
                raise ConfigError(f"config key {key!r} is a section; set one of its keys "
                                  f"({', '.join(sorted(old.keys()))}) or give a dict")
            if not is_free_form(key):
                _check_section(key, old, v)
        else:
            _coerce(key, old, v)


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
