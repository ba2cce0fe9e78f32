"""One-pass value-and-gradient of a weighted reverse-KL loss (the CPU fast path).

Legend: N tokens, D student hidden, E teacher hidden, V vocab, B token block.

For L = sum_n w_n KL(p_s,n || p_t,n) with fixed (non-differentiated) weights w, the
per-token cotangent is w_n itself, so the gradient can be formed in the forward pass
(the fused-linear-loss trick of Liger-Kernel): a loop over token blocks holds one
[B, V] pair of logit rows, takes the exact softmax statistics, and emits
dh_s,b = G_b W_s^T and dW_s += h_s,b^T G_b with G = w p_s (log p_s - log p_t - KL) / T.
That is 2NV(D+E) + 4NVD FLOPs, the same as full-logits autodiff, with O(B V) temporaries;
the per-token custom_vjp (driver.py) instead recomputes the logits in its backward.
The backward of this custom_vjp only scales the saved gradients by the cotangent.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common


def _blocks(h_s_NxD, h_t_NxE, w_N, block_n):
    pad = lambda x: common.pad_axis(x, 0, block_n)
    h_s, h_t, w = pad(h_s_NxD), pad(h_t_NxE), pad(w_N)  # padded rows get weight 0
    return h_s, h_t, w, h_s.shape[0] // block_n


def _block_terms(h_s_BxD, w_s_DxV, h_t_BxE, w_t_ExV, inv_temp):
    logp_s_BxV = jax.nn.log_softmax(common.dot_f32(h_s_BxD, w_s_DxV) * inv_temp, axis=-1)
    logp_t_BxV = jax.nn.log_softmax(common.dot_f32(h_t_BxE, w_t_ExV) * inv_temp, axis=-1)
    p_BxV = jnp.exp(logp_s_BxV)
    diff_BxV = logp_s_BxV - logp_t_BxV
    return p_BxV, diff_BxV, jnp.sum(p_BxV * diff_BxV, axis=-1)


def _value(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, weights_N, block_n, temperature):
    h_s, h_t, w, nb = _blocks(h_s_NxD, h_t_NxE, weights_N, block_n)

    def body(b, total):
        rows = lambda x: lax.dynamic_slice_in_dim(x, b * block_n, block_n, axis=0)
        _, _, kl_B = _block_terms(rows(h_s), w_s_DxV, rows(h_t), w_t_ExV, 1.0 / temperature)
        return total + jnp.sum(rows(w) * kl_B)

    return lax.fori_loop(0, nb, body, jnp.zeros((), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def weighted_reverse_kl(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, weights_N, block_n: int, temperature: float):
    """sum_n weights_n KL(p_s,n || p_t,n); gradient to h_s, w_s only."""
    return _value(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, weights_N, block_n, temperature)


def _fwd(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, weights_N, block_n, temperature):
    n = h_s_NxD.shape[0]
    h_s, h_t, w, nb = _blocks(h_s_NxD, h_t_NxE, weights_N.astype(jnp.float32), block_n)
    inv_temp = 1.0 / temperature
    low = lambda x: x.astype(w_s_DxV.dtype)

    def body(b, carry):
        total, dh_NxD, dw_DxV = carry
        rows = lambda x: lax.dynamic_slice_in_dim(x, b * block_n, block_n, axis=0)
        h_s_BxD, w_B = rows(h_s), rows(w)
        p_BxV, diff_BxV, kl_B = _block_terms(h_s_BxD, w_s_DxV, rows(h_t), w_t_ExV, inv_temp)
        g_BxV = low(p_BxV * (diff_BxV - kl_B[:, None]) * (w_B * inv_temp)[:, None])
        dh_NxD = lax.dynamic_update_slice_in_dim(dh_NxD, common.dot_f32(g_BxV, w_s_DxV.T), b * block_n, axis=0)
        dw_DxV = dw_DxV + common.dot_f32(h_s_BxD.T, g_BxV)
        return total + jnp.sum(w_B * kl_B), dh_NxD, dw_DxV

    init = (jnp.zeros((), jnp.float32), jnp.zeros(h_s.shape, jnp.float32), jnp.zeros(w_s_DxV.shape, jnp.float32))
    total, dh, dw = lax.fori_loop(0, nb, body, init)
    return total, (dh[:n].astype(h_s_NxD.dtype), dw.astype(w_s_DxV.dtype))


def _bwd(block_n, temperature, res, ct):
    dh, dw = res  # the teacher and the weights get no gradient
    return (ct * dh).astype(dh.dtype), (ct * dw).astype(dw.dtype), None, None, None


weighted_reverse_kl.defvjp(_fwd, _bwd)
