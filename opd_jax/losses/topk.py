"""Top-k teacher signal: a divergence over the teacher's k most likely tokens plus one tail
bucket holding the rest of the mass (what a served teacher can send: vLLM / SGLang / llama.cpp
return the top-k log-probs of each position, not the whole distribution).

Shape letters: B batch, T tokens, V vocab, K the teacher's top-k.

Per position the teacher gives K token ids and their log-probs ``lq_k`` (at the objective's
temperature). Both distributions are coarsened to the same K + 1 buckets: the K ids, and the
tail (every other token):

    q = (q_1 .. q_K, q_tail = 1 - sum_k q_k)     the teacher, from its top-k
    p = (p_1 .. p_K, p_tail = 1 - sum_k p_k)     the student's softmax(logits / tau) on the
                                                 same ids; log p_tail is a logsumexp over the
                                                 other V - K logits, exact and finite

| loss              | per token                                      | direction     |
|-------------------|------------------------------------------------|---------------|
| reverse           | KL(p || q) over the K + 1 buckets              | student first |
| forward           | KL(q || p) over the K + 1 buckets              | teacher first |

The tail keeps the mass outside the top-k in the divergence: renormalising over the K kept
tokens instead (verl #5041) lets the student move mass out of the kept set for free. By the
data-processing inequality the bucketed KL is <= the full-vocabulary KL, with equality at
K = V (then there is no tail bucket and the loss equals `reverse_kl_loss` /
`forward_kl_loss`). The teacher's tail mass is floored at `TAIL_FLOOR` (fp32 rounding of
sum_k q_k can reach 1 while the student still has tail mass, which would make the reverse KL
infinite); the student's tail is never floored. The teacher gets no gradient.

Unused slots. An id < 0 marks a slot the teacher did not fill (a server that sent fewer
than K tokens at a position, or tokens the client could not map to ids): it holds no mass on
either side (its log-probs are -inf), and the mass it would have held stays in the tail
(for K < V; at K = V there is no tail, so every slot must be used).

Metric names (fp32 scalars): loss, topk_reverse_kl | topk_forward_kl (token mean),
teacher_topk_mass (sum_k q_k), student_topk_mass (sum_k p_k), tail_floor_frac (tokens whose
teacher tail was floored).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.losses import _checks
from opd_jax.losses.aggregation import aggregate, masked_frac, masked_mean
from opd_jax.losses.logprobs import log_softmax

DIRECTIONS = ("reverse", "forward")
TAIL_FLOOR = 1e-8


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x <= 0, stable at both ends (Maechler 2012); -inf at x = 0."""
    x = jnp.minimum(x, 0.0)
    safe = jnp.where(x < 0, x, -1.0)      # keep the untaken branch finite (no NaN gradient)
    out = jnp.where(safe > -0.6931, jnp.log(-jnp.expm1(safe)), jnp.log1p(-jnp.exp(safe)))
    return jnp.where(x < 0, out, -jnp.inf)


def check_topk(teacher_ids_BxTxK, teacher_logp_BxTxK, b: int, t: int, v: int) -> int:
    """The K of a top-k teacher signal, its shapes and dtypes checked against the student's
    [B, T, V]; K > V is refused."""
    _checks.check_rank("teacher_ids_BxTxK", teacher_ids_BxTxK, (3,), "[B, T, K]")
    k = teacher_ids_BxTxK.shape[-1]
    _checks.check_shape("teacher_ids_BxTxK", teacher_ids_BxTxK, (b, t, k), "[B, T, K]")
    _checks.check_shape("teacher_logp_BxTxK", teacher_logp_BxTxK, (b, t, k), "[B, T, K]")
    if not jnp.issubdtype(teacher_ids_BxTxK.dtype, jnp.integer):
        raise ValueError(f"teacher_ids_BxTxK must hold integer token ids, got dtype "
                         f"{teacher_ids_BxTxK.dtype}")
    if not 1 <= k <= v:
        raise ValueError(f"top-k teacher signal with K={k} tokens per position: expected "
                         f"1 <= K <= the vocabulary V={v}")
    return k


def topk_buckets(student_logp_BxTxV: jax.Array, teacher_ids_BxTxK: jax.Array,
                 teacher_logp_BxTxK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p [B, T, K+1], log q [B, T, K+1], floored [B, T]): student and teacher log-probs
    of the K teacher ids and the tail bucket (last); where every token is kept (K = V, every
    slot used) the tail bucket is -inf on both sides (empty). The teacher's tail is floored
    at TAIL_FLOOR (`floored` says where). An id < 0 marks an unused slot; an id >= V (no
    token of the student's) is treated as one: its mass stays in the tail."""
    v = student_logp_BxTxV.shape[-1]
    used_BxTxK = (teacher_ids_BxTxK >= 0) & (teacher_ids_BxTxK < v)
    ids_BxTxK = jnp.where(used_BxTxK, teacher_ids_BxTxK, 0)
    lp_BxTxK = jnp.take_along_axis(student_logp_BxTxV, ids_BxTxK, axis=-1, mode="clip")
    lp_BxTxK = jnp.where(used_BxTxK, lp_BxTxK, -jnp.inf)
    lq_BxTxK = jnp.where(used_BxTxK, teacher_logp_BxTxK.astype(lp_BxTxK.dtype), -jnp.inf)
    # Student tail: logsumexp over the tokens outside the teacher's used ids (exact); -inf
    # where every token is kept (K = V with every slot used), computed on a finite stand-in
    # there so its gradient stays finite.
    b, t = ids_BxTxK.shape[:2]
    count_BxTxV = jnp.zeros(student_logp_BxTxV.shape, jnp.int32).at[
        jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], ids_BxTxK].add(
        used_BxTxK.astype(jnp.int32))
    kept_BxTxV = count_BxTxV > 0
    has_tail_BxT = ~kept_BxTxV.all(-1)
    tail_in_BxTxV = jnp.where(kept_BxTxV, -jnp.inf, student_logp_BxTxV)
    lp_tail_BxT = jnp.where(has_tail_BxT, jax.nn.logsumexp(
        jnp.where(has_tail_BxT[..., None], tail_in_BxTxV, 0.0), -1), -jnp.inf)
    # Teacher tail: 1 - sum_k q_k, floored; empty where the student's is (no token is
    # outside the kept ones, so the teacher's remainder there is rounding).
    lq_tail_BxT = _log1mexp(jax.nn.logsumexp(lq_BxTxK, -1))
    floor = jnp.log(jnp.asarray(TAIL_FLOOR, lq_tail_BxT.dtype))
    floored_BxT = (lq_tail_BxT < floor) & has_tail_BxT
    lq_tail_BxT = jnp.where(has_tail_BxT, jnp.maximum(lq_tail_BxT, floor), -jnp.inf)
    return (jnp.concatenate([lp_BxTxK, lp_tail_BxT[..., None]], -1),
            jnp.concatenate([lq_BxTxK, lq_tail_BxT[..., None]], -1), floored_BxT)


def _bucket_kl(logp_a: jax.Array, logp_b: jax.Array) -> jax.Array:
    """KL(a || b) over the last axis; entries with a = 0 (log a = -inf) contribute 0."""
    p_a = jnp.exp(logp_a)
    safe_a = jnp.where(jnp.isneginf(logp_a), 0.0, logp_a)
    safe_b = jnp.where(jnp.isneginf(logp_a), 0.0, logp_b)
    return jnp.maximum((p_a * (safe_a - safe_b)).sum(-1), 0.0)


def topk_divergence(student_logits_BxTxV: jax.Array, teacher_ids_BxTxK: jax.Array,
                    teacher_logp_BxTxK: jax.Array, *, direction: str = "reverse",
                    temperature: float = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the per-token bucketed KL [B, T], per-token diagnostics [B, T]: teacher_topk_mass,
    student_topk_mass, tail_floored): the unreduced form of `topk_kl_loss`."""
    _checks.check_rank("student_logits_BxTxV", student_logits_BxTxV, (3,), "[B, T, V]")
    b, t, v = student_logits_BxTxV.shape
    check_topk(teacher_ids_BxTxK, teacher_logp_BxTxK, b, t, v)
    _checks.check_choice("direction", direction, DIRECTIONS)
    logp_BxTxV = log_softmax(student_logits_BxTxV, temperature)
    lp_BxTxB, lq_BxTxB, floored_BxT = topk_buckets(
        logp_BxTxV, teacher_ids_BxTxK, jax.lax.stop_gradient(teacher_logp_BxTxK))
    lq_BxTxB = jax.lax.stop_gradient(lq_BxTxB)
    div_BxT = (_bucket_kl(lp_BxTxB, lq_BxTxB) if direction == "reverse"
               else _bucket_kl(lq_BxTxB, lp_BxTxB))
    sg = jax.lax.stop_gradient
    return div_BxT, {"teacher_topk_mass": jnp.exp(lq_BxTxB[..., :-1]).sum(-1),
                     "student_topk_mass": jnp.exp(sg(lp_BxTxB[..., :-1])).sum(-1),
                     "tail_floored": floored_BxT.astype(jnp.float32)}


def topk_kl_loss(student_logits_BxTxV: jax.Array, teacher_ids_BxTxK: jax.Array,
                 teacher_logp_BxTxK: jax.Array, mask_BxT: jax.Array, *,
                 direction: str = "reverse", temperature: float = 1.0,
                 aggregation: str = "token_mean", max_len: int | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL between the student and a top-k teacher over the K + 1 buckets (module docstring):
    ``direction`` "reverse" is KL(p || q) (student first, mode-seeking, the OPD direction),
    "forward" is KL(q || p) (teacher first, verl's `forward_kl_topk`). `teacher_logp_BxTxK`
    are the teacher's log-probs at `temperature` (the student is scored at the same one).
    Teacher ids must be distinct per position (a top-k is).

    Example::

        loss, metrics = topk_kl_loss(student_BxTxV, ids_BxTxK, logq_BxTxK, mask_BxT)
    """
    _checks.check_rank("student_logits_BxTxV", student_logits_BxTxV, (3,), "[B, T, V]")
    _checks.check_shape("mask_BxT", mask_BxT, student_logits_BxTxV.shape[:2], "[B, T]")
    div_BxT, per = topk_divergence(student_logits_BxTxV, teacher_ids_BxTxK,
                                   teacher_logp_BxTxK, direction=direction,
                                   temperature=temperature)
    loss = aggregate(div_BxT, mask_BxT, aggregation, max_len=max_len)
    sg = jax.lax.stop_gradient
    metrics = {
        "loss": sg(loss),
        f"topk_{direction}_kl": masked_mean(sg(div_BxT), mask_BxT),
        "teacher_topk_mass": masked_mean(per["teacher_topk_mass"], mask_BxT),
        "student_topk_mass": masked_mean(per["student_topk_mass"], mask_BxT),
        "tail_floor_frac": masked_frac(per["tail_floored"] > 0, mask_BxT),
    }
    return loss, {name: x.astype(jnp.float32) for name, x in metrics.items()}


def teacher_topk(logits_BxTxV: jax.Array, k: int, temperature: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
    """(ids [B, T, K] int32, log-probs [B, T, K] fp32): a teacher's k most likely tokens per
    position under softmax(logits / temperature), most likely first (what an in-process
    teacher hands the top-k loss)."""
    v = logits_BxTxV.shape[-1]
    if not 1 <= int(k) <= v:
        raise ValueError(f"teacher top-k with k={k}: expected 1 <= k <= the vocabulary V={v}")
    logp = log_softmax(logits_BxTxV, temperature)
    vals, ids = jax.lax.top_k(logp, int(k))
    return ids.astype(jnp.int32), vals
