"""Top-k + tail teacher signal (`losses.topk_kl_loss`): fp64 numpy parity, gradients against
a dense jnp form, the full-vocabulary limit at K = V, monotone in K, the kept mass not
shrunk, the teacher-tail floor, self-distillation, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.losses import losses_numpy_ref as ref
from opd_jax.losses import (forward_kl_loss, log_softmax, reverse_kl_loss, teacher_topk,
                            topk_kl_loss)

B, T, V = 2, 3, 9
FULL = {"reverse": reverse_kl_loss, "forward": forward_kl_loss}


def inputs(seed=0, teacher_scale=1.0):
    """Teacher logits of scale 1 keep every tail mass >= ~1e-2: the tail 1 - sum_k q_k is
    known from fp32 top-k log-probs only to ~1e-7 absolute, which a tiny tail would turn
    into a large relative error in log q_tail (an input's limit, not the loss's)."""
    rng = np.random.default_rng(seed)
    s = jnp.asarray(rng.normal(0, 2, (B, T, V)), jnp.float32)
    t = jnp.asarray(rng.normal(0, teacher_scale, (B, T, V)), jnp.float32)
    m = jnp.asarray([[1, 1, 0], [1, 0, 1]], jnp.float32)
    return s, t, m


def dense_topk_loss(s, ids, lq, m, *, direction="reverse", temperature=1.0,
                    aggregation="token_mean", max_len=None):
    """The same loss written densely: bucket masses from a [B, T, V] membership mask
    (p_tail = sum of the non-members' probabilities), for gradient parity (run in fp64)."""
    p = jnp.exp(log_softmax(s, temperature))
    member = jax.nn.one_hot(ids, s.shape[-1]).sum(-2)          # [B, T, V]
    p_k = jnp.take_along_axis(p, ids, -1)
    q_k = jnp.exp(lq)
    tail = ids.shape[-1] < s.shape[-1]
    if tail:
        p_k = jnp.concatenate([p_k, (p * (1 - member)).sum(-1, keepdims=True)], -1)
        q_k = jnp.concatenate([q_k, jnp.maximum(1 - q_k.sum(-1, keepdims=True), 1e-8)], -1)
    a, c = (p_k, q_k) if direction == "reverse" else (q_k, p_k)
    per = (a * (jnp.log(a) - jnp.log(c))).sum(-1)
    from opd_jax.losses import aggregate
    return aggregate(per, m, aggregation, max_len=max_len)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_values_match_numpy_and_grads_match_dense(direction, k, aggregation):
    s, t, m = inputs()
    for tau in (1.0, 0.7):
        ids, lq = teacher_topk(t, k, tau)
        loss, mt = topk_kl_loss(s, ids, lq, m, direction=direction, temperature=tau,
                                aggregation=aggregation)
        want = ref.topk_divergence(direction, np.asarray(s), np.asarray(ids), np.asarray(lq),
                                   np.asarray(m), tau, aggregation)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
        kw = dict(direction=direction, temperature=tau, aggregation=aggregation)
        g = jax.grad(lambda x: topk_kl_loss(x, ids, lq, m, **kw)[0])(s)
        with jax.enable_x64(True):     # the dense form's 1 - sum q_k cancels in fp32
            g_ref = jax.grad(lambda x: dense_topk_loss(x, ids, lq.astype(jnp.float64), m,
                                                       **kw))(s.astype(jnp.float64))
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)   # complex: 1e-4
        assert float(mt[f"topk_{direction}_kl"]) >= 0
        assert 0 < float(mt["teacher_topk_mass"]) <= 1 + 1e-6


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_k_equal_to_vocab_is_the_full_vocabulary_loss(direction):
    s, t, m = inputs(1)
    ids, lq = teacher_topk(t, V)
    loss = lambda x: topk_kl_loss(x, ids, lq, m, direction=direction)[0]  # noqa: E731
    full = lambda x: FULL[direction](x, t, m)[0]                           # noqa: E731
    np.testing.assert_allclose(loss(s), full(s), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(loss)(s), jax.grad(full)(s), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_bucketed_kl_grows_with_k_up_to_the_full_kl(direction):
    """Nested top-k sets refine the buckets, so the KL never decreases with K and never
    exceeds the full-vocabulary KL (data processing), per token."""
    s, t, _ = inputs(2)
    m = jnp.ones((B, T))
    full = FULL[direction](s, t, m, aggregation="max_len")[0]
    prev = -1.0
    for k in range(1, V + 1):
        val = float(topk_kl_loss(s, *teacher_topk(t, k), m, direction=direction,
                                 aggregation="max_len")[0])
        assert prev - 1e-6 <= val <= float(full) + 1e-5, (k, prev, val, float(full))
        prev = val
    np.testing.assert_allclose(prev, float(full), rtol=1e-5)


def test_the_tail_keeps_the_mass_outside_the_top_k():
    """A student proportional to the teacher on its top-k but with more tail mass is not at
    zero loss (a loss renormalised over the kept tokens would call it perfect: verl #5041);
    moving its tail mass back onto the kept tokens lowers the loss to 0."""
    t = jnp.log(jnp.asarray([[[0.5, 0.3, 0.1, 0.05, 0.05]]]))
    ids, lq = teacher_topk(t, 2)
    m = jnp.ones((1, 1))
    shrunk = jnp.log(jnp.asarray([[[0.25, 0.15, 0.2, 0.2, 0.2]]]))      # same 5:3 ratio
    for direction in ("reverse", "forward"):
        assert float(topk_kl_loss(shrunk, ids, lq, m, direction=direction)[0]) > 0.1
        np.testing.assert_allclose(float(topk_kl_loss(t, ids, lq, m, direction=direction)[0]),
                                   0.0, atol=1e-6)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_self_distillation_is_zero_with_zero_gradient(direction):
    s, _, m = inputs(3)
    ids, lq = teacher_topk(s, 4)
    loss, g = jax.value_and_grad(lambda x: topk_kl_loss(x, ids, lq, m, direction=direction)[0])(s)
    np.testing.assert_allclose(float(loss), 0.0, atol=1e-6)
    np.testing.assert_allclose(g, 0.0, atol=1e-6)


def test_a_teacher_whose_top_k_holds_all_its_mass_gives_a_finite_loss():
    """fp32 rounding: sum_k q_k == 1 with K < V; the teacher tail is floored (counted)."""
    s, _, m = inputs(4)
    t = jnp.zeros((B, T, V)).at[..., :2].set(60.0)          # all mass on ids 0, 1
    ids, lq = teacher_topk(t, 2)
    loss, mt = topk_kl_loss(s, ids, lq, m)
    g = jax.grad(lambda x: topk_kl_loss(x, ids, lq, m)[0])(s)
    assert np.isfinite(float(loss)) and bool(jnp.isfinite(g).all())
    assert float(mt["tail_floor_frac"]) == 1.0


def test_teacher_gets_no_gradient():
    s, t, m = inputs(5)
    ids, _ = teacher_topk(t, 3)
    lq = jnp.take_along_axis(log_softmax(t), ids, -1)
    g = jax.grad(lambda x: topk_kl_loss(s, ids, x, m)[0])(lq)
    np.testing.assert_array_equal(g, 0.0)


def test_bad_inputs_are_refused_with_the_value():
    s, t, m = inputs()
    ids, lq = teacher_topk(t, 3)
    with pytest.raises(ValueError, match=r"K=12 .* V=9"):
        topk_kl_loss(s, jnp.zeros((B, T, 12), jnp.int32), jnp.zeros((B, T, 12)), m)
    with pytest.raises(ValueError, match="integer token ids"):
        topk_kl_loss(s, ids.astype(jnp.float32), lq, m)
    with pytest.raises(ValueError, match="direction"):
        topk_kl_loss(s, ids, lq, m, direction="sideways")
    with pytest.raises(ValueError, match="teacher_logp_BxTxK"):
        topk_kl_loss(s, ids, lq[..., :2], m)
    with pytest.raises(ValueError, match="k=10"):
        teacher_topk(t, 10)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_unused_slots_hold_no_mass_and_leave_it_in_the_tail(direction):
    """ids < 0 (a server that sent fewer than K tokens): the loss equals the loss over the
    used slots alone, values and gradients; a position with no used slot compares the
    student's whole mass (tail) with the teacher's (1): 0."""
    s, t, m = inputs(6)
    ids, lq = teacher_topk(t, 3)
    pad_ids = jnp.concatenate([ids, jnp.full((B, T, 2), -1, jnp.int32)], -1)
    pad_lq = jnp.concatenate([lq, jnp.full((B, T, 2), 7.0)], -1)   # garbage: must be ignored
    f = lambda x: topk_kl_loss(x, ids, lq, m, direction=direction)[0]          # noqa: E731
    g = lambda x: topk_kl_loss(x, pad_ids, pad_lq, m, direction=direction)[0]  # noqa: E731
    np.testing.assert_allclose(g(s), f(s), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(g)(s), jax.grad(f)(s), rtol=1e-5, atol=1e-7)
    none = jnp.full((B, T, 2), -1, jnp.int32)
    np.testing.assert_allclose(float(topk_kl_loss(s, none, jnp.zeros((B, T, 2)), m,
                                                  direction=direction)[0]), 0.0, atol=1e-6)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_k_equal_to_vocab_with_unused_slots_keeps_the_tail(direction):
    """K = V with some slots unused (a cross-tokenizer or served answer) is the loss over the
    used slots plus the tail, as at K < V, not a distribution missing the unused mass; an id
    >= V (no student token) counts as unused. Gradients stay finite."""
    s, t, m = inputs(7)
    ids, lq = teacher_topk(t, 3)
    f = lambda x: topk_kl_loss(x, ids, lq, m, direction=direction)[0]          # noqa: E731
    for fill in (-1, V, V + 5):
        pad_ids = jnp.concatenate([ids, jnp.full((B, T, V - 3), fill, jnp.int32)], -1)
        pad_lq = jnp.concatenate([lq, jnp.full((B, T, V - 3), -3.0)], -1)
        g = lambda x: topk_kl_loss(x, pad_ids, pad_lq, m, direction=direction)[0]  # noqa: E731
        np.testing.assert_allclose(g(s), f(s), rtol=1e-5)
        grad = jax.grad(g)(s)
        assert np.isfinite(np.asarray(grad)).all()
        np.testing.assert_allclose(grad, jax.grad(f)(s), rtol=1e-4, atol=1e-6)
    # the reviewer's case: V = 4, a uniform student, ids (0, 1, 2, unused), q = (.7, .2, .05)
    s4 = jnp.zeros((1, 1, 4))
    q = np.log(np.array([0.7, 0.2, 0.05, 1.0]))
    got = float(topk_kl_loss(s4, jnp.array([[[0, 1, 2, -1]]]), jnp.asarray(q[None, None]),
                             jnp.ones((1, 1)), direction=direction)[0])
    p_b, q_b = np.array([.25, .25, .25, .25]), np.array([.7, .2, .05, .05])
    a, c = (p_b, q_b) if direction == "reverse" else (q_b, p_b)
    np.testing.assert_allclose(got, float((a * np.log(a / c)).sum()), rtol=1e-5)
