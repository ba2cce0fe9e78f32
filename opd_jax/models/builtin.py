"""Models shipped inside the package, addressed by name: ``init_from="builtin:base"``.

    resolve_model_path("builtin:base")   # -> .../opd_jax/assets/base (an HF folder)
    resolve_model_path("runs/sft")       # any other path is returned unchanged

``base`` is the testbed's pretrained base: a small decoder trained by
``python -m studies.base_model`` on demos from the train split of every built-in
task family (its model card, ``opd_jax/assets/base/README.md``, lists its size, corpus,
steps, wall time and held-out reward per family, difficulty and effort). It uses the
synthetic char-level tokenizer (``tokenizer="synthetic"``).
"""
from __future__ import annotations

import os

PREFIX = "builtin:"
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
BUILTIN_MODELS = ("base",)


def builtin_path(name: str) -> str:
    """The folder of a shipped model (it may not exist yet while it is being built)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {PREFIX}{name}: expected one of "
                         f"{[PREFIX + n for n in BUILTIN_MODELS]}")
    return os.path.join(ASSETS, name)


def resolve_model_path(path: str) -> str:
    """``builtin:NAME`` -> the shipped folder (checked to exist); anything else unchanged."""
    path = os.fspath(path)
    if not path.startswith(PREFIX):
        return path
    folder = builtin_path(path[len(PREFIX):])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{path}: {folder} has no config.json (re-create it with "
                                f"python -m studies.base_model)")
    return folder
