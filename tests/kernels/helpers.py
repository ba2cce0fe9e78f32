"""Shared fixtures for the fused-kernel tests: random problems and a value+grad comparator.

Legend: N tokens, D student hidden, E teacher hidden, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fused_clipped_log_ratio, fused_reverse_kl

# Small blocks so that tiny shapes still cover ragged token/vocab tiles and several chunks.
SMALL_BLOCKS = dict(block_n=16, block_v=32, block_d=8, chunk_v=96)


def problem(n, d, e, v, *, dtype=jnp.float32, seed=0, scale=0.4):
    ks = jax.random.split(jax.random.key(seed), 6)
    h_s = jax.random.normal(ks[0], (n, d)).astype(dtype)
    w_s = (jax.random.normal(ks[1], (d, v)) * scale).astype(dtype)
    h_t = jax.random.normal(ks[2], (n, e)).astype(dtype)
    w_t = (jax.random.normal(ks[3], (e, v)) * scale).astype(dtype)
    y = jax.random.randint(ks[4], (n,), 0, v)
    mask = jax.random.bernoulli(ks[5], 0.7, (n,))
    return h_s, w_s, h_t, w_t, y, mask


def kl_objective(impl, h_t, w_t, **kw):
    """A nonlinear readout so that per-token cotangents differ (sin), as a real weighting would."""
    def f(h_s, w_s):
        return jnp.sum(jnp.sin(3.0 * fused_reverse_kl(h_s, w_s, h_t, w_t, implementation=impl, **kw)))
    return f


def ratio_objective(impl, h_t, w_t, y, **kw):
    def f(h_s, w_s):
        lp_s, lp_t, r = fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y, implementation=impl, **kw)
        return jnp.sum(jnp.cos(lp_s) * 1.3 + lp_t * 0.1 + r * lp_s)
    return f


def assert_close(actual, expected, tol, what=""):
    """max |a - e| <= tol * max(1, max |e|): relative to the array's scale."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    scale = max(1.0, float(np.max(np.abs(expected))))
    err = float(np.max(np.abs(actual - expected)))
    assert err <= tol * scale, f"{what}: max abs err {err:.3g} > {tol:g} x scale {scale:.3g}"


def check_value_and_grad(make_objective, impl, h_s, w_s, tol_value, tol_grad):
    v_ref, (gh_ref, gw_ref) = jax.value_and_grad(make_objective("reference"), (0, 1))(h_s, w_s)
    v, (gh, gw) = jax.jit(jax.value_and_grad(make_objective(impl), (0, 1)))(h_s, w_s)
    assert_close(v, v_ref, tol_value, f"{impl} value")
    assert gh.dtype == h_s.dtype and gw.dtype == w_s.dtype
    assert_close(gh, gh_ref, tol_grad, f"{impl} d h_s")
    assert_close(gw, gw_ref, tol_grad, f"{impl} d w_s")
