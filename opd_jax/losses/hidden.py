"""Hidden-state entry points: the OPD losses without [B, T, V] logits (fused kernels).

Shape letters: K teachers, B batch, T tokens, D student hidden, E teacher hidden, V vocab.

Logits are h W / temperature; these functions take the last-layer hidden states and the
unembedding matrices instead and call `pallas_kernels` (implementation "auto": Triton on
GPU, Mosaic on TPU, chunked XLA elsewhere), so trainers never build full logits.
  reverse_kl_loss_from_hidden      == reverse_kl_loss(h_s W_s, h_t W_t, ...)   (DeepSeek-V4)
  sampled_token_logprobs_from_hidden -> (lp_theta(y), lp_T(y), r) for the sampled tokens
  kimi_mopd_loss_from_hidden       == kimi_mopd_loss(token_logprobs(...), ...)  (Kimi K3)
  glm_opd_loss_from_hidden         == glm_opd_loss(token_logprobs(...), ...)    (GLM-5.2)
Metrics: the logits losses' names, except that entropy/teacher_entropy (which need the full
distributions) are left out of reverse_kl_loss_from_hidden.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.losses import _checks
from opd_jax.losses.aggregation import aggregate, masked_mean
from opd_jax.losses.kl import weights_KxBxT
from opd_jax.losses.opd import glm_opd_loss, kimi_mopd_loss
from pallas_kernels import fused_clipped_log_ratio, fused_reverse_kl


def _flat(x_BxTxF):
    return x_BxTxF.reshape(-1, x_BxTxF.shape[-1])


def _check_hidden(h_s_BxTxD, w_s_DxV, mask_BxT):
    _checks.check_rank("h_s_BxTxD", h_s_BxTxD, (3,), "[B, T, D]")
    _checks.check_rank("w_s_DxV", w_s_DxV, (2,), "[D, V]")
    b, t, _ = h_s_BxTxD.shape
    _checks.check_shape("mask_BxT", mask_BxT, (b, t), "[B, T]")
    return b, t


def reverse_kl_loss_from_hidden(h_s_BxTxD, w_s_DxV, h_t, w_t, mask_BxT, *, weights=None,
                                temperature: float = 1.0, aggregation: str = "token_mean",
                                max_len: int | None = None, implementation: str = "auto", **kernel_kw):
    """Weighted full-vocabulary REVERSE KL (student first) from hidden states:

    L = aggregate_t( sum_k w_bk KL(p_bt || q_kbt) ), p = softmax(h_s W_s / tau),
    q_k = softmax(h_t,k W_t,k / tau). Teachers: h_t [B, T, E] with w_t [E, V], or stacked
    h_t [K, B, T, E] with w_t [K, E, V] and `weights` [K], [B, K] or per token [B, T, K]
    (default uniform), or
    sequences of K teachers h_t (K x [B, T, E_k]) and w_t (K x [E_k, V]) of any widths E_k
    (the routed form: teacher k's KL is computed only on tokens with weight > 0, and
    `reverse_kl_teacher{k}` averages over those tokens).
    Equals `reverse_kl_loss(h_s @ W_s, h_t @ W_t, mask, ...)`; the teacher gets no gradient.

    Example::

        loss, metrics = reverse_kl_loss_from_hidden(h_s_BxTxD, w_s_DxV, h_t_BxTxE, w_t_ExV, mask_BxT)
    """
    b, t = _check_hidden(h_s_BxTxD, w_s_DxV, mask_BxT)
    if isinstance(h_t, (tuple, list)):
        return _reverse_kl_teachers(h_s_BxTxD, w_s_DxV, tuple(h_t), tuple(w_t), mask_BxT,
                                    weights=weights, temperature=temperature,
                                    aggregation=aggregation, max_len=max_len,
                                    implementation=implementation, **kernel_kw)
    _checks.check_rank("h_t", h_t, (3, 4), "[B, T, E] or [K, B, T, E]")
    stacked = h_t.ndim == 4
    _checks.check_rank("w_t", w_t, (3,) if stacked else (2,), "[K, E, V]" if stacked else "[E, V]")
    if tuple(h_t.shape[-3:-1]) != (b, t):
        raise ValueError(f"h_t has [B, T] = {tuple(h_t.shape[-3:-1])}, expected the student's {(b, t)}")
    h_t_KxBxTxE, w_t_KxExV = (h_t, w_t) if stacked else (h_t[None], w_t[None])
    k = h_t_KxBxTxE.shape[0]
    if weights is not None and not stacked:
        raise ValueError(f"weights are for stacked [K, B, T, E] teachers; got a single teacher with weights "
                         f"of shape {tuple(jnp.shape(weights))}")
    if weights is not None:
        _checks.check_weights(weights, k, b, t)
    w_KxBxT = weights_KxBxT(weights, k, b, t)
    mask_N = mask_BxT.reshape(-1)
    h_s_NxD = _flat(h_s_BxTxD)
    kl_KxBxT = jnp.stack([
        fused_reverse_kl(h_s_NxD, w_s_DxV, _flat(h_t_KxBxTxE[i]), w_t_KxExV[i], mask_N=mask_N,
                         temperature=temperature, implementation=implementation, **kernel_kw).reshape(b, t)
        for i in range(k)])
    div_BxT = (w_KxBxT * kl_KxBxT).sum(0)
    loss = aggregate(div_BxT, mask_BxT, aggregation, max_len=max_len)
    sg = jax.lax.stop_gradient
    metrics = {"loss": sg(loss), "reverse_kl": masked_mean(sg(div_BxT), mask_BxT)}
    if stacked:
        for i in range(k):
            metrics[f"reverse_kl_teacher{i}"] = masked_mean(sg(kl_KxBxT[i]), mask_BxT)
    return loss, {name: x.astype(jnp.float32) for name, x in metrics.items()}


def _reverse_kl_teachers(h_s_BxTxD, w_s_DxV, h_t, w_t, mask_BxT, *, weights, temperature,
                         aggregation, max_len, implementation, **kernel_kw):
    """reverse_kl_loss_from_hidden for K teachers given as sequences (widths may differ)."""
    b, t = mask_BxT.shape
    k = len(h_t)
    if k == 0 or len(w_t) != k:
        raise ValueError(f"h_t and w_t are sequences of {len(h_t)} and {len(w_t)} teachers: "
                         f"expected the same positive number")
    for i, (h, w) in enumerate(zip(h_t, w_t)):
        _checks.check_shape(f"h_t[{i}]", h, (b, t, h.shape[-1]), "[B, T, E]")
        _checks.check_shape(f"w_t[{i}]", w, (h.shape[-1], w_s_DxV.shape[1]), "[E, V]")
    if weights is not None:
        _checks.check_weights(weights, k, b, t)
    w_KxBxT = weights_KxBxT(weights, k, b, t)
    sg = jax.lax.stop_gradient
    m = mask_BxT.astype(jnp.float32)
    h_s_NxD = _flat(h_s_BxTxD)
    div_BxT = jnp.zeros((b, t), jnp.float32)
    metrics = {}
    for i in range(k):
        routed_BxT = m * (w_KxBxT[i] > 0)
        kl_BxT = fused_reverse_kl(h_s_NxD, w_s_DxV, _flat(h_t[i]), w_t[i],
                                  mask_N=routed_BxT.reshape(-1), temperature=temperature,
                                  implementation=implementation, **kernel_kw).reshape(b, t)
        div_BxT = div_BxT + w_KxBxT[i] * kl_BxT
        metrics[f"reverse_kl_teacher{i}"] = masked_mean(sg(kl_BxT), routed_BxT)
    loss = aggregate(div_BxT, mask_BxT, aggregation, max_len=max_len)
    metrics = {"loss": sg(loss), "reverse_kl": masked_mean(sg(div_BxT), mask_BxT)} | metrics
    return loss, {name: x.astype(jnp.float32) for name, x in metrics.items()}


def sampled_token_logprobs_from_hidden(h_s_BxTxD, w_s_DxV, h_t_BxTxE, w_t_ExV, targets_BxT, mask_BxT, *,
                                       r_max: float, temperature: float = 1.0, implementation: str = "auto",
                                       **kernel_kw):
    """(lp_theta(y) [B, T], lp_T(y) [B, T], r [B, T]) of the sampled tokens y, in fp32.

    r = clip(sg(lp_T - lp_theta), -r_max, r_max); gradient only through lp_theta; masked
    tokens give zeros. Feed the first two to kimi_mopd_loss / glm_opd_loss.

    Example::

        lp, lp_t, r = sampled_token_logprobs_from_hidden(h_s, w_s, h_t, w_t, y_BxT, mask_BxT, r_max=5.0)
    """
    b, t = _check_hidden(h_s_BxTxD, w_s_DxV, mask_BxT)
    _checks.check_rank("h_t_BxTxE", h_t_BxTxE, (3,), "[B, T, E]")
    _checks.check_shape("targets_BxT", targets_BxT, (b, t), "[B, T]")
    outs = fused_clipped_log_ratio(_flat(h_s_BxTxD), w_s_DxV, _flat(h_t_BxTxE), w_t_ExV, targets_BxT.reshape(-1),
                                   r_max=r_max, mask_N=mask_BxT.reshape(-1), temperature=temperature,
                                   implementation=implementation, **kernel_kw)
    return tuple(x.reshape(b, t) for x in outs)


def kimi_mopd_loss_from_hidden(h_s_BxTxD, w_s_DxV, h_t_BxTxE, w_t_ExV, targets_BxT, mask_BxT, *, r_max: float,
                               temperature: float = 1.0, implementation: str = "auto", kernel_kw=None, **loss_kw):
    """kimi_mopd_loss on fused sampled-token log-probs; loss_kw go to kimi_mopd_loss."""
    lp, lp_t, _ = sampled_token_logprobs_from_hidden(h_s_BxTxD, w_s_DxV, h_t_BxTxE, w_t_ExV, targets_BxT, mask_BxT,
                                                     r_max=r_max, temperature=temperature,
                                                     implementation=implementation, **(kernel_kw or {}))
    return kimi_mopd_loss(lp, lp_t, mask_BxT, r_max=r_max, **loss_kw)


def glm_opd_loss_from_hidden(h_s_BxTxD, w_s_DxV, h_t_BxTxE, w_t_ExV, targets_BxT, old_logp_BxT, mask_BxT, *,
                             temperature: float = 1.0, implementation: str = "auto", kernel_kw=None, **loss_kw):
    """glm_opd_loss on fused sampled-token log-probs; loss_kw go to glm_opd_loss."""
    # r is unused here (GLM uses lp_T - lp_old); any positive r_max serves the kernel.
    lp, lp_t, _ = sampled_token_logprobs_from_hidden(h_s_BxTxD, w_s_DxV, h_t_BxTxE, w_t_ExV, targets_BxT, mask_BxT,
                                                     r_max=1.0, temperature=temperature,
                                                     implementation=implementation, **(kernel_kw or {}))
    return glm_opd_loss(lp, old_logp_BxT, lp_t, mask_BxT, **loss_kw)
