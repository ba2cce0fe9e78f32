"""Pallas kernels for TPU (Mosaic); on CPU they run with interpret=pltpu.InterpretParams().

Legend: N tokens, D student hidden, E teacher hidden, V vocab, C vocab chunk,
Bn/Bv token/vocab blocks (Bn a multiple of 8, Bv of 128 on a TPU).

stats:      grid (N/Bn, V/Bv), vocab axis "arbitrary": the online statistics live in
            VMEM scratch [Bn, 1] across vocab steps (the flash-attention pattern), and the
            BlockSpec pipeline streams [D, Bv] weight tiles while the MXU works.
grad_chunk: grid (N/Bn, C/Bv), both "parallel"; writes g [N, C]; the gradient GEMMs
            run in XLA (driver.backward).
Per-token vectors travel as [N, 1] so that every block is 2-D, as Mosaic wants.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common


def _interpret(cfg: common.Config):
    return pltpu.InterpretParams() if common.use_interpret(cfg) else False


def _tile(h_ref, w_ref, inv_temp: float):
    return common.dot_f32(h_ref[...], w_ref[...]) * inv_temp


def _stats_kernel(h_s_ref, w_s_ref, h_t_ref, w_t_ref, y_ref, lse_s_ref, lse_t_ref, ekl_ref, s_y_ref, t_y_ref,
                  *scratch, vocab: int, block_v: int, inv_temp: float):
    # program_id is hoisted: reading it inside a pl.when body fails under interpret mode.
    j, last = pl.program_id(1), pl.num_programs(1) - 1

    @pl.when(j == 0)
    def _init():
        for ref, value in zip(scratch, common.init_stats(scratch[0].shape)):
            ref[...] = value

    col_1xV = j * block_v + jax.lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    valid_1xV = col_1xV < vocab
    s = common.mask_logits(_tile(h_s_ref, w_s_ref, inv_temp), valid_1xV)
    t = common.mask_logits(_tile(h_t_ref, w_t_ref, inv_temp), valid_1xV)
    hit = (col_1xV == y_ref[...]) & valid_1xV  # a target of another vocab shard may hit padding
    new = common.update_stats(tuple(ref[...] for ref in scratch), s, t, hit)
    for ref, value in zip(scratch, new):
        ref[...] = value

    @pl.when(j == last)
    def _finalize():
        out = common.finalize_stats(tuple(ref[...] for ref in scratch))
        for ref, value in zip((lse_s_ref, lse_t_ref, ekl_ref, s_y_ref, t_y_ref), out):
            ref[...] = value


def _grad_kernel(col0_ref, h_s_ref, w_s_ref, h_t_ref, w_t_ref, y_ref, lse_s_ref, lse_t_ref, kl_ref, dkl_ref,
                 dlp_ref, g_ref, *, block_v: int, inv_temp: float, mode: str):
    j = pl.program_id(1)
    col_1xV = col0_ref[0] + j * block_v + jax.lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    s = _tile(h_s_ref, w_s_ref, inv_temp)
    t = _tile(h_t_ref, w_t_ref, inv_temp) if mode == "kl" else s
    g_ref[...] = common.grad_tile(s, t, col_1xV == y_ref[...], lse_s_ref[...], lse_t_ref[...], kl_ref[...],
                                  dkl_ref[...], dlp_ref[...], mode=mode, inv_temp=inv_temp)


def _rows(block_n, width):
    return pl.BlockSpec((block_n, width), lambda i, j: (i, 0))


def _cols(height, block_v):
    return pl.BlockSpec((height, block_v), lambda i, j: (0, j))


def _as_col(x_N, block_n):
    return common.pad_axis(x_N, 0, block_n)[:, None]


def stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg: common.Config):
    """-> (lse_s, lse_t, E_p[s - t], s_y, t_y), each [N] fp32 (see common.update_stats)."""
    n, vocab = h_s_NxD.shape[0], w_s_DxV.shape[1]
    bn, bv = cfg.block_n, cfg.block_v
    h_s, h_t = common.pad_axis(h_s_NxD, 0, bn), common.pad_axis(h_t_NxE, 0, bn)
    w_s, w_t = common.pad_axis(w_s_DxV, 1, bv), common.pad_axis(w_t_ExV, 1, bv)
    n_p, d, e = h_s.shape[0], h_s.shape[1], h_t.shape[1]
    kernel = functools.partial(_stats_kernel, vocab=vocab, block_v=bv, inv_temp=1.0 / cfg.temperature)
    out = pl.pallas_call(
        kernel,
        grid=(n_p // bn, w_s.shape[1] // bv),
        in_specs=[_rows(bn, d), _cols(d, bv), _rows(bn, e), _cols(e, bv), _rows(bn, 1)],
        out_specs=[_rows(bn, 1)] * 5,
        out_shape=[jax.ShapeDtypeStruct((n_p, 1), jnp.float32)] * 5,
        scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32)] * 7,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(cfg),
        name="fused_vocab_stats",
    )(h_s, w_s, h_t, w_t, _as_col(y_N, bn))
    return tuple(x[:n, 0] for x in out)


def grad_chunk(h_s_NxD, w_s_DxC, h_t_NxE, w_t_ExC, y_N, col0, lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N,
               cfg: common.Config):
    """g [N, C] fp32 (scaled by 1/temperature) for vocab columns [col0, col0 + C); C % Bv == 0."""
    n, chunk = h_s_NxD.shape[0], w_s_DxC.shape[1]
    bn, bv = cfg.block_n, cfg.block_v
    h_s, h_t = common.pad_axis(h_s_NxD, 0, bn), common.pad_axis(h_t_NxE, 0, bn)
    cols = [_as_col(x, bn) for x in (y_N, lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N)]
    d, e = h_s.shape[1], h_t.shape[1]
    kernel = functools.partial(_grad_kernel, block_v=bv, inv_temp=1.0 / cfg.temperature, mode=cfg.mode)
    g = pl.pallas_call(
        kernel,
        grid=(h_s.shape[0] // bn, chunk // bv),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), _rows(bn, d), _cols(d, bv), _rows(bn, e), _cols(e, bv)]
        + [_rows(bn, 1)] * 6,
        out_specs=pl.BlockSpec((bn, bv), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((h_s.shape[0], chunk), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret(cfg),
        name="fused_vocab_grad",
    )(jnp.reshape(jnp.asarray(col0, jnp.int32), (1,)), h_s, w_s_DxC, h_t, w_t_ExC, *cols)
    return g[:n]
