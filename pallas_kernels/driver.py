"""One custom_vjp shared by every backend: fused forward statistics, chunked recompute backward.

Legend: N tokens, D student hidden, E teacher hidden, V vocab, C vocab chunk.

Forward: a backend's `stats` gives per-token (lse_s, lse_t, E_p[s - t], s_y, t_y); only
lse_s, lse_t and KL (12 bytes a token) are saved. Backward: a loop over vocab chunks in
which the backend's `grad_chunk` recomputes the logit tiles and returns g [N, C]; two
GEMMs then give dh_s += g W_s,c^T and dW_s,c = h_s^T g. FLOPs: forward 2NV(D+E),
backward 2NV(D+E) + 4NVD (2NVD + 4NVD in logratio mode, which needs no teacher).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common, xla


def backend_module(name: str):
    if name == "xla":
        return xla
    if name == "triton":
        from pallas_kernels import triton   # lazy: a GPU backend, imported when picked
        return triton
    if name == "mosaic":
        from pallas_kernels import mosaic   # lazy: a TPU backend, imported when picked
        return mosaic
    raise ValueError(f"implementation={name!r}; expected 'xla', 'triton' or 'mosaic' here")


def forward_stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg: common.Config):
    """-> (kl, logp_s(y), logp_t(y), lse_s, lse_t), each [N] fp32."""
    stats = backend_module(cfg.implementation).stats
    lse_s, lse_t, ekl, s_y, t_y = stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg)
    return ekl - lse_s + lse_t, s_y - lse_s, t_y - lse_t, lse_s, lse_t


def backward(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N,
             cfg: common.Config, col_offset=0):
    """(dh_s [N, D], dW_s [D, V]) by chunks; col_offset shifts target ids (vocab shards)."""
    backend = backend_module(cfg.implementation)
    vocab = w_s_DxV.shape[1]
    align = 1 if cfg.implementation == "xla" else cfg.block_v
    w_s_p, w_t_p = common.pad_axis(w_s_DxV, 1, align), common.pad_axis(w_t_ExV, 1, align)
    vocab_p = w_s_p.shape[1]
    chunk = min(common.round_up(cfg.chunk_v, align), vocab_p)
    y_local = y_N - col_offset
    low = lambda x: x.astype(w_s_DxV.dtype)  # GEMMs in the input dtype, fp32 accumulation

    def body(c, carry):
        dh_NxD, dw_DxVp = carry
        start, lo = xla.chunk_bounds(c, chunk, vocab_p)
        w_s_DxC = lax.dynamic_slice_in_dim(w_s_p, start, chunk, axis=1)
        w_t_ExC = lax.dynamic_slice_in_dim(w_t_p, start, chunk, axis=1)
        g_NxC = backend.grad_chunk(h_s_NxD, w_s_DxC, h_t_NxE, w_t_ExC, y_local, start,
                                   lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N, cfg)
        col_C = start + jnp.arange(chunk)
        # Columns already handled by an earlier chunk, and vocab padding, get no gradient.
        g_NxC = low(jnp.where(((col_C >= lo) & (col_C < vocab))[None, :], g_NxC, 0.0))
        dh_NxD = dh_NxD + common.dot_f32(g_NxC, w_s_DxC.T)
        dw_DxC = common.dot_f32(h_s_NxD.T, g_NxC)
        old_DxC = lax.dynamic_slice_in_dim(dw_DxVp, start, chunk, axis=1)
        dw_DxVp = lax.dynamic_update_slice_in_dim(dw_DxVp, old_DxC + dw_DxC, start, axis=1)
        return dh_NxD, dw_DxVp

    init = (jnp.zeros(h_s_NxD.shape, jnp.float32), jnp.zeros((w_s_DxV.shape[0], vocab_p), jnp.float32))
    dh_NxD, dw_DxVp = lax.fori_loop(0, -(-vocab_p // chunk), body, init)
    return dh_NxD.astype(h_s_NxD.dtype), dw_DxVp[:, :vocab].astype(w_s_DxV.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def fused(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg: common.Config):
    """(kl, logp_s(y), logp_t(y)) per token; gradient to h_s, w_s only (see module doc)."""
    return forward_stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg)[:3]


def _fused_fwd(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg):
    kl, lp_s, lp_t, lse_s, lse_t = forward_stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg)
    return (kl, lp_s, lp_t), (h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, lse_s, lse_t, kl)


def _fused_bwd(cfg, res, cts):
    h_s, w_s, h_t, w_t, y, lse_s, lse_t, kl = res
    dkl, dlp_s, _ = cts  # logp_t is the teacher's: no gradient
    dh_s, dw_s = backward(h_s, w_s, h_t, w_t, y, lse_s, lse_t, kl, dkl, dlp_s, cfg)
    return dh_s, dw_s, None, None, None


fused.defvjp(_fused_fwd, _fused_bwd)
