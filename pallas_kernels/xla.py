"""Chunked-vocabulary implementation in plain XLA (the CPU default and the fallback).

Legend: N tokens, D student hidden, E teacher hidden, V vocab, C vocab chunk.

The forward is a fori_loop over vocab chunks carrying the online (m, l, a) statistics
of common.update_stats for all N tokens at once, so temporaries are O(N C), not O(N V).
A ragged last chunk is read at the clamped start V - C, and the columns an earlier chunk
already covered are masked: W is never padded or copied.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import common


def chunk_bounds(c, chunk: int, vocab: int):
    """Chunk c reads [start, start + chunk); columns below lo were already seen."""
    lo = c * chunk
    return jnp.minimum(lo, vocab - chunk), lo


def stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg: common.Config):
    """-> (lse_s, lse_t, E_p[s - t], s_y, t_y), each [N] fp32."""
    n, vocab = h_s_NxD.shape[0], w_s_DxV.shape[1]
    chunk = min(cfg.chunk_v, vocab)
    inv_temp = 1.0 / cfg.temperature

    def body(c, carry):
        start, lo = chunk_bounds(c, chunk, vocab)
        col_C = start + jnp.arange(chunk)
        valid_1xC = (col_C >= lo)[None, :]
        w_s_DxC = lax.dynamic_slice_in_dim(w_s_DxV, start, chunk, axis=1)
        w_t_ExC = lax.dynamic_slice_in_dim(w_t_ExV, start, chunk, axis=1)
        s_NxC = common.mask_logits(common.dot_f32(h_s_NxD, w_s_DxC) * inv_temp, valid_1xC)
        t_NxC = common.mask_logits(common.dot_f32(h_t_NxE, w_t_ExC) * inv_temp, valid_1xC)
        # The KL needs no target logits: skip the [N, C] target compare and its two sums.
        hit_NxC = None if cfg.mode == "kl" else (col_C[None, :] == y_N[:, None]) & valid_1xC
        return common.update_stats(carry, s_NxC, t_NxC, hit_NxC)

    out = lax.fori_loop(0, -(-vocab // chunk), body, common.init_stats((n,)))
    return common.finalize_stats(out)


def grad_chunk(h_s_NxD, w_s_DxC, h_t_NxE, w_t_ExC, y_N, col0, lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N,
               cfg: common.Config):
    """g [N, C] fp32 for the vocab columns [col0, col0 + C) (already scaled by 1/temperature)."""
    inv_temp = 1.0 / cfg.temperature
    col_C = col0 + jnp.arange(w_s_DxC.shape[1])
    s_NxC = common.dot_f32(h_s_NxD, w_s_DxC) * inv_temp
    t_NxC = common.dot_f32(h_t_NxE, w_t_ExC) * inv_temp if cfg.mode == "kl" else s_NxC
    hit_NxC = col_C[None, :] == y_N[:, None]
    return common.grad_tile(s_NxC, t_NxC, hit_NxC, lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N,
                            mode=cfg.mode, inv_temp=inv_temp)
