"""A persistent XLA compilation cache for command-line runs.

Every stage of a recipe, every resumed run and every re-run of a command compiles the same
programs again (rollout prefill/decode, train steps, scoring): on a 2-core CPU that is
tens of seconds per stage. The `opd-jax` commands therefore turn on JAX's persistent
compilation cache before any work, so a program compiled once (same HLO, same backend)
is read back from disk afterwards, in this process and in later ones.

    OPD_JAX_COMPILATION_CACHE unset   -> $XDG_CACHE_HOME/opd_jax/xla (default ~/.cache/...)
    OPD_JAX_COMPILATION_CACHE=DIR     -> DIR
    OPD_JAX_COMPILATION_CACHE=0       -> off (also "off", "false", "no")

A cache directory set by the user through JAX's own ``jax_compilation_cache_dir`` wins.
Library use (``import opd_jax``) never turns it on; call :func:`enable` to.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
ENV = "OPD_JAX_COMPILATION_CACHE"
OFF = ("0", "off", "false", "no")
MIN_COMPILE_SECONDS = 0.5     # smaller programs are not worth a disk entry


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "opd_jax", "xla")


def enable(path: str | None = None) -> str | None:
    """Turn the persistent compilation cache on; returns its directory, or None when it is
    off (the environment says so, or the directory cannot be created or written)."""
    import jax   # lazy: start-up time (`opd-jax --help` and config errors never load jax)
    setting = os.environ.get(ENV, "")
    if setting.strip().lower() in OFF and path is None:
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = path or setting or default_dir()
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        log.warning("compilation cache off: cannot use %s (%s); set %s=DIR or %s=0",
                    path, e, ENV, ENV)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path
