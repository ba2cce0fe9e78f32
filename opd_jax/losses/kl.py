"""Full-vocabulary divergences between the student and one or several teachers
(DeepSeek-V4 OPD), each named by its direction.

Shape letters: B batch, T tokens, V vocab, K teachers. p = softmax(student / tau) is the
student, q = softmax(teacher / tau) the teacher; tau applies to both (no tau^2 factor).

| loss                 | per token                                        | direction     |
|----------------------|--------------------------------------------------|---------------|
| reverse_kl_loss      | KL(p || q) = sum_v p_v (log p_v - log q_v)       | student first |
| forward_kl_loss      | KL(q || p) = sum_v q_v (log q_v - log p_v)       | teacher first |
| generalized_jsd_loss | b KL(p || m) + (1-b) KL(q || m), m = b p + (1-b) q | symmetric b=.5 |

Teachers: `teacher_logits` is [B, T, V] or stacked [K, B, T, V]; stacked teachers are mixed
as sum_k w_k D(., q_k) with `weights` [K], per sample [B, K] or per token [B, T, K]
(confidence weighting; default uniform). Weights must be non-negative and sum to 1: checked
eagerly when concrete, trusted when traced.
Teachers get no gradient. The token loss is then reduced by `aggregate`.

Metric names (fp32 scalars): loss, reverse_kl | forward_kl | jsd (token mean of the
mixed divergence, whatever the aggregation), entropy (student), teacher_entropy
(w-weighted), and with stacked teachers `<divergence>_teacher<k>` for k < K.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from opd_jax.losses import _checks
from opd_jax.losses.aggregation import aggregate, masked_mean
from opd_jax.losses.logprobs import log_softmax, xlogp


def _kl(logp_a: jax.Array, logp_b: jax.Array) -> jax.Array:
    """KL(a || b) = sum_v a_v (log a_v - log b_v) over the last axis; 0 where a_v = 0."""
    p_a = jnp.exp(logp_a)
    kl = (p_a * jnp.where(p_a > 0, logp_a - logp_b, 0)).sum(-1)
    # Near-equal peaked distributions can round to -1e-15 in fp32; KL is never negative.
    return jnp.maximum(kl, 0.0)


def reverse_kl(student_logp: jax.Array, teacher_logp: jax.Array) -> jax.Array:
    """KL(student || teacher) per position from log-probs [..., V] (REVERSE KL).

    Example: `reverse_kl(jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.9, 0.1])))`
    is 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1) = 0.511.
    """
    return _kl(student_logp, teacher_logp)


def forward_kl(student_logp: jax.Array, teacher_logp: jax.Array) -> jax.Array:
    """KL(teacher || student) per position from log-probs [..., V] (FORWARD KL).

    Example: `forward_kl(jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.9, 0.1])))`
    is 0.9 log(0.9/0.5) + 0.1 log(0.1/0.5) = 0.368.
    """
    return _kl(teacher_logp, student_logp)


def generalized_jsd(student_logp: jax.Array, teacher_logp: jax.Array,
                    beta: float = 0.5) -> jax.Array:
    """b KL(p || m) + (1 - b) KL(q || m), m = b p + (1 - b) q, p student, q teacher.

    b is the student's weight. TRL's GKD `beta` weighs the teacher: TRL beta = 1 - b.
    Example: `generalized_jsd(logp, logp, 0.5)` is 0 for any log-probs `logp`.
    """
    dtype = student_logp.dtype
    log_b, log_1mb = jnp.log(jnp.asarray(beta, dtype)), jnp.log1p(-jnp.asarray(beta, dtype))
    # Entries both rule out (-inf) would give logaddexp(-inf, -inf), whose gradient is NaN.
    both_out = jnp.isneginf(student_logp) & jnp.isneginf(teacher_logp)
    logm = jnp.logaddexp(jnp.where(both_out, 0, log_b + student_logp),
                         jnp.where(both_out, 0, log_1mb + teacher_logp))
    logm = jnp.where(both_out, -jnp.inf, logm)
    return beta * _kl(student_logp, logm) + (1 - beta) * _kl(teacher_logp, logm)


def _divergence_loss(kind: str, fn: Callable, student_logits_BxTxV: jax.Array,
                     teacher_logits: jax.Array, mask_BxT: jax.Array, weights, temperature,
                     aggregation: str, max_len: int | None):
    _checks.check_rank("student_logits_BxTxV", student_logits_BxTxV, (3,), "[B, T, V]")
    _checks.check_rank("teacher_logits", teacher_logits, (3, 4), "[B, T, V] or [K, B, T, V]")
    b, t, v = student_logits_BxTxV.shape
    if teacher_logits.shape[-1] != v:
        raise ValueError(f"teacher vocab {teacher_logits.shape[-1]} != student vocab {v}")
    if tuple(teacher_logits.shape[-3:-1]) != (b, t):
        raise ValueError(f"teacher_logits has [B, T] = {tuple(teacher_logits.shape[-3:-1])}, "
                         f"expected the student's {(b, t)}")
    _checks.check_shape("mask_BxT", mask_BxT, (b, t), "[B, T]")
    stacked = teacher_logits.ndim == 4
    k = teacher_logits.shape[0] if stacked else 1
    if weights is not None and not stacked:
        raise ValueError("weights are for stacked [K, B, T, V] teachers; got a single "
                         f"[B, T, V] teacher with weights of shape {tuple(jnp.shape(weights))}")
    if weights is not None:
        _checks.check_weights(weights, k, b, t)

    logp_BxTxV = log_softmax(student_logits_BxTxV, temperature)
    logq_KxBxTxV = jax.lax.stop_gradient(log_softmax(teacher_logits, temperature))
    if not stacked:
        logq_KxBxTxV = logq_KxBxTxV[None]
    dtype = logp_BxTxV.dtype
    logq_KxBxTxV = logq_KxBxTxV.astype(dtype)
    div_KxBxT = fn(logp_BxTxV[None], logq_KxBxTxV)
    w_KxBxT = weights_KxBxT(weights, k, b, t, dtype)
    div_BxT = (w_KxBxT * div_KxBxT).sum(0)
    loss = aggregate(div_BxT, mask_BxT, aggregation, max_len=max_len)

    sg = jax.lax.stop_gradient
    ent_BxT = -xlogp(jnp.exp(sg(logp_BxTxV)), sg(logp_BxTxV)).sum(-1)
    teacher_ent_KxBxT = -xlogp(jnp.exp(logq_KxBxTxV), logq_KxBxTxV).sum(-1)
    metrics = {
        "loss": sg(loss),
        kind: masked_mean(sg(div_BxT), mask_BxT),
        "entropy": masked_mean(ent_BxT, mask_BxT),
        "teacher_entropy": masked_mean((sg(w_KxBxT) * teacher_ent_KxBxT).sum(0), mask_BxT),
    }
    if stacked:
        for i in range(k):
            metrics[f"{kind}_teacher{i}"] = masked_mean(sg(div_KxBxT[i]), mask_BxT)
    return loss, {name: x.astype(jnp.float32) for name, x in metrics.items()}


def weights_KxBxT(weights, k: int, b: int, t: int, dtype=jnp.float32) -> jax.Array:
    """Teacher weights [K], [B, K] or [B, T, K] (None: uniform 1/K) as [K, B, T], detached."""
    if weights is None:
        return jnp.full((k, b, t), 1.0 / k, dtype)
    w = jax.lax.stop_gradient(jnp.asarray(weights).astype(dtype))
    if w.ndim == 1:
        return jnp.broadcast_to(w[:, None, None], (k, b, t))
    if w.ndim == 2:
        return jnp.broadcast_to(w.T[:, :, None], (k, b, t))
    return jnp.moveaxis(w, -1, 0)


def reverse_kl_loss(student_logits_BxTxV: jax.Array, teacher_logits: jax.Array,
                    mask_BxT: jax.Array, *, weights: jax.Array | None = None,
                    temperature: float = 1.0, aggregation: str = "token_mean",
                    max_len: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted full-vocabulary REVERSE KL (student first), DeepSeek-V4 OPD:

    L = sum_{b,t} m_bt sum_k w_bk KL(p_bt || q_kbt) / sum_{b,t} m_bt (w_bk, or w_btk per token),
    KL(p || q) = sum_v p_v (log p_v - log q_v); grad wrt student logits s (tau = 1):
    p_v (log p_v - log q_v - KL). Mode-seeking: the student is pushed off tokens the
    teacher rules out. Computed from full [B, T, V] logits in fp32; the fused kernels
    avoid materializing them.

    Example::

        loss, metrics = reverse_kl_loss(student_BxTxV, jnp.stack([t0_BxTxV, t1_BxTxV]),
                                        mask_BxT, weights=jnp.array([0.7, 0.3]))
    """
    return _divergence_loss("reverse_kl", reverse_kl, student_logits_BxTxV, teacher_logits,
                            mask_BxT, weights, temperature, aggregation, max_len)


def forward_kl_loss(student_logits_BxTxV: jax.Array, teacher_logits: jax.Array,
                    mask_BxT: jax.Array, *, weights: jax.Array | None = None,
                    temperature: float = 1.0, aggregation: str = "token_mean",
                    max_len: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted full-vocabulary FORWARD KL (teacher first), for comparisons:

    L = sum m sum_k w_k KL(q_k || p) / sum m, KL(q || p) = sum_v q_v (log q_v - log p_v).
    Mass-covering: the classic distillation / SFT-on-teacher-distribution objective.

    Example: `loss, metrics = forward_kl_loss(student_BxTxV, teacher_BxTxV, mask_BxT)`.
    """
    return _divergence_loss("forward_kl", forward_kl, student_logits_BxTxV, teacher_logits,
                            mask_BxT, weights, temperature, aggregation, max_len)


def generalized_jsd_loss(student_logits_BxTxV: jax.Array, teacher_logits: jax.Array,
                         mask_BxT: jax.Array, *, beta: float = 0.5,
                         weights: jax.Array | None = None, temperature: float = 1.0,
                         aggregation: str = "token_mean", max_len: int | None = None
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted generalized Jensen-Shannon divergence (GKD), for comparisons:

    JSD_b(p, q) = b KL(p || m) + (1 - b) KL(q || m), m = b p + (1 - b) q, p the student,
    b in (0, 1) the student's weight (TRL's beta is 1 - b). Bounded by the entropy of
    (b, 1 - b); JSD_b / b -> reverse KL(p || q) as b -> 0 and JSD_b / (1 - b) -> forward
    KL(q || p) as b -> 1.

    Example: `loss, metrics = generalized_jsd_loss(student_BxTxV, teacher_BxTxV, mask_BxT)`.
    """
    _checks.check_scalar("beta", beta, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    return _divergence_loss("jsd", functools.partial(generalized_jsd, beta=beta),
                            student_logits_BxTxV, teacher_logits, mask_BxT, weights,
                            temperature, aggregation, max_len)
