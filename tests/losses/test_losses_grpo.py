"""GRPO: advantages, DAPO helpers, grpo_loss against numpy, fp64 finite differences,
IcePop/TIS invariants, masking, transforms and bad input."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.losses import losses_numpy_ref as ref
from opd_jax.losses import (Correction, dapo_group_filter, group_advantages, grpo_loss,
                            kl_k3, overlong_penalty)

B, T = 4, 6


def make_inputs(seed, dtype=np.float32):
    """Log-probs whose ratios straddle the clip range and whose mismatch straddles IcePop's."""
    rng = np.random.default_rng(seed)
    lp = -rng.gamma(1.0, 1.0, (B, T))
    old = lp + rng.normal(0, 0.3, (B, T))
    d = dict(lp=lp, old=old, sampler=old + rng.normal(0, 0.8, (B, T)),
             ref=lp + rng.normal(0, 0.3, (B, T)), adv_B=rng.normal(size=B),
             adv_BxT=rng.normal(size=(B, T)))
    d = {k: v.astype(dtype) for k, v in d.items()}
    m = (rng.random((B, T)) < 0.75).astype(dtype)
    m[:, 0] = 1
    d["m"] = m
    return d


def with_correction(kw: dict) -> dict:
    """The tests' flat correction knobs as the one `Correction` object the losses take."""
    fields = {k: kw.pop(k) for k in ("icepop_bounds", "icepop_normalizer", "tis_cap") if k in kw}
    if "correction" in kw:
        kw["correction"] = Correction(kw["correction"], **fields)
    return kw


def call(x, **kw):
    j = {k: jnp.asarray(v) for k, v in x.items()}
    adv = j["adv_BxT"] if kw.pop("per_token", False) else j["adv_B"]
    use_ref, use_sampler = kw.pop("use_ref", True), kw.pop("use_sampler", True)
    kw = with_correction(kw)
    return grpo_loss(j["lp"], j["old"], adv, j["m"],
                     ref_logp_BxT=j["ref"] if use_ref else None,
                     sampler_logp_BxT=j["sampler"] if use_sampler else None, **kw)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), correction=st.sampled_from([None, "icepop", "tis"]),
       mode=st.sampled_from(["token_mean", "seq_mean", "max_len"]),
       eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)]),
       dual_clip=st.sampled_from([None, 3.0]), beta=st.sampled_from([0.0, 0.05]),
       normalizer=st.sampled_from(["all", "kept"]), per_token=st.booleans())
def test_grpo_matches_numpy(seed, correction, mode, eps, dual_clip, beta, normalizer, per_token):
    x = make_inputs(seed)
    loss, metrics = call(x, eps_low=eps[0], eps_high=eps[1], dual_clip=dual_clip, kl_beta=beta,
                         correction=correction, icepop_normalizer=normalizer,
                         aggregation=mode, per_token=per_token)
    want = ref.grpo(*(x[k].astype(np.float64) for k in ("lp", "old")),
                    x["adv_BxT" if per_token else "adv_B"].astype(np.float64), x["m"],
                    eps_low=eps[0], eps_high=eps[1], dual_clip=dual_clip,
                    ref=x["ref"].astype(np.float64), beta=beta,
                    sampler=x["sampler"].astype(np.float64), correction=correction,
                    normalizer=normalizer, mode=mode)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    assert loss.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())


def test_grpo_metrics_match_numpy():
    x = make_inputs(7)
    _, mt = call(x, correction="icepop", eps_high=0.28, kl_beta=0.1)
    lp, old, m, samp = (x[k].astype(np.float64) for k in ("lp", "old", "m", "sampler"))
    rho, k = np.exp(lp - old), np.exp(old - samp)
    a = np.broadcast_to(x["adv_B"][:, None], (B, T))
    valid = m > 0
    np.testing.assert_allclose(mt["ratio_mean"], rho[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(mt["ratio_max"], rho[valid].max(), rtol=1e-5)
    high, low = (a > 0) & (rho > 1.28), (a < 0) & (rho < 0.8)
    np.testing.assert_allclose(mt["clip_frac_high"], high[valid].mean(), rtol=1e-6)
    np.testing.assert_allclose(mt["clip_frac"], (high | low)[valid].mean(), rtol=1e-6)
    assert 0 < float(mt["clip_frac"]) < 1  # the inputs really exercise the clip
    np.testing.assert_allclose(mt["mismatch_min"], k[valid].min(), rtol=1e-5)
    np.testing.assert_allclose(mt["mismatch_mean"], k[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(mt["mismatch_max"], k[valid].max(), rtol=1e-5)
    rejected = ((k < 0.5) | (k > 5.0))[valid].mean()
    np.testing.assert_allclose(mt["icepop_masked_frac"], rejected, rtol=1e-6)
    assert 0 < rejected < 1
    d = x["ref"].astype(np.float64) - lp
    np.testing.assert_allclose(mt["kl_ref"], (np.exp(d) - d - 1)[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(mt["entropy_est"], -lp[valid].mean(), rtol=1e-5)
    _, mt = call(x, correction="tis", tis_cap=1.5)
    np.testing.assert_allclose(mt["tis_clip_frac"], (k > 1.5)[valid].mean(), rtol=1e-6)
    np.testing.assert_allclose(mt["tis_weight_mean"], np.minimum(k, 1.5)[valid].mean(), rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(correction="icepop", kl_beta=0.1),
                                dict(correction="tis", dual_clip=2.0, aggregation="seq_mean"),
                                dict(per_token=True, eps_high=0.28, aggregation="max_len")])
def test_grpo_gradient_matches_finite_differences_fp64(kw):
    with jax.enable_x64(True):
        x = make_inputs(11, np.float64)
        f = jax.jit(lambda lp: call({**x, "lp": lp}, **dict(kw))[0])
        lp0 = jnp.asarray(x["lp"])
        g = np.asarray(jax.grad(f)(lp0))
        h, fd = 1e-6, np.zeros((B, T))
        for i in range(B):
            for j in range(T):
                e = jnp.zeros((B, T)).at[i, j].set(h)
                fd[i, j] = (f(lp0 + e) - f(lp0 - e)) / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
        assert np.abs(g).max() > 1e-3


def test_icepop_with_open_bounds_equals_no_correction():
    x = make_inputs(3)
    g = lambda **kw: jax.value_and_grad(lambda lp: call({**x, "lp": lp}, **kw)[0])(
        jnp.asarray(x["lp"]))
    (l0, g0), (l1, g1) = g(correction=None), g(correction="icepop", icepop_bounds=(0.0, np.inf))
    np.testing.assert_array_equal(l0, l1)
    np.testing.assert_array_equal(g0, g1)
    # TIS with an infinite cap and a sampler that agrees with the trainer: also a no-op.
    l2, g2 = jax.value_and_grad(lambda lp: call({**x, "lp": lp, "sampler": x["old"]},
                                                correction="tis", tis_cap=np.inf)[0])(
        jnp.asarray(x["lp"]))
    np.testing.assert_allclose(l2, l0, rtol=1e-6)
    np.testing.assert_allclose(g2, g0, rtol=1e-6)


def test_icepop_normalizer_knob():
    x = make_inputs(5)
    l_all, mt = call(x, correction="icepop", use_ref=False)
    l_kept, _ = call(x, correction="icepop", icepop_normalizer="kept", use_ref=False)
    kept = 1 - float(mt["icepop_masked_frac"])
    # token_mean: same numerator, denominators sum(m) vs sum(m * M).
    np.testing.assert_allclose(l_kept * kept, l_all, rtol=1e-5)


def test_masked_tokens_change_nothing():
    x = make_inputs(9)
    m = x["m"] > 0
    dirty = dict(x, lp=np.where(m, x["lp"], -np.inf), old=np.where(m, x["old"], np.nan),
                 sampler=np.where(m, x["sampler"], np.inf), ref=np.where(m, x["ref"], np.nan),
                 adv_BxT=np.where(m, x["adv_BxT"], np.nan))
    for kw in (dict(correction="icepop", kl_beta=0.1), dict(correction="tis", per_token=True)):
        f = lambda lp, d: call({**d, "lp": lp}, **kw)
        (l0, m0), g0 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(x["lp"]), x)
        (l1, m1), g1 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(dirty["lp"]), dirty)
        np.testing.assert_array_equal(l0, l1)
        np.testing.assert_array_equal(g0, g1)
        assert np.all(np.asarray(g0)[~m] == 0)
        for k in m0:
            np.testing.assert_array_equal(m0[k], m1[k], err_msg=k)


def test_jit_vmap_grad():
    x = make_inputs(2)
    f = functools.partial(grpo_loss, correction="icepop", kl_beta=0.05, eps_high=0.28)
    args = [jnp.asarray(x[k]) for k in ("lp", "old", "adv_B", "m")]
    kwargs = dict(ref_logp_BxT=jnp.asarray(x["ref"]), sampler_logp_BxT=jnp.asarray(x["sampler"]))
    eager, _ = f(*args, **kwargs)
    jitted, _ = jax.jit(f)(*args, **kwargs)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    stacked = [jnp.stack([a, a]) for a in args]
    kw_stacked = {k: jnp.stack([v, v]) for k, v in kwargs.items()}
    batched, mt = jax.vmap(lambda *a, ref_logp_BxT, sampler_logp_BxT: f(
        *a, ref_logp_BxT=ref_logp_BxT, sampler_logp_BxT=sampler_logp_BxT))(*stacked, **kw_stacked)
    np.testing.assert_allclose(batched, [eager, eager], rtol=1e-6)
    g = jax.jit(jax.grad(lambda lp: f(lp, *args[1:], **kwargs)[0]))(args[0])
    assert g.shape == (B, T) and np.all(np.isfinite(g))


@pytest.mark.parametrize("kw,msg", [
    (dict(old=jnp.zeros((B, T + 1))), "old_logp_BxT has shape"),
    (dict(adv=jnp.zeros((B + 1,))), "adv_B_or_BxT has shape"),
    (dict(correction="icepop", sampler=None), "needs sampler_logp_BxT"),
    (dict(correction="is"), "correction.kind='is'"),
    (dict(kl_beta=0.1, ref=None), "needs ref_logp_BxT"),
    (dict(eps_low=1.0), "eps_low=1"),
    (dict(eps_high=-0.1), "eps_high=-0.1"),
    (dict(correction="icepop", icepop_bounds=(5.0, 0.5)), "alpha < beta"),
    (dict(correction="tis", tis_cap=0.0), "tis_cap=0"),
    (dict(aggregation="sum"), "aggregation='sum'"),
    (dict(dual_clip=0.5), "dual_clip=0.5"),
])
def test_bad_input_raises_at_trace_time(kw, msg):
    z = jnp.zeros((B, T))
    arrays = dict(lp=z, old=kw.pop("old", z), adv=kw.pop("adv", jnp.zeros(B)), m=z,
                  ref=kw.pop("ref", z), sampler=kw.pop("sampler", z))
    with pytest.raises(ValueError, match=msg):   # a bad Correction fails when it is built
        f = jax.jit(functools.partial(grpo_loss, **with_correction(kw)))
        f(arrays["lp"], arrays["old"], arrays["adv"], arrays["m"],
          ref_logp_BxT=arrays["ref"], sampler_logp_BxT=arrays["sampler"])


@pytest.mark.parametrize("scale,ddof", [("std", 1), ("std", 0), ("none", 1)])
def test_group_advantages_match_numpy(scale, ddof):
    r = np.random.default_rng(0).random((3, 5)).astype(np.float32)
    r[1] = 0.5  # all-equal group: zero advantage, not NaN
    got = group_advantages(jnp.asarray(r), scale, ddof=ddof)
    np.testing.assert_allclose(got, ref.group_advantages(r, scale, ddof=ddof), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(got[1], 0)


def test_group_advantages_example_and_errors():
    np.testing.assert_allclose(group_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0]])),
                               [[0.866025, -0.866025, -0.866025, 0.866025]], rtol=1e-5)
    with pytest.raises(ValueError, match="G=1"):
        group_advantages(jnp.ones((4, 1)))
    with pytest.raises(ValueError, match="rewards_BxG has shape"):
        group_advantages(jnp.ones(4))
    with pytest.raises(ValueError, match="scale='mean'"):
        group_advantages(jnp.ones((2, 2)), "mean")


def test_dapo_helpers():
    np.testing.assert_array_equal(dapo_group_filter(jnp.array([[1.0, 1.0], [0.0, 1.0]])),
                                  [False, True])
    np.testing.assert_allclose(overlong_penalty(jnp.array([10, 15, 20, 21, 30]), 20, 10),
                               [0.0, -0.5, -1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len=30"):
        overlong_penalty(jnp.array([1]), 20, 30)


def test_kl_k3_is_nonnegative_and_zero_on_equal():
    d = jnp.linspace(-5, 5, 101)
    assert np.all(np.asarray(kl_k3(jnp.zeros(101), d)) >= 0)
    assert float(kl_k3(jnp.asarray(-1.3), jnp.asarray(-1.3))) == 0.0
    np.testing.assert_allclose(kl_k3(jnp.log(0.5), jnp.log(0.25)), 0.5 - np.log(0.5) - 1,
                               rtol=1e-6)


def test_bf16_logprobs_give_fp32_loss():
    """bf16 log-probs are upcast first: the loss is fp32 and equals fp32 math on the rounded
    inputs (1e-6); against unrounded inputs, bf16 rounds a log-prob of size <= 6 by up to
    2^-9 * 6 = 0.012, which moves rho by ~1.2% per token, hence the 3e-2 tolerance."""
    x = make_inputs(21)
    x16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in x.items()}
    loss16, mt = call(x16, correction="icepop", kl_beta=0.1)
    assert loss16.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in mt.values())
    rounded = {k: np.asarray(v.astype(jnp.float32)) for k, v in x16.items()}
    np.testing.assert_allclose(loss16, call(rounded, correction="icepop", kl_beta=0.1)[0],
                               rtol=1e-6)
    np.testing.assert_allclose(loss16, call(x, correction="icepop", kl_beta=0.1)[0], atol=3e-2)
