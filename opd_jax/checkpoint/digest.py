"""Per-array checksums and finiteness of a train state, recorded in every checkpoint's meta
and verified on restore. The checksum is exact whatever the reduction order (sharded or
not, any mesh)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from opd_jax.distributed import fetch, settle


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read back intact; the message names the step and
    the array or file."""


# Elements per block of `_leaf_digest`: its temporaries (the uint32 words and weights) are
# bounded by a block, not by the array. Whole-array uint32 temporaries of every leaf at once
# were 4.4 GiB for a train state holding a 151k x 2048 embedding and its two Adam moments.
DIGEST_BLOCK = 1 << 22


def _block_digest(x: jax.Array, start, dtype) -> tuple[jax.Array, jax.Array]:
    """(checksum, all-finite) of a flat block whose first element is at `start`: `x` holds
    the values of an array of `dtype`, or, for dtypes narrower than 4 bytes, their bits."""
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint32)
    elif x.dtype.itemsize >= 4:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)    # 8-byte dtypes: a trailing [2]
    else:
        u = x.astype(jnp.uint32)                           # uint16 / uint8 bits
    u = u.reshape(-1)
    per = u.size // x.size if x.size else 1               # uint32 words per element
    pos = jnp.asarray(start, jnp.uint32) * jnp.uint32(per) + jnp.arange(u.size,
                                                                         dtype=jnp.uint32)
    digest = jnp.sum((u ^ (u >> 15)) * (pos * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)),
                     dtype=jnp.uint32)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return digest, jnp.asarray(True)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in (2, 4):
        fi = jnp.finfo(dtype)           # finite: the exponent bits are not all ones
        exponent = jnp.uint32(((1 << fi.nexp) - 1) << fi.nmant)
        return digest, jnp.all((u & exponent) != exponent)
    values = x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)
    return digest, jnp.all(jnp.isfinite(values))


@functools.partial(jax.jit, static_argnames="block")
def _leaf_digest(x: jax.Array, block: int = DIGEST_BLOCK) -> tuple[jax.Array, jax.Array]:
    """(uint32 position-weighted checksum of the raw bits, all-finite flag) of one array.

    Computed `block` elements at a time (a loop over dynamic slices), so its temporaries
    are a block's whatever the array's size (plus, for dtypes narrower than 4 bytes, one copy
    of the array's bits: sliced as bf16, XLA's CPU backend would carry the array through the
    loop widened to float32). The value is the whole-array sum: a wrapping uint32 sum of
    per-position terms does not depend on how it is split. One jit call per array, so only
    one array's temporaries are live at a time."""
    block = max(1, int(block))
    flat = x.reshape(-1)
    if x.dtype.itemsize < 4 and x.dtype != jnp.bool_:
        flat = jax.lax.bitcast_convert_type(flat, {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize])
    n = flat.size
    full = n // block if n > block else 0
    digest, finite = jnp.uint32(0), jnp.asarray(True)
    if full:
        def body(i, carry):
            d, f = carry
            start = i.astype(jnp.uint32) * jnp.uint32(block)
            bd, bf = _block_digest(jax.lax.dynamic_slice(flat, (i * block,), (block,)), start,
                                   x.dtype)
            return d + bd, f & bf
        digest, finite = jax.lax.fori_loop(0, full, body, (digest, finite))
    if n - full * block or not full:
        bd, bf = _block_digest(flat[full * block:], full * block, x.dtype)
        digest, finite = digest + bd, finite & bf
    return digest, finite


def state_digest(tree: Any, prefix: str = "") -> tuple[dict[str, int], list[str]]:
    """({array path: checksum}, [paths of arrays holding a NaN or inf]) of a pytree.

    The checksum is a wrapping uint32 sum, so it is exact whatever the reduction order
    (sharded or not, any mesh).

    Multi-process, the arrays are digested one at a time (`distributed.settle`: many small
    multi-device programs in flight at once deadlock under gloo;
    tests/trainers/test_multihost_policy.py saves through it)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [prefix + jax.tree_util.keystr(p) for p, _ in flat]
    out = fetch([settle(_leaf_digest(jnp.asarray(x))) for _, x in flat])
    sums = {n: int(d) for n, (d, _) in zip(names, out)}
    return sums, [n for n, (_, ok) in zip(names, out) if not bool(ok)]


def verify_digest(tree: Any, meta: dict, where: str, prefix: str = "") -> None:
    """Raise CheckpointError unless every array of `tree` is finite and matches the
    checksum recorded in `meta` (checkpoints written before checksums: finiteness only)."""
    sums, bad = state_digest(tree, prefix)
    if bad:
        raise CheckpointError(f"{where}: array {bad[0]} holds NaN or inf"
                              + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    saved = meta.get("checksums")
    if saved:
        wrong = [n for n, v in sums.items() if n in saved and saved[n] != v]
        missing = [n for n in sums if n not in saved]
        if wrong or missing:
            name = (wrong or missing)[0]
            raise CheckpointError(f"{where}: array {name} does not match the checksum "
                                  f"recorded when it was saved ({saved.get(name)} != "
                                  f"{sums[name]}); its bytes are corrupt")
