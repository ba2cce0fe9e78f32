"""token_logprobs, token_entropy, aggregate and sft_loss against numpy; invariants; errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import losses_numpy_ref as ref
from opd_jax.losses import aggregate, sft_loss, token_entropy, token_logprobs

# Few distinct shapes: every new shape recompiles each eager op, which dominates the runtime.
SETTINGS = settings(max_examples=10, deadline=None)
SHAPES = st.sampled_from([(1, 1, 2), (2, 5, 7)])


def _mask(rng, b, t):
    m = (rng.random((b, t)) < 0.7).astype(np.float32)
    m[0, 0] = 1.0  # at least one valid token
    return m


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), shape=SHAPES, tau=st.sampled_from([0.5, 1.0, 1.7]))
def test_token_logprobs_and_entropy_match_numpy(seed, shape, tau):
    b, t, v = shape
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (b, t, v)).astype(np.float32)
    y = rng.integers(0, v, (b, t))
    lp = token_logprobs(jnp.asarray(logits), jnp.asarray(y), temperature=tau)
    assert lp.dtype == jnp.float32 and lp.shape == (b, t)
    np.testing.assert_allclose(lp, ref.token_logprobs(logits, y, tau), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(token_entropy(jnp.asarray(logits), tau), ref.entropy(logits, tau),
                               rtol=1e-5, atol=1e-5)


def test_temperature_scaling_equals_scaled_logits():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 2, (2, 4, 11)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 11, (2, 4)))
    np.testing.assert_allclose(token_logprobs(logits, y, 0.6), token_logprobs(logits / 0.6, y),
                               rtol=1e-6, atol=1e-6)
    # tau -> 0 gives log 1 = 0 on the argmax token.
    np.testing.assert_allclose(token_logprobs(logits, jnp.argmax(logits, -1), 1e-3), 0, atol=1e-5)


def test_bf16_logits_give_fp32_logprobs():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 3, (2, 3, 50)), jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, 50, (2, 3)))
    lp = token_logprobs(logits, y)
    assert lp.dtype == jnp.float32
    # The upcast happens before the softmax: identical to fp32 math on the rounded logits.
    np.testing.assert_allclose(lp, token_logprobs(logits.astype(jnp.float32), y), atol=1e-6)


def test_leading_dims_are_free():
    logits = jnp.zeros((3, 2, 4, 5))
    assert token_logprobs(logits, jnp.zeros((3, 2, 4), jnp.int32)).shape == (3, 2, 4)


@pytest.mark.parametrize("logits,y,tau,msg", [
    (jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32), 1.0, "targets_BxT has shape"),
    (jnp.zeros((2, 3, 5)), jnp.zeros((2, 3)), 1.0, "integer token ids"),
    (jnp.zeros((2, 3, 5), jnp.int32), jnp.zeros((2, 3), jnp.int32), 1.0, "floating"),
    (jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), jnp.int32), 0.0, "temperature=0"),
])
def test_token_logprobs_bad_input(logits, y, tau, msg):
    with pytest.raises(ValueError, match=msg):
        jax.jit(token_logprobs, static_argnums=2)(logits, y, tau)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), shape=SHAPES,
       mode=st.sampled_from(["token_mean", "seq_mean", "max_len"]), fractional=st.booleans())
def test_aggregate_matches_numpy(seed, shape, mode, fractional):
    b, t, _ = shape
    rng = np.random.default_rng(seed)
    l = rng.normal(size=(b, t)).astype(np.float32)
    m = _mask(rng, b, t) * (rng.random((b, t)) if fractional else 1.0)
    denom = np.maximum(m, (rng.random((b, t)) < 0.5))
    max_len = None if mode != "max_len" else t + 3
    for d in (None, denom):
        got = aggregate(jnp.asarray(l), jnp.asarray(m), mode, max_len=max_len,
                        denom_mask_BxT=None if d is None else jnp.asarray(d))
        np.testing.assert_allclose(got, ref.aggregate(l, m, mode, max_len, d), rtol=1e-5,
                                   atol=1e-6)


def test_aggregate_examples_and_empty_mask():
    m = jnp.array([[1, 1, 0], [1, 0, 0]])
    l = jnp.array([[1.0, 3.0, 100.0], [5.0, 7.0, 9.0]])
    assert float(aggregate(l, m)) == pytest.approx(3.0)               # (1+3+5)/3
    assert float(aggregate(l, m, "seq_mean")) == pytest.approx(3.5)   # mean(2, 5)
    assert float(aggregate(l, m, "max_len")) == pytest.approx(1.5)    # 9 / (2*3)
    zero = jnp.zeros((2, 3))
    for mode in ("token_mean", "seq_mean", "max_len"):
        val, g = jax.value_and_grad(lambda x: aggregate(x, zero, mode))(l)
        assert float(val) == 0.0 and np.all(np.asarray(g) == 0)


def test_aggregate_bad_input():
    with pytest.raises(ValueError, match="aggregation='mean'"):
        aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), "mean")
    with pytest.raises(ValueError, match="mask_BxT has shape"):
        aggregate(jnp.zeros((2, 3)), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="max_len=0"):
        aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), "max_len", max_len=0)
    with pytest.raises(ValueError, match="only used by"):
        aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), "token_mean", max_len=4)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(["token_mean", "seq_mean", "max_len"]))
def test_sft_matches_numpy(seed, mode):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (3, 5, 7)).astype(np.float32)
    y = rng.integers(0, 7, (3, 5))
    m = _mask(rng, 3, 5)
    lp = token_logprobs(jnp.asarray(logits), jnp.asarray(y))
    loss, metrics = sft_loss(lp, jnp.asarray(m), aggregation=mode)
    lp_np = ref.token_logprobs(logits, y)
    np.testing.assert_allclose(loss, ref.aggregate(-lp_np, m, mode), rtol=1e-5, atol=1e-6)
    nll = ref.masked_mean(-lp_np, m)
    np.testing.assert_allclose(metrics["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(metrics["perplexity"], np.exp(nll), rtol=1e-5)
    assert float(metrics["num_tokens"]) == m.sum()
    assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())


def test_sft_masked_tokens_change_nothing():
    rng = np.random.default_rng(3)
    lp = jnp.asarray(-rng.random((2, 6)), jnp.float32)
    m = jnp.asarray(_mask(rng, 2, 6))
    garbage = jnp.where(m > 0, lp, -jnp.inf)  # padding log-probs of -inf are common
    f = lambda x: sft_loss(x, m)[0]
    np.testing.assert_array_equal(f(lp), f(garbage))
    g1, g2 = jax.grad(f)(lp), jax.grad(f)(garbage)
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_allclose(g1, -np.asarray(m) / float(m.sum()), rtol=1e-6)


def test_sft_jit_vmap_grad():
    rng = np.random.default_rng(4)
    lp = jnp.asarray(-rng.random((4, 2, 5)), jnp.float32)
    m = jnp.ones((4, 2, 5))
    batched = jax.vmap(lambda x, mm: sft_loss(x, mm)[0])(lp, m)
    np.testing.assert_allclose(batched, [sft_loss(lp[i], m[i])[0] for i in range(4)], rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda x: sft_loss(x, m[0])[0])(lp[0]),
                               -lp[0].mean(), rtol=1e-6)
    with pytest.raises(ValueError, match="mask_BxT has shape"):
        jax.jit(sft_loss)(lp[0], m[0, :, :3])
