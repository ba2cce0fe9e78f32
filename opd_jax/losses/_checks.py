"""Input validation shared by the losses: every check runs at trace time (shapes, dtypes,
static hyperparameters), so a bad call fails before any work is compiled or wasted.

Shape letters: B batch (sequences), T tokens, V vocab, K teachers.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def compute_dtype(*xs: jax.Array) -> jnp.dtype:
    """fp32, or fp64 when an input is fp64 (x64 finite-difference tests); never bf16/fp16."""
    dtype = jnp.dtype(jnp.float32)
    for x in xs:
        if x is not None and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
            dtype = jnp.promote_types(dtype, jnp.asarray(x).dtype)
    return dtype


def concrete(x: Any) -> np.ndarray | None:
    """`x` as a numpy array when its value is known at trace time, else None (a tracer)."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
            TypeError):
        return None


def check_rank(name: str, x: jax.Array, ranks: tuple[int, ...], layout: str) -> None:
    if jnp.ndim(x) not in ranks:
        raise ValueError(f"{name} has shape {tuple(jnp.shape(x))}, expected {layout}")


def check_shape(name: str, x: jax.Array, shape: tuple[int, ...], layout: str) -> None:
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(jnp.shape(x))}, expected {layout} = "
                         f"{tuple(shape)}")


def check_bxt(ref_name: str, ref: jax.Array, **others: jax.Array | None) -> tuple[int, int]:
    """All of `others` (None skipped) must have the [B, T] shape of `ref`."""
    check_rank(ref_name, ref, (2,), "[B, T]")
    for name, x in others.items():
        if x is not None:
            check_shape(name, x, ref.shape, f"[B, T] like {ref_name}")
    return ref.shape


def check_adv(name: str, adv: jax.Array, shape_BxT: tuple[int, int]) -> None:
    """An advantage is per sequence [B] or per token [B, T]."""
    b, t = shape_BxT
    if tuple(jnp.shape(adv)) not in ((b,), (b, t)):
        raise ValueError(f"{name} has shape {tuple(jnp.shape(adv))}, expected [B] = ({b},) "
                         f"or [B, T] = ({b}, {t})")


def check_scalar(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False) -> None:
    """Range check of a hyperparameter when it is concrete (traced values are trusted)."""
    v = concrete(value)
    if v is None:
        return
    if v.ndim != 0:
        raise ValueError(f"{name}={v!r} must be a scalar")
    v = float(v)
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
    if np.isnan(v) or bad_lo or bad_hi:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else f"{lo:g}"
        hi_s = "inf" if hi is None else f"{hi:g}"
        raise ValueError(f"{name}={v:g} is outside the allowed range {left}{lo_s}, {hi_s}{right}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}, expected one of {choices}")


def check_weights(weights: jax.Array, k: int, b: int, t: int | None = None) -> None:
    """Teacher weights: shape [K], [B, K] or (given `t`) per token [B, T, K]; non-negative,
    summing to 1 over the K teachers when concrete.

    Traced weights (inside jit) cannot be inspected at trace time: callers are trusted.
    """
    shapes = ((k,), (b, k)) + (((b, t, k),) if t is not None else ())
    if tuple(jnp.shape(weights)) not in shapes:
        per_token = f" or [B, T, K] = ({b}, {t}, {k})" if t is not None else ""
        raise ValueError(f"weights has shape {tuple(jnp.shape(weights))}, expected [K] = ({k},) "
                         f"or [B, K] = ({b}, {k}){per_token}")
    w = concrete(weights)
    if w is None:
        return
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and non-negative, got min {np.min(w):g}")
    sums = w.sum(-1)
    # fp32 weights sum to 1 within rounding; bf16 ones (8-bit mantissa) need a looser bound.
    wdtype = jnp.asarray(weights).dtype
    eps = float(jnp.finfo(wdtype).eps) if jnp.issubdtype(wdtype, jnp.floating) else 0.0
    tol = max(1e-5, 4 * k * eps)
    worst = float(np.max(np.abs(sums - 1.0)))
    if worst > tol:
        raise ValueError(f"weights must sum to 1 over the K={k} teachers, got a sum of "
                         f"{float(np.ravel(sums)[np.argmax(np.abs(np.ravel(sums) - 1))]):.6g}")
