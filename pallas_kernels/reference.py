"""Full-logits fp32 specification of the fused kernels (memory O(N V): tests and small shapes only).

Legend: N tokens, D student hidden, E teacher hidden, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import dot_f32


def logits(h_NxD, w_DxV, temperature: float):
    """fp32 logits h W / temperature (bf16 inputs, fp32 accumulation)."""
    return dot_f32(h_NxD, w_DxV) / temperature


def reverse_kl_reference(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, *, temperature: float = 1.0):
    """KL(p_s || p_t) per token = sum_v p_s,v (log p_s,v - log p_t,v); teacher gets no gradient.

    >>> reverse_kl_reference(h, w, h, w).shape  # (N,), all zeros
    """
    logp_s_NxV = jax.nn.log_softmax(logits(h_s_NxD, w_s_DxV, temperature), axis=-1)
    t_NxV = logits(jax.lax.stop_gradient(h_t_NxE), jax.lax.stop_gradient(w_t_ExV), temperature)
    logp_t_NxV = jax.nn.log_softmax(t_NxV, axis=-1)
    return jnp.sum(jnp.exp(logp_s_NxV) * (logp_s_NxV - logp_t_NxV), axis=-1)


def clipped_log_ratio_reference(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, targets_N, *, r_max: float,
                                temperature: float = 1.0):
    """(logp_s(y), logp_t(y), r = clip(sg(logp_t - logp_s), -r_max, r_max)); gradient only via logp_s."""
    logp_s_NxV = jax.nn.log_softmax(logits(h_s_NxD, w_s_DxV, temperature), axis=-1)
    t_NxV = logits(jax.lax.stop_gradient(h_t_NxE), jax.lax.stop_gradient(w_t_ExV), temperature)
    logp_t_NxV = jax.nn.log_softmax(t_NxV, axis=-1)
    pick = lambda lp: jnp.take_along_axis(lp, targets_N[:, None].astype(jnp.int32), axis=-1)[:, 0]
    logp_s_N, logp_t_N = pick(logp_s_NxV), pick(logp_t_NxV)
    r_N = jnp.clip(jax.lax.stop_gradient(logp_t_N - logp_s_N), -r_max, r_max)
    return logp_s_N, logp_t_N, r_N
