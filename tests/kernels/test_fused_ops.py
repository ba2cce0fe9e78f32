"""Values and gradients of "xla" and "triton" (interpret mode) against "reference".

Sweep: N not a multiple of block_n, V not a multiple of block_v or of chunk_v, D != E,
temperature != 1, fp32 and bf16, masked tokens. Mosaic and shard_map live in their own files.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_clipped_log_ratio, fused_reverse_kl
from tests.kernels.helpers import (SMALL_BLOCKS, assert_close, check_value_and_grad, kl_objective, problem,
                                   ratio_objective)

IMPLS = ["xla", "triton"]
# (N, D, E, V, temperature): ragged tokens and vocab; D != E; T != 1.
SHAPES = [(37, 24, 40, 301, 1.7), (16, 16, 16, 64, 1.0)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,d,e,v,temp", SHAPES)
def test_reverse_kl_fp32(impl, n, d, e, v, temp):
    h_s, w_s, h_t, w_t, _, _ = problem(n, d, e, v)
    kw = dict(temperature=temp, **SMALL_BLOCKS)
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t, **kw), impl, h_s, w_s, 1e-5, 1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,d,e,v,temp", SHAPES)
def test_clipped_log_ratio_fp32(impl, n, d, e, v, temp):
    h_s, w_s, h_t, w_t, y, _ = problem(n, d, e, v, seed=1)
    kw = dict(r_max=0.7, temperature=temp, **SMALL_BLOCKS)
    check_value_and_grad(lambda i: ratio_objective(i, h_t, w_t, y, **kw), impl, h_s, w_s, 1e-5, 1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs_fp32_accumulation(impl):
    # bf16 tolerance 2e-2: the backward rounds g to bf16 before its two GEMMs (as bf16
    # training does) and returns bf16 gradients (8 mantissa bits, eps 2^-8 ~ 4e-3).
    h_s, w_s, h_t, w_t, y, _ = problem(37, 24, 40, 301, dtype=jnp.bfloat16)
    kw = dict(temperature=1.3, **SMALL_BLOCKS)
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t, **kw), impl, h_s, w_s, 1e-4, 2e-2)
    kw = dict(r_max=0.5, **kw)
    check_value_and_grad(lambda i: ratio_objective(i, h_t, w_t, y, **kw), impl, h_s, w_s, 1e-4, 2e-2)
    kl = fused_reverse_kl(h_s, w_s, h_t, w_t, implementation=impl, **SMALL_BLOCKS)
    assert kl.dtype == jnp.float32


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_tokens_give_zero_and_no_gradient(impl):
    h_s, w_s, h_t, w_t, y, mask = problem(37, 24, 40, 301, seed=2)
    # Garbage (huge) hidden states and out-of-range targets on masked rows must not leak.
    h_s = jnp.where(mask[:, None], h_s, 1e4)
    y = jnp.where(mask, y, -5)
    kw = dict(mask_N=mask, **SMALL_BLOCKS)
    kl = fused_reverse_kl(h_s, w_s, h_t, w_t, implementation=impl, **kw)
    kl_ref = fused_reverse_kl(h_s, w_s, h_t, w_t, implementation="reference", **kw)
    assert_close(kl, kl_ref, 1e-5, "masked kl")
    assert np.all(np.asarray(kl)[~np.asarray(mask)] == 0)
    grads = jax.grad(lambda h: jnp.sum(fused_reverse_kl(h, w_s, h_t, w_t, implementation=impl, **kw)))(h_s)
    assert np.all(np.asarray(grads)[~np.asarray(mask)] == 0) and np.all(np.isfinite(grads))
    outs = fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y, r_max=1.0, implementation=impl, **kw)
    outs_ref = fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y, r_max=1.0, implementation="reference", **kw)
    for a, b in zip(outs, outs_ref):
        assert_close(a, b, 1e-5, "masked log-ratio")


@pytest.mark.parametrize("impl", ["xla"])  # the custom_vjp is shared by every backend
def test_teacher_and_ratio_get_no_gradient(impl):
    h_s, w_s, h_t, w_t, y, _ = problem(9, 8, 12, 70)
    kw = dict(implementation=impl, **SMALL_BLOCKS)
    g_t = jax.grad(lambda ht, wt: jnp.sum(fused_reverse_kl(h_s, w_s, ht, wt, **kw)), (0, 1))(h_t, w_t)
    assert all(not np.any(np.asarray(g)) for g in g_t)
    # Only logp_s carries gradient: d/dh_s of sum(r) and of sum(logp_t) vanish.
    for pick in (1, 2):
        g = jax.grad(lambda h: jnp.sum(fused_clipped_log_ratio(h, w_s, h_t, w_t, y, r_max=9.0, **kw)[pick]))(h_s)
        assert not np.any(np.asarray(g))


def test_kl_zero_for_identical_models_and_ratio_is_clipped():
    h, w, _, _, y, _ = problem(11, 8, 8, 50, scale=2.0)
    kl = fused_reverse_kl(h, w, h, w, implementation="xla", **SMALL_BLOCKS)
    np.testing.assert_allclose(kl, 0.0, atol=1e-5)
    h_t = h * -1.0  # a very different teacher: |logp_t - logp_s| exceeds r_max somewhere
    lp_s, lp_t, r = fused_clipped_log_ratio(h, w, h_t, w, y, r_max=0.25, implementation="xla", **SMALL_BLOCKS)
    np.testing.assert_allclose(r, np.clip(lp_t - lp_s, -0.25, 0.25), atol=1e-6)
    assert float(jnp.max(jnp.abs(lp_t - lp_s))) > 0.25


def test_real_vocab_151936_xla():
    """151,936 = 128 x 1187: the real ragged case for the default xla chunk (8192).

    Tolerance 1e-4 (complex): each lse is a 151,936-term fp32 reduction, summed in a
    different order than the reference's.
    """
    h_s, w_s, h_t, w_t, y, _ = problem(4, 8, 6, 151_936, scale=0.5)
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t), "xla", h_s, w_s, 1e-4, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_real_vocab_151936_large_blocks(impl):
    h_s, w_s, h_t, w_t, y, _ = problem(70, 64, 32, 151_936, scale=0.3)
    kw = dict(block_n=64, block_v=128, block_d=32, chunk_v=16384, temperature=0.9)
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t, **kw), impl, h_s, w_s, 1e-4, 1e-4)
    check_value_and_grad(lambda i: ratio_objective(i, h_t, w_t, y, r_max=2.0, **kw), impl, h_s, w_s, 1e-4, 1e-4)


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=0.0), "temperature"),
    (dict(implementation="cuda"), "implementation"),
    (dict(block_v=0), "block_v"),
])
def test_bad_config_raises(bad, match):
    h_s, w_s, h_t, w_t, _, _ = problem(4, 8, 8, 20)
    with pytest.raises(ValueError, match=match):
        fused_reverse_kl(h_s, w_s, h_t, w_t, **bad)


def test_bad_shapes_raise():
    h_s, w_s, h_t, w_t, y, _ = problem(4, 8, 6, 20)
    with pytest.raises(ValueError, match="teacher vocab 21 != student vocab 20"):
        fused_reverse_kl(h_s, w_s, h_t, jnp.zeros((6, 21)))
    with pytest.raises(ValueError, match=r"expected \[D=8, V\]"):
        fused_reverse_kl(h_s, w_s.T, h_t, w_t)
    with pytest.raises(ValueError, match="targets"):
        fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y.astype(jnp.float32), r_max=1.0)
    with pytest.raises(ValueError, match="r_max"):
        fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y, r_max=-1.0)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_weighted_loss_matches_reference(impl):
    """fused_reverse_kl_loss: xla takes the one-pass path, triton weights the per-token op."""
    from pallas_kernels import fused_reverse_kl_loss
    h_s, w_s, h_t, w_t, _, mask = problem(37, 24, 40, 301, seed=5)
    weights = mask / jnp.sum(mask)

    def make(i):
        if i == "reference":
            return lambda h, w: jnp.sum(weights * fused_reverse_kl(h, w, h_t, w_t, implementation=i, temperature=1.5))
        return lambda h, w: fused_reverse_kl_loss(h, w, h_t, w_t, weights, implementation=i, temperature=1.5,
                                                  block_n=16)
    check_value_and_grad(make, impl, h_s, w_s, 1e-5, 1e-4)


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_vocab_splits(splits):
    """The Triton forward splits V over programs; 3 splits of 10 tiles leave a clamped, masked tail."""
    h_s, w_s, h_t, w_t, y, _ = problem(37, 24, 40, 301, seed=6)
    kw = dict(temperature=1.2, vocab_splits=splits, **SMALL_BLOCKS)
    check_value_and_grad(lambda i: ratio_objective(i, h_t, w_t, y, r_max=0.7, **kw), "triton", h_s, w_s, 1e-5, 1e-4)
    kl = fused_reverse_kl(h_s, w_s, h_t, w_t, implementation="triton", **kw)
    kl_ref = fused_reverse_kl(h_s, w_s, h_t, w_t, implementation="reference", temperature=1.2)
    assert_close(kl, kl_ref, 1e-5, "split kl")
