"""Hidden-state OPD losses equal the logits-based ones (values, metrics and gradients).

Legend: K teachers, B batch, T tokens, D student hidden, E teacher hidden, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.losses import glm_opd_loss, kimi_mopd_loss, reverse_kl_loss, token_logprobs
from opd_jax.losses.hidden import (glm_opd_loss_from_hidden, kimi_mopd_loss_from_hidden,
                                   reverse_kl_loss_from_hidden, sampled_token_logprobs_from_hidden)

B, T, D, E, V = 2, 7, 12, 20, 97
KW = dict(implementation="xla", block_n=8, block_v=32, chunk_v=40)


def _setup(k=None, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    h_s = jax.random.normal(ks[0], (B, T, D))
    w_s = jax.random.normal(ks[1], (D, V)) * 0.5
    lead = () if k is None else (k,)
    h_t = jax.random.normal(ks[2], lead + (B, T, E))
    w_t = jax.random.normal(ks[3], lead + (E, V)) * 0.5
    y = jax.random.randint(ks[4], (B, T), 0, V)
    mask = jax.random.bernoulli(ks[5], 0.75, (B, T)).at[:, 0].set(True)
    return h_s, w_s, h_t, w_t, y, mask


def _check(f_hidden, f_logits, h_s, w_s, metric_names):
    (l0, m0), g0 = jax.value_and_grad(f_logits, (0, 1), has_aux=True)(h_s, w_s)
    (l1, m1), g1 = jax.jit(jax.value_and_grad(f_hidden, (0, 1), has_aux=True))(h_s, w_s)
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
    for name in metric_names:
        np.testing.assert_allclose(m1[name], m0[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_reverse_kl_single_teacher(aggregation):
    h_s, w_s, h_t, w_t, _, mask = _setup()
    f_l = lambda h, w: reverse_kl_loss(h @ w, h_t @ w_t, mask, temperature=1.7, aggregation=aggregation)
    f_h = lambda h, w: reverse_kl_loss_from_hidden(h, w, h_t, w_t, mask, temperature=1.7, aggregation=aggregation,
                                                   **KW)
    _check(f_h, f_l, h_s, w_s, ["loss", "reverse_kl"])


@pytest.mark.parametrize("weights", [np.array([0.7, 0.3]), np.array([[0.2, 0.8], [0.6, 0.4]])])
def test_reverse_kl_stacked_teachers(weights):
    h_s, w_s, h_t, w_t, _, mask = _setup(k=2, seed=1)
    t_logits = jnp.einsum("kbte,kev->kbtv", h_t, w_t)
    f_l = lambda h, w: reverse_kl_loss(h @ w, t_logits, mask, weights=weights)
    f_h = lambda h, w: reverse_kl_loss_from_hidden(h, w, h_t, w_t, mask, weights=weights, **KW)
    _check(f_h, f_l, h_s, w_s, ["loss", "reverse_kl", "reverse_kl_teacher0", "reverse_kl_teacher1"])


def _per_token_weights(k, seed=3, zero_teacher_on_row=None):
    """Confidence-like weights [B, T, K]: positive, summing to 1 per token; optionally 0 for
    teacher `zero_teacher_on_row` = (k, b) on one row (the routed form skips those tokens)."""
    w = np.random.default_rng(seed).dirichlet(np.ones(k), size=(B, T)).astype(np.float32)
    if zero_teacher_on_row is not None:
        kk, b = zero_teacher_on_row
        w[b, :, kk] = 0.0
        w[b] /= w[b].sum(-1, keepdims=True)
    return jnp.asarray(w)


def test_reverse_kl_per_token_weights_stacked_and_routed():
    """Per-token weights [B, T, K] (confidence weighting): the stacked and the routed
    (sequence) hidden forms equal the logits form, values, metrics and gradients."""
    h_s, w_s, h_t, w_t, _, mask = _setup(k=3, seed=2)
    t_logits = jnp.einsum("kbte,kev->kbtv", h_t, w_t)
    w = _per_token_weights(3)
    f_l = lambda h, ws: reverse_kl_loss(h @ ws, t_logits, mask, weights=w)
    f_h = lambda h, ws: reverse_kl_loss_from_hidden(h, ws, h_t, w_t, mask, weights=w, **KW)
    _check(f_h, f_l, h_s, w_s, ["loss", "reverse_kl", "reverse_kl_teacher0"])
    w = _per_token_weights(3, zero_teacher_on_row=(1, 0))
    f_l = lambda h, ws: reverse_kl_loss(h @ ws, t_logits, mask, weights=w)
    f_r = lambda h, ws: reverse_kl_loss_from_hidden(h, ws, tuple(h_t), tuple(w_t), mask,
                                                    weights=w, **KW)
    _check(f_r, f_l, h_s, w_s, ["loss", "reverse_kl"])
    with pytest.raises(ValueError, match=r"\[B, T, K\] = \(2, 7, 3\)"):
        reverse_kl_loss_from_hidden(h_s, w_s, h_t, w_t, mask, weights=w[:, :3], **KW)


def test_kimi_mopd_matches_logits():
    h_s, w_s, h_t, w_t, y, mask = _setup(seed=2)

    def f_l(h, w):
        lp, lp_t = token_logprobs(h @ w, y, 0.9), token_logprobs(h_t @ w_t, y, 0.9)
        return kimi_mopd_loss(lp, lp_t, mask, r_max=0.5)
    f_h = lambda h, w: kimi_mopd_loss_from_hidden(h, w, h_t, w_t, y, mask, r_max=0.5, temperature=0.9,
                                                  implementation="xla", kernel_kw=dict(block_v=32, chunk_v=40))
    _check(f_h, f_l, h_s, w_s, ["loss", "r_mean", "r_clip_frac", "reverse_kl_est"])


def test_glm_opd_matches_logits():
    h_s, w_s, h_t, w_t, y, mask = _setup(seed=3)
    old = jax.lax.stop_gradient(token_logprobs(h_s @ w_s, y)) + 0.05

    def f_l(h, w):
        return glm_opd_loss(token_logprobs(h @ w, y), old, token_logprobs(h_t @ w_t, y), mask, eps_high=0.28)
    f_h = lambda h, w: glm_opd_loss_from_hidden(h, w, h_t, w_t, y, old, mask, eps_high=0.28, implementation="xla")
    _check(f_h, f_l, h_s, w_s, ["loss", "opd_adv_mean"])


def test_sampled_token_logprobs_shapes_and_mask():
    h_s, w_s, h_t, w_t, y, mask = _setup(seed=4)
    lp, lp_t, r = sampled_token_logprobs_from_hidden(h_s, w_s, h_t, w_t, y, mask, r_max=0.3, **KW)
    assert lp.shape == lp_t.shape == r.shape == (B, T)
    np.testing.assert_allclose(np.where(mask, token_logprobs(h_s @ w_s, y), 0.0), lp, atol=1e-5)
    assert float(jnp.max(jnp.abs(r))) <= 0.3 + 1e-7


def test_bad_inputs_raise():
    h_s, w_s, h_t, w_t, y, mask = _setup()
    with pytest.raises(ValueError, match="weights are for stacked"):
        reverse_kl_loss_from_hidden(h_s, w_s, h_t, w_t, mask, weights=jnp.ones(1))
    with pytest.raises(ValueError, match="h_t has"):
        reverse_kl_loss_from_hidden(h_s, w_s, h_t[:, :3], w_t, mask)
