"""Sampled-token OPD (Kimi MOPD, GLM cross-stage): numpy parity, exact clipping, fp64
finite differences, unbiasedness against the full-vocabulary reverse KL, masking, errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.losses import losses_numpy_ref as ref
from tests.losses.test_losses_grpo import with_correction
from opd_jax.losses import (clipped_log_ratio, glm_opd_loss, kimi_mopd_loss, reverse_kl_loss,
                            token_logprobs)

B, T = 4, 6


def make_inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    lp = -rng.gamma(1.0, 1.0, (B, T))
    old = lp + rng.normal(0, 0.3, (B, T))
    d = dict(lp=lp, old=old, teacher=lp + rng.normal(0, 1.5, (B, T)),
             sampler=old + rng.normal(0, 0.8, (B, T)), task_B=rng.normal(size=B),
             task_BxT=rng.normal(size=(B, T)))
    d = {k: v.astype(dtype) for k, v in d.items()}
    m = (rng.random((B, T)) < 0.75).astype(dtype)
    m[:, 0] = 1
    d["m"] = m
    return d


def kimi(x, *, use_old=False, use_sampler=False, **kw):
    j = {k: jnp.asarray(v) for k, v in x.items()}
    return kimi_mopd_loss(j["lp"], j["teacher"], j["m"], old_logp_BxT=j["old"] if use_old else None,
                          sampler_logp_BxT=j["sampler"] if use_sampler else None,
                          **with_correction(kw))


def glm(x, *, task=None, **kw):
    j = {k: jnp.asarray(v) for k, v in x.items()}
    return glm_opd_loss(j["lp"], j["old"], j["teacher"], j["m"],
                        task_adv=None if task is None else j[task], **with_correction(kw))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), use_old=st.booleans(),
       correction=st.sampled_from([None, "icepop", "tis"]),
       mode=st.sampled_from(["token_mean", "seq_mean"]),
       normalizer=st.sampled_from(["all", "kept"]),
       r_max=st.sampled_from([0.5, 2.0, 1e3]), gamma=st.sampled_from([0.0, 0.5, 2.0]))
def test_kimi_matches_numpy(seed, use_old, correction, mode, normalizer, r_max, gamma):
    x = make_inputs(seed)
    loss, mt = kimi(x, r_max=r_max, use_old=use_old, use_sampler=correction is not None,
                    correction=correction, aggregation=mode, icepop_normalizer=normalizer,
                    eps_high=0.28, position_gamma=gamma)
    x64 = {k: v.astype(np.float64) for k, v in x.items()}
    want = ref.kimi(x64["lp"], x64["teacher"], x64["m"], r_max, old=x64["old"] if use_old else None,
                    eps_high=0.28, sampler=x64["sampler"], correction=correction,
                    normalizer=normalizer, mode=mode, gamma=gamma)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    base = x64["old"] if use_old else x64["lp"]
    d, valid = x64["teacher"] - base, x64["m"] > 0
    np.testing.assert_allclose(mt["r_abs_mean"], np.abs(np.clip(d, -r_max, r_max))[valid].mean(),
                               rtol=1e-5)
    np.testing.assert_allclose(mt["r_clip_frac"], (np.abs(d) > r_max)[valid].mean(), rtol=1e-6)
    np.testing.assert_allclose(mt["reverse_kl_est"], -d[valid].mean(), rtol=1e-5, atol=1e-6)
    assert ("ratio_mean" in mt) == use_old
    assert all(v.dtype == jnp.float32 and v.shape == () for v in mt.values())


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), task=st.sampled_from([None, "task_B", "task_BxT"]),
       kl_coef=st.sampled_from([1.0, 0.3]), mode=st.sampled_from(["token_mean", "max_len"]),
       gamma=st.sampled_from([0.0, 0.5]))
def test_glm_matches_numpy(seed, task, kl_coef, mode, gamma):
    x = make_inputs(seed)
    loss, mt = glm(x, task=task, kl_coef=kl_coef, aggregation=mode, eps_high=0.28,
                   position_gamma=gamma)
    x64 = {k: v.astype(np.float64) for k, v in x.items()}
    want = ref.glm(x64["lp"], x64["old"], x64["teacher"], x64["m"], eps_high=0.28,
                   task_adv=None if task is None else x64[task], kl_coef=kl_coef, mode=mode,
                   gamma=gamma)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    valid = x64["m"] > 0
    np.testing.assert_allclose(mt["opd_adv_mean"], (x64["teacher"] - x64["old"])[valid].mean(),
                               rtol=1e-5, atol=1e-6)


def test_r_is_exactly_clipped():
    x = make_inputs(1)
    r = clipped_log_ratio(jnp.asarray(x["teacher"]), jnp.asarray(x["lp"]), 0.7)
    np.testing.assert_array_equal(r, np.clip(x["teacher"] - x["lp"], -0.7, 0.7))
    assert float(jnp.max(jnp.abs(r))) == np.float32(0.7)  # both bounds are hit exactly
    assert np.any(np.asarray(r) == -np.float32(0.7)) and np.any(np.asarray(r) == np.float32(0.7))
    # The policy-gradient form's gradient is exactly -r m / sum(m).
    g = jax.grad(lambda lp: kimi({**x, "lp": lp}, r_max=0.7)[0])(jnp.asarray(x["lp"]))
    np.testing.assert_allclose(g, -np.asarray(r) * x["m"] / x["m"].sum(), rtol=1e-6, atol=1e-7)
    # No gradient reaches the teacher.
    gt = jax.grad(lambda t: kimi({**x, "teacher": t}, r_max=0.7)[0])(jnp.asarray(x["teacher"]))
    assert np.all(np.asarray(gt) == 0)


def test_position_weights_fall_over_the_loss_tokens_of_each_row():
    """1 + gamma at a row's first loss token, down by gamma / n per loss token; masked
    positions (tool output, padding) are skipped by the count and get weight 1."""
    from opd_jax.losses.policy import position_weights
    m = jnp.asarray([[1, 1, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0]], jnp.float32)
    w = np.asarray(position_weights(m, 0.5))
    np.testing.assert_allclose(w[0], [1.5, 1.375, 1.25, 1.125, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(w[1], [1, 1.5, 1, 1 + 0.5 * 2 / 3, 1 + 0.5 / 3, 1], rtol=1e-6)
    np.testing.assert_array_equal(position_weights(m, 0.0), np.ones((2, 6)))
    # The policy-gradient form's gradient is exactly -r w m / sum(m).
    x = make_inputs(3)
    g = jax.grad(lambda lp: kimi({**x, "lp": lp}, r_max=0.7, position_gamma=0.5)[0])(
        jnp.asarray(x["lp"]))
    r = np.clip(x["teacher"] - x["lp"], -0.7, 0.7)
    wx = ref.position_weight(x["m"], 0.5)
    np.testing.assert_allclose(g, -r * wx * x["m"] / x["m"].sum(), rtol=1e-5, atol=1e-7)


def test_kimi_forms_agree_on_fresh_batch():
    """With old = sg(lp) the PPO form has rho = 1: same gradient as the policy-gradient form."""
    x = make_inputs(4)
    pg = lambda lp: kimi({**x, "lp": lp}, r_max=2.0)[0]
    ppo = lambda lp: kimi_mopd_loss(lp, jnp.asarray(x["teacher"]), jnp.asarray(x["m"]), r_max=2.0,
                                    old_logp_BxT=jax.lax.stop_gradient(lp))[0]
    lp = jnp.asarray(x["lp"])
    np.testing.assert_allclose(jax.grad(pg)(lp), jax.grad(ppo)(lp), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("which,kw", [
    ("kimi", dict(r_max=1.0)),
    ("kimi", dict(r_max=1.0, use_old=True, use_sampler=True, correction="icepop")),
    ("glm", dict(task="task_B", kl_coef=0.5, eps_high=0.28)),
])
def test_gradient_matches_finite_differences_fp64(which, kw):
    """d loss / d lp_theta with the stop-gradient quantities (r, A) held fixed.

    Without old_logp, Kimi's r = sg(lp_T - lp_theta) itself moves with lp_theta; the
    surrogate's gradient treats it as a constant, so the finite difference moves the
    teacher along with the student to keep r fixed.
    """
    with jax.enable_x64(True):
        x = make_inputs(13, np.float64)
        loss = kimi if which == "kimi" else glm
        delta = x["teacher"] - x["lp"]
        r_tracks_lp = which == "kimi" and not kw.get("use_old")
        f = jax.jit(lambda lp: loss({**x, "lp": lp, **({"teacher": lp + delta} if r_tracks_lp
                                                        else {})}, **kw)[0])
        lp0 = jnp.asarray(x["lp"])
        g = np.asarray(jax.grad(f)(lp0))
        h, fd = 1e-6, np.zeros((B, T))
        for i in range(B):
            for j in range(T):
                e = jnp.zeros((B, T)).at[i, j].set(h)
                fd[i, j] = (f(lp0 + e) - f(lp0 - e)) / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
        assert np.abs(g).max() > 1e-3


def test_sampled_token_gradient_is_unbiased_for_reverse_kl():
    """Average the sampled-token OPD gradient over N tokens drawn from the student at one
    state; it must approach grad_s KL(p || q) computed over the full vocabulary.

    Tolerance: 5 standard errors per vocab entry, sd_v / sqrt(N) with sd_v the empirical
    std of the per-sample gradients (a 5-sigma band: false alarms ~1e-6 per entry at a fixed
    seed). The forward-KL gradient lies far outside the band, so the test has power.
    """
    v, n = 6, 200_000
    rng = np.random.default_rng(0)
    s_V = jnp.asarray(rng.normal(size=v), jnp.float32)
    t_V = jnp.asarray(rng.normal(size=v) * 1.5, jnp.float32)
    p = np.asarray(jax.nn.softmax(s_V), np.float64)
    y_1xN = jnp.asarray(rng.choice(v, size=(1, n), p=p / p.sum()))
    ones = jnp.ones((1, n))

    @jax.jit
    def student_lp(s):
        return token_logprobs(jnp.broadcast_to(s, (1, n, v)), y_1xN)

    teacher_lp = student_lp(t_V)

    kimi_g = jax.jit(jax.grad(
        lambda s: kimi_mopd_loss(student_lp(s), teacher_lp, ones, r_max=1e3)[0]))(s_V)
    glm_g = jax.jit(jax.grad(lambda s: glm_opd_loss(
        student_lp(s), jax.lax.stop_gradient(student_lp(s)), teacher_lp, ones)[0]))(s_V)
    exact = jax.jit(jax.grad(lambda s: reverse_kl_loss(s[None, None], t_V[None, None],
                                                       jnp.ones((1, 1)))[0]))(s_V)
    r = np.asarray(teacher_lp - student_lp(s_V), np.float64)[0]
    per_sample = -r[:, None] * (np.eye(v)[np.asarray(y_1xN[0])] - p)  # [N, V]
    tol = 5 * per_sample.std(0) / np.sqrt(n)
    for g in (kimi_g, glm_g):
        assert np.all(np.abs(np.asarray(g) - np.asarray(exact)) <= tol), (g, exact, tol)
    forward = jax.jit(jax.grad(lambda s: -(jax.nn.softmax(t_V) * jax.nn.log_softmax(s)).sum()))(s_V)
    assert np.any(np.abs(np.asarray(forward) - np.asarray(exact)) > 10 * tol)


def test_masked_tokens_change_nothing():
    x = make_inputs(9)
    m = x["m"] > 0
    dirty = dict(x, lp=np.where(m, x["lp"], -np.inf), old=np.where(m, x["old"], np.nan),
                 teacher=np.where(m, x["teacher"], -np.inf),
                 sampler=np.where(m, x["sampler"], np.inf),
                 task_BxT=np.where(m, x["task_BxT"], np.nan))
    cases = [(kimi, dict(r_max=2.0, use_sampler=True, correction="icepop")),
             (kimi, dict(r_max=2.0, use_old=True)),
             (glm, dict(task="task_BxT"))]
    for loss, kw in cases:
        f = lambda lp, d: loss({**d, "lp": lp}, **kw)
        (l0, m0), g0 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(x["lp"]), x)
        (l1, m1), g1 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(dirty["lp"]), dirty)
        np.testing.assert_array_equal(l0, l1)
        np.testing.assert_array_equal(g0, g1)
        for k in m0:
            np.testing.assert_array_equal(m0[k], m1[k], err_msg=k)


def test_jit_and_vmap():
    x = make_inputs(2)
    lp, t, m, old = (jnp.asarray(x[k]) for k in ("lp", "teacher", "m", "old"))
    k_fn = functools.partial(kimi_mopd_loss, r_max=1.5)
    np.testing.assert_allclose(jax.jit(k_fn)(lp, t, m)[0], k_fn(lp, t, m)[0], rtol=1e-6)
    batched = jax.vmap(lambda a, b, c: k_fn(a, b, c)[0])(*(jnp.stack([v, v]) for v in (lp, t, m)))
    np.testing.assert_allclose(batched, [k_fn(lp, t, m)[0]] * 2, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(glm_opd_loss)(lp, old, t, m)[0],
                               glm_opd_loss(lp, old, t, m)[0], rtol=1e-6)


@pytest.mark.parametrize("fn,kw,msg", [
    ("kimi", dict(r_max=-1.0), "r_max=-1"),
    ("kimi", dict(r_max=0.0), "r_max=0"),
    ("kimi", dict(r_max=1.0, teacher=jnp.zeros((B, T + 1))), "teacher_logp_BxT has shape"),
    ("kimi", dict(r_max=1.0, correction="tis"), "needs sampler_logp_BxT"),
    ("kimi", dict(r_max=1.0, position_gamma=-0.5), "position_gamma=-0.5"),
    ("glm", dict(task_adv=jnp.zeros((B, 2))), "task_adv has shape"),
    ("glm", dict(kl_coef=-1.0), "kl_coef=-1"),
    ("glm", dict(old=jnp.zeros((B + 1, T))), "old_logp_BxT has shape"),
])
def test_bad_input_raises_at_trace_time(fn, kw, msg):
    z = jnp.zeros((B, T))
    teacher, old = kw.pop("teacher", z), kw.pop("old", z)
    with pytest.raises(ValueError, match=msg):
        if fn == "kimi":
            jax.jit(functools.partial(kimi_mopd_loss, **kw))(z, teacher, z)
        else:
            jax.jit(functools.partial(glm_opd_loss, **kw))(z, old, teacher, z)
