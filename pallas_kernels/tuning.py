"""Tuned block sizes of implementation="triton": a JSON table per device kind and shape class.

Legend: N tokens, D student hidden, E teacher hidden, V vocab.

A knob (block_n, block_v, block_d, chunk_v, vocab_splits) the caller leaves None comes
from the table entry of this device (``jax.devices()[0].device_kind``) and the call's
shape class; explicit arguments always win, and an unknown device or shape class (or any
implementation but "triton") gets DEFAULTS. The shape class rounds N, max(D, E) and V up
to powers of two and names the input dtype:

    shape_class(16384, 4096, 4096, 151_936, jnp.bfloat16) == "n16384-d4096-v262144-bfloat16"

Tables: every ``pallas_kernels/tuned/triton_*.json`` (or only the file named by the
environment variable PALLAS_TRITON_TABLE), read once, validated on reading (clear errors
naming the file and entry). `bash benchmarks/gpu_kernels.sh` sweeps the knobs per
benchmark shape and writes them with `write_entries`. Format:

    {"format": 1,
     "devices": {"NVIDIA H200": {"n16384-d4096-v262144-bfloat16": {
         "block_n": 64, "block_v": 128, "block_d": 64, "chunk_v": 8192, "vocab_splits": 0,
         "measured": {"fwd_bwd_ms": 812.0, "default_ms": 900.1, ...}}}}}

"measured" (optional, any JSON object) is provenance only; it is never read here.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os

import jax
import jax.numpy as jnp

from pallas_kernels import common

FORMAT = 1
KNOBS = ("block_n", "block_v", "block_d", "chunk_v", "vocab_splits")
# common.Config's defaults (every implementation; triton's fallback): 64, 128, 128, 8192, 0.
DEFAULTS = {f.name: f.default for f in dataclasses.fields(common.Config) if f.name in KNOBS}
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
ENV = "PALLAS_TRITON_TABLE"
_POW2 = ("block_n", "block_v", "block_d")


class TableError(ValueError):
    """A tuning table that cannot be used (bad JSON, format, or entry)."""


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(int(x), 1))))


def shape_class(n: int, d: int, e: int, v: int, dtype) -> str:
    """"n<N>-d<max(D, E)>-v<V>-<dtype>", each size rounded up to a power of two."""
    return (f"n{_pow2_ceil(n)}-d{_pow2_ceil(max(d, e))}-v{_pow2_ceil(v)}-"
            f"{jnp.dtype(dtype).name}")


def check_entry(entry, where: str) -> dict:
    """The five knobs of one table entry, validated; raises TableError naming `where`."""
    if not isinstance(entry, dict):
        raise TableError(f"{where}: expected an object of {KNOBS}, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(KNOBS) - {"measured"})
    missing = [k for k in KNOBS if k not in entry]
    if unknown or missing:
        raise TableError(f"{where}: unknown keys {unknown}, missing keys {missing}; expected "
                         f"exactly {KNOBS} (and optionally 'measured')")
    out = {}
    for k in KNOBS:
        value = entry[k]
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= (
            0 if k == "vocab_splits" else 1)
        if ok and k in _POW2:
            ok = value & (value - 1) == 0
        if not ok:
            want = ("an int >= 0 (0: auto)" if k == "vocab_splits" else
                    "a power of two" if k in _POW2 else "a positive int")
            raise TableError(f"{where}: {k}={value!r}; expected {want}")
        out[k] = value
    if out["chunk_v"] % out["block_v"]:
        raise TableError(f"{where}: chunk_v={out['chunk_v']} is not a multiple of "
                         f"block_v={out['block_v']}")
    return out


def parse_table(raw, path: str) -> dict[str, dict[str, dict]]:
    """{device kind: {shape class: knobs}} from a decoded table file; raises TableError."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(
            raw.get("devices"), dict):
        raise TableError(f"{path}: expected {{\"format\": {FORMAT}, \"devices\": {{...}}}}, got "
                         f"keys {sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
    out = {}
    for device, classes in raw["devices"].items():
        if not isinstance(classes, dict):
            raise TableError(f"{path}: devices[{device!r}] is not an object of shape classes")
        out[device] = {cls: check_entry(entry, f"{path}: devices[{device!r}][{cls!r}]")
                       for cls, entry in classes.items()}
    return out


def read_file(path: str) -> dict:
    """The decoded JSON of a table file (not validated); TableError on bad JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TableError(f"{path}: not valid JSON ({e})") from e


@functools.lru_cache(maxsize=None)
def load_tables(paths: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    """The merged, validated tables of `paths` (cached: each set of files is read once)."""
    merged: dict[str, dict[str, dict]] = {}
    seen: dict[tuple[str, str], str] = {}
    for path in paths:
        for device, classes in parse_table(read_file(path), path).items():
            for cls, knobs in classes.items():
                if (device, cls) in seen:
                    raise TableError(f"{path}: devices[{device!r}][{cls!r}] is also in "
                                     f"{seen[(device, cls)]}; expected one entry per device "
                                     f"and shape class")
                seen[(device, cls)] = path
                merged.setdefault(device, {})[cls] = knobs
    return merged


def table_paths() -> tuple[str, ...]:
    """The files read: $PALLAS_TRITON_TABLE alone, else the package's tuned/triton_*.json."""
    override = os.environ.get(ENV)
    if override:
        if not os.path.isfile(override):
            raise TableError(f"{ENV}={override!r} is not a file")
        return (os.path.abspath(override),)
    return tuple(sorted(glob.glob(os.path.join(TABLE_DIR, "triton_*.json"))))


def lookup(n: int, d: int, e: int, v: int, dtype, device_kind: str | None = None) -> dict | None:
    """The table's knobs for this device and shape class, or None."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    return load_tables(table_paths()).get(kind, {}).get(shape_class(n, d, e, v, dtype))


def resolve(implementation: str, knobs: dict, n: int, d: int, e: int, v: int, dtype) -> dict:
    """Every knob: the caller's where given (not None), else the table's (triton), else DEFAULTS."""
    base = DEFAULTS
    if implementation == "triton" and any(knobs.get(k) is None for k in KNOBS):
        base = lookup(n, d, e, v, dtype) or DEFAULTS
    return {k: base[k] if knobs.get(k) is None else knobs[k] for k in KNOBS}


def write_entries(path: str, device_kind: str, entries: dict[str, dict]) -> dict:
    """Add/replace `entries` ({shape class: knobs (+ "measured")}) of one device in the table
    file at `path` (created if absent; other devices and classes kept); returns the table."""
    raw = read_file(path) if os.path.isfile(path) else {"format": FORMAT, "devices": {}}
    parse_table(raw, path)
    for cls, entry in entries.items():
        check_entry(entry, f"new entry devices[{device_kind!r}][{cls!r}]")
    raw["devices"].setdefault(device_kind, {}).update(entries)
    raw["devices"][device_kind] = dict(sorted(raw["devices"][device_kind].items()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    load_tables.cache_clear()
    return raw


def device_file_name(device_kind: str) -> str:
    """"NVIDIA H200" -> "triton_h200.json"."""
    words = [w for w in device_kind.lower().replace("-", " ").split() if w != "nvidia"]
    slug = "_".join("".join(c for c in w if c.isalnum()) for w in words) or "device"
    return f"triton_{slug}.json"
