"""Full-vocabulary reverse/forward KL and generalized JSD: numpy parity with teacher
mixtures, invariants, analytic and fp64 finite-difference gradients, bf16, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from tests.losses import losses_numpy_ref as ref
from opd_jax.losses import (forward_kl, forward_kl_loss, generalized_jsd, generalized_jsd_loss,
                            log_softmax, reverse_kl, reverse_kl_loss)

B, T, V, K = 2, 3, 7, 3
LOSSES = {"reverse": reverse_kl_loss, "forward": forward_kl_loss, "jsd": generalized_jsd_loss}
PER_TOKEN = {"reverse": reverse_kl, "forward": forward_kl, "jsd": generalized_jsd}
METRIC = {"reverse": "reverse_kl", "forward": "forward_kl", "jsd": "jsd"}


def make_inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    s = rng.normal(0, 2, (B, T, V)).astype(dtype)
    t = rng.normal(0, 2, (K, B, T, V)).astype(dtype)
    m = np.array([[1, 1, 0], [1, 0, 1]], dtype)
    w_K = rng.dirichlet(np.ones(K)).astype(dtype)
    w_BxK = rng.dirichlet(np.ones(K), size=B).astype(dtype)
    return s, t, m, w_K, w_BxK


@pytest.mark.parametrize("kind", ["reverse", "forward", "jsd"])
@pytest.mark.parametrize("teachers", ["single", "uniform", "w_K", "w_BxK", "w_BxTxK"])
def test_divergences_match_numpy(kind, teachers):
    s, t, m, w_K, w_BxK = make_inputs(0)
    teacher = t[0] if teachers == "single" else t
    w_BxTxK = np.random.default_rng(1).dirichlet(np.ones(K), size=(B, T)).astype(np.float32)
    w = {"w_K": w_K, "w_BxK": w_BxK, "w_BxTxK": w_BxTxK}.get(teachers)
    for tau in (1.0, 0.7):
        kw = dict(beta=0.3) if kind == "jsd" else {}
        loss, mt = LOSSES[kind](jnp.asarray(s), jnp.asarray(teacher), jnp.asarray(m),
                                weights=None if w is None else jnp.asarray(w), temperature=tau,
                                **kw)
        want = ref.divergence(kind, s, teacher, m, w, tau, beta=0.3)
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mt[METRIC[kind]], want, rtol=1e-5, atol=1e-6)
        valid = m > 0
        np.testing.assert_allclose(mt["entropy"], ref.entropy(s, tau)[valid].mean(), rtol=1e-5)
        assert loss.dtype == jnp.float32
        assert all(v.dtype == jnp.float32 and v.shape == () for v in mt.values())
        if teachers != "single":
            for k in range(K):
                per_k = ref.divergence(kind, s, t[k], m, None, tau, beta=0.3)
                np.testing.assert_allclose(mt[f"{METRIC[kind]}_teacher{k}"], per_k, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.1, 3.0, 20.0]),
       kind=st.sampled_from(["reverse", "forward", "jsd"]))
@example(seed=0, scale=20.0, kind="reverse")   # once gave -1.8e-15 before the clamp
def test_divergence_nonnegative_and_zero_iff_equal(seed, scale, kind):
    s, t, m, _, _ = make_inputs(seed)
    s, t = jnp.asarray(s * scale), jnp.asarray(t[0] * scale)
    m = jnp.asarray(m)
    fn = LOSSES[kind]
    # Each position separately (no cancellation in a mean): never negative, and strictly
    # positive wherever the two distributions differ beyond fp32 rounding (Pinsker:
    # KL >= TV^2 / 2). Peaked logits (scale 20) can make them equal to rounding.
    per_token = np.asarray(PER_TOKEN[kind](log_softmax(s), log_softmax(t)))
    assert per_token.shape == (B, T) and np.all(per_token >= 0)
    differ = np.abs(np.exp(np.asarray(log_softmax(s))) - np.exp(np.asarray(log_softmax(t)))
                    ).max(-1) > 1e-3
    assert np.all(per_token[differ] > 0)
    # Equal distributions (logits up to a shift) give exactly zero divergence.
    assert abs(float(fn(s, s + 3.0, m)[0])) < 1e-5
    # KL(p || p) is exactly 0; the JSD's mixture log m = logaddexp(...) rounds in fp32.
    assert abs(float(fn(s, s, m)[0])) <= (0.0 if kind != "jsd" else 1e-7)


def test_reverse_kl_gradient_is_analytic():
    """dKL/ds_v = p_v (log p_v - log q_v - KL), divided by the number of valid tokens."""
    s, t, m, _, w_BxK = make_inputs(1)
    g = jax.grad(lambda x: reverse_kl_loss(x, jnp.asarray(t), jnp.asarray(m),
                                           weights=jnp.asarray(w_BxK))[0])(jnp.asarray(s))
    logp = ref.log_softmax(s)
    want = np.zeros_like(logp)
    for k in range(K):
        logq = ref.log_softmax(t[k])
        kl = (np.exp(logp) * (logp - logq)).sum(-1, keepdims=True)
        want += w_BxK[:, k, None, None] * np.exp(logp) * (logp - logq - kl)
    want *= m[..., None] / m.sum()
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    g_fwd = jax.grad(lambda x: forward_kl_loss(x, jnp.asarray(t[0]), jnp.asarray(m))[0])(
        jnp.asarray(s))
    want_fwd = (np.exp(logp) - np.exp(ref.log_softmax(t[0]))) * m[..., None] / m.sum()
    np.testing.assert_allclose(g_fwd, want_fwd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["reverse", "jsd"])
def test_gradient_matches_finite_differences_fp64(kind):
    with jax.enable_x64(True):
        s, t, m, _, w_BxK = make_inputs(2, np.float64)
        kw = dict(beta=0.3) if kind == "jsd" else {}
        f = jax.jit(lambda x: LOSSES[kind](x, jnp.asarray(t), jnp.asarray(m),
                                           weights=jnp.asarray(w_BxK), temperature=0.8, **kw)[0])
        s0 = jnp.asarray(s)
        g = np.asarray(jax.grad(f)(s0))
        h, fd = 1e-6, np.zeros(s.shape)
        for idx in np.ndindex(s.shape):
            e = jnp.zeros(s.shape).at[idx].set(h)
            fd[idx] = (f(s0 + e) - f(s0 - e)) / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
        assert np.all(g[m == 0] == 0) and np.abs(g).max() > 1e-3


def test_teacher_gets_no_gradient():
    s, t, m, w_K, _ = make_inputs(3)
    gt = jax.grad(lambda x: reverse_kl_loss(jnp.asarray(s), x, jnp.asarray(m),
                                            weights=jnp.asarray(w_K))[0])(jnp.asarray(t))
    assert np.all(np.asarray(gt) == 0)


def test_temperature_scaling():
    s, t, m, w_K, _ = make_inputs(4)
    s, t, m, w = map(jnp.asarray, (s, t, m, w_K))
    a = reverse_kl_loss(s, t, m, weights=w, temperature=2.5)[0]
    np.testing.assert_allclose(a, reverse_kl_loss(s / 2.5, t / 2.5, m, weights=w)[0], rtol=1e-6)


def test_bf16_logits_give_fp32_loss():
    """bf16 inputs are upcast before the softmax: equal to fp32 math on the rounded logits
    (1e-6), and within 2e-2 of the unrounded fp32 loss, since bf16 rounds logits of
    magnitude <= 8 by up to 2^-9 * 8 = 0.016 each (KL moves by at most ~2x that)."""
    s, t, m, w_K, _ = make_inputs(5)
    s16, t16 = jnp.asarray(s, jnp.bfloat16), jnp.asarray(t, jnp.bfloat16)
    loss16, mt = reverse_kl_loss(s16, t16, jnp.asarray(m), weights=jnp.asarray(w_K))
    assert loss16.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in mt.values())
    rounded = reverse_kl_loss(s16.astype(jnp.float32), t16.astype(jnp.float32), jnp.asarray(m),
                              weights=jnp.asarray(w_K))[0]
    np.testing.assert_allclose(loss16, rounded, rtol=1e-6)
    exact = reverse_kl_loss(jnp.asarray(s), jnp.asarray(t), jnp.asarray(m),
                            weights=jnp.asarray(w_K))[0]
    np.testing.assert_allclose(loss16, exact, atol=2e-2)


def test_masked_tokens_change_nothing_and_masked_vocab_is_finite():
    s, t, m, w_K, _ = make_inputs(6)
    dirty_s = np.where(m[..., None] > 0, s, 1e4).astype(np.float32)
    dirty_t = np.where(m[None, ..., None] > 0, t, -1e4).astype(np.float32)
    f = lambda x, tt: reverse_kl_loss(x, jnp.asarray(tt), jnp.asarray(m),
                                      weights=jnp.asarray(w_K))
    (l0, m0), g0 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(s), t)
    (l1, m1), g1 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(dirty_s), dirty_t)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    np.testing.assert_allclose(g0, g1, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(m0["reverse_kl"], m1["reverse_kl"], rtol=1e-6)
    # A vocab entry both models rule out (-inf, e.g. padding) contributes 0, not NaN.
    s_pad = jnp.asarray(s).at[..., -1].set(-jnp.inf)
    t_pad = jnp.asarray(t[0]).at[..., -1].set(-jnp.inf)
    for fn in LOSSES.values():
        val, g = jax.value_and_grad(lambda x: fn(x, t_pad, jnp.asarray(m))[0])(s_pad)
        want = fn(jnp.asarray(s[..., :-1]), jnp.asarray(t[0, ..., :-1]), jnp.asarray(m))[0]
        np.testing.assert_allclose(val, want, rtol=1e-5)
        assert np.all(np.isfinite(np.asarray(g)))


def test_jsd_limits_are_the_two_kls():
    s, t, m, _, _ = make_inputs(7)
    s, t, m = jnp.asarray(s, jnp.float32), jnp.asarray(t[0]), jnp.asarray(m)
    rev, fwd = reverse_kl_loss(s, t, m)[0], forward_kl_loss(s, t, m)[0]
    b = 1e-3
    np.testing.assert_allclose(generalized_jsd_loss(s, t, m, beta=b)[0] / b, rev, rtol=2e-2)
    np.testing.assert_allclose(generalized_jsd_loss(s, t, m, beta=1 - b)[0] / b, fwd, rtol=2e-2)
    # Symmetric at b = 1/2.
    np.testing.assert_allclose(generalized_jsd_loss(s, t, m)[0], generalized_jsd_loss(t, s, m)[0],
                               rtol=1e-5)


def test_jit_vmap_grad():
    s, t, m, w_K, w_BxK = make_inputs(8)
    s, t, m, w_K, w_BxK = map(jnp.asarray, (s, t, m, w_K, w_BxK))
    eager = reverse_kl_loss(s, t, m, weights=w_BxK)[0]
    # Traced weights (a jit argument) are not value-checked, only shape-checked.
    jitted = jax.jit(lambda a, b, c, w: reverse_kl_loss(a, b, c, weights=w)[0])(s, t, m, w_BxK)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    batched = jax.vmap(lambda a: reverse_kl_loss(a, t, m, weights=w_K)[0])(jnp.stack([s, s + 1]))
    np.testing.assert_allclose(batched, [reverse_kl_loss(s, t, m, weights=w_K)[0]] * 2, rtol=1e-5)
    g = jax.jit(jax.grad(lambda a: forward_kl_loss(a, t, m)[0]))(s)
    assert g.shape == s.shape and np.all(np.isfinite(g))


@pytest.mark.parametrize("kw,msg", [
    (dict(t=jnp.zeros((B, T, V + 1))), f"teacher vocab {V + 1} != student vocab {V}"),
    (dict(t=jnp.zeros((K, B, T + 1, V))), r"teacher_logits has \[B, T\]"),
    (dict(t=jnp.zeros((B, T))), "teacher_logits has shape"),
    (dict(m=jnp.ones((B, T + 1))), "mask_BxT has shape"),
    (dict(w=jnp.array([0.5, 0.5])), r"weights has shape \(2,\)"),
    (dict(w=jnp.array([0.5, 0.3, 0.1])), "sum to 1 over the K=3 teachers, got a sum of 0.9"),
    (dict(w=jnp.array([1.5, -0.5, 0.0])), "non-negative"),
    (dict(w=jnp.array([[1.0, 0.0, 0.0], [0.5, 0.6, 0.0]])), "got a sum of 1.1"),
    (dict(w=jnp.array([1.0]), t=jnp.zeros((B, T, V))), "weights are for stacked"),
    (dict(temperature=0.0), "temperature=0"),
])
def test_bad_input_raises_at_trace_time(kw, msg):
    t, m, w = kw.pop("t", jnp.zeros((K, B, T, V))), kw.pop("m", jnp.ones((B, T))), kw.pop("w", None)
    # Everything but the student is closed over, so concrete weights are checked by value.
    f = jax.jit(lambda s: reverse_kl_loss(s, t, m, weights=w, **kw))
    with pytest.raises(ValueError, match=msg):
        f(jnp.zeros((B, T, V)))


def test_jsd_beta_range():
    z = jnp.zeros((B, T, V))
    for beta in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=f"beta={beta:g}"):
            generalized_jsd_loss(z, z, jnp.ones((B, T)), beta=beta)
