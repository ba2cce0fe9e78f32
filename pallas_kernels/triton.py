"""Pallas kernels lowered to Triton (GPU); on CPU they run with interpret=True.

Legend: N tokens, D student hidden, E teacher hidden, V vocab, C vocab chunk,
Bn/Bv/Bd token/vocab/hidden blocks (powers of two on a GPU; D, E multiples of Bd).

stats:      grid (N/Bn, S); program (i, k) walks the k-th of S contiguous runs of vocab
            tiles with the online recurrence (common.update_stats), each [Bn, Bv] logit
            tile built from [Bn, Bd] x [Bd, Bv] dots, so no tile larger than
            Bn x max(Bd, Bv) is live. The S partial statistics merge in XLA
            (common.combine_partial_stats); S > 1 keeps all SMs busy when N/Bn is small.
grad_chunk: grid (N/Bn, C/Bv); recomputes the logit tiles of one vocab chunk and
            writes g [N, C]; the two gradient GEMMs run in XLA (driver.backward).
Only static-size pl.ds slices with traced starts are used: Triton lowers those to
pointer arithmetic. Ragged N and V are zero-padded here and masked by column id.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common


def _hidden_block(dim: int, block_d: int) -> int:
    return block_d if dim % block_d == 0 else dim


def _logit_tile(h_ref, w_ref, col0, block_v: int, block_d: int, inv_temp: float):
    """[Bn, Bv] fp32 tile h[:, :] @ w[:, col0:col0+Bv] / T, accumulated over hidden chunks."""
    dim = h_ref.shape[1]
    bd = _hidden_block(dim, block_d)

    def body(k, acc):
        h = h_ref[:, pl.ds(k * bd, bd)]
        w = w_ref[pl.ds(k * bd, bd), pl.ds(col0, block_v)]
        return acc + common.dot_f32(h, w)

    acc = jnp.zeros((h_ref.shape[0], block_v), jnp.float32)
    return lax.fori_loop(0, dim // bd, body, acc) * inv_temp


def _stats_kernel(h_s_ref, w_s_ref, h_t_ref, w_t_ref, y_ref, lse_s_ref, lse_t_ref, ekl_ref, s_y_ref, t_y_ref,
                  *, vocab: int, block_v: int, block_d: int, inv_temp: float, tiles_per_split: int):
    y_B = y_ref[...]
    last_tile = w_s_ref.shape[1] // block_v - 1
    first = pl.program_id(1) * tiles_per_split

    def body(j, carry):
        # The last split may run past the vocab: clamp the tile (in-bounds loads) and let
        # the column mask below drop the repeat.
        tile = jnp.minimum(first + j, last_tile)
        col0 = tile * block_v
        col_V = col0 + jnp.arange(block_v)
        valid_1xV = ((col_V < vocab) & (first + j <= last_tile))[None, :]
        s = common.mask_logits(_logit_tile(h_s_ref, w_s_ref, col0, block_v, block_d, inv_temp), valid_1xV)
        t = common.mask_logits(_logit_tile(h_t_ref, w_t_ref, col0, block_v, block_d, inv_temp), valid_1xV)
        return common.update_stats(carry, s, t, (col_V[None, :] == y_B[:, None]) & valid_1xV)

    out = common.finalize_stats(lax.fori_loop(0, tiles_per_split, body, common.init_stats(y_B.shape)))
    for ref, value in zip((lse_s_ref, lse_t_ref, ekl_ref, s_y_ref, t_y_ref), out):
        ref[...] = value


def _grad_kernel(h_s_ref, w_s_ref, h_t_ref, w_t_ref, y_ref, col0_ref, lse_s_ref, lse_t_ref, kl_ref, dkl_ref,
                 dlp_ref, g_ref, *, block_v: int, block_d: int, inv_temp: float, mode: str):
    j = pl.program_id(1)
    local0 = j * block_v
    col_V = col0_ref[0] + local0 + jnp.arange(block_v)
    s = _logit_tile(h_s_ref, w_s_ref, local0, block_v, block_d, inv_temp)
    t = _logit_tile(h_t_ref, w_t_ref, local0, block_v, block_d, inv_temp) if mode == "kl" else s
    hit = col_V[None, :] == y_ref[...][:, None]
    g_ref[...] = common.grad_tile(s, t, hit, lse_s_ref[...], lse_t_ref[...], kl_ref[...], dkl_ref[...],
                                  dlp_ref[...], mode=mode, inv_temp=inv_temp)


def _splits(cfg: common.Config, token_blocks: int, tiles: int) -> tuple[int, int]:
    """(S, tiles per split): auto aims at >= 256 programs (about 2 per SM on an H100/H200)."""
    want = cfg.vocab_splits or -(-256 // token_blocks)
    per = -(-tiles // max(1, min(want, tiles)))
    return -(-tiles // per), per


def _row_spec(block_n):
    return pl.BlockSpec((block_n,), lambda i, *_: (i,))


def _rows_spec(block_n, width):
    return pl.BlockSpec((block_n, width), lambda i, *_: (i, 0))


def _full_spec(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _compiler_params(block_n: int, block_v: int):
    return pltriton.CompilerParams(num_warps=4 if block_n * block_v <= 64 * 128 else 8, num_stages=2)


def stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg: common.Config):
    """-> (lse_s, lse_t, E_p[s - t], s_y, t_y), each [N] fp32 (see common.update_stats)."""
    n, vocab = h_s_NxD.shape[0], w_s_DxV.shape[1]
    bn, bv = cfg.block_n, cfg.block_v
    h_s, h_t, y = (common.pad_axis(x, 0, bn) for x in (h_s_NxD, h_t_NxE, y_N))
    w_s, w_t = common.pad_axis(w_s_DxV, 1, bv), common.pad_axis(w_t_ExV, 1, bv)
    n_p = h_s.shape[0]
    splits, per = _splits(cfg, n_p // bn, w_s.shape[1] // bv)
    kernel = functools.partial(_stats_kernel, vocab=vocab, block_v=bv, block_d=cfg.block_d,
                               inv_temp=1.0 / cfg.temperature, tiles_per_split=per)
    out = pl.pallas_call(
        kernel,
        grid=(n_p // bn, splits),
        in_specs=[_rows_spec(bn, h_s.shape[1]), _full_spec(w_s.shape), _rows_spec(bn, h_t.shape[1]),
                  _full_spec(w_t.shape), _row_spec(bn)],
        out_specs=[pl.BlockSpec((None, bn), lambda i, k: (k, i))] * 5,
        out_shape=[jax.ShapeDtypeStruct((splits, n_p), jnp.float32)] * 5,
        compiler_params=_compiler_params(bn, bv),
        interpret=common.use_interpret(cfg),
        name="fused_vocab_stats",
    )(h_s, w_s, h_t, w_t, y)
    merged = common.combine_partial_stats(out, lambda x: jnp.max(x, axis=0), lambda x: jnp.sum(x, axis=0))
    return tuple(x[:n] for x in merged)


def grad_chunk(h_s_NxD, w_s_DxC, h_t_NxE, w_t_ExC, y_N, col0, lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N,
               cfg: common.Config):
    """g [N, C] fp32 (scaled by 1/temperature) for vocab columns [col0, col0 + C); C % Bv == 0."""
    n, chunk = h_s_NxD.shape[0], w_s_DxC.shape[1]
    bn, bv = cfg.block_n, cfg.block_v
    rows = [common.pad_axis(x, 0, bn) for x in (h_s_NxD, h_t_NxE, y_N, lse_s_N, lse_t_N, kl_N, dkl_N, dlp_N)]
    h_s, h_t, y, lse_s, lse_t, kl, dkl, dlp = rows
    col0_1 = jnp.reshape(jnp.asarray(col0, jnp.int32), (1,))
    kernel = functools.partial(_grad_kernel, block_v=bv, block_d=cfg.block_d, inv_temp=1.0 / cfg.temperature,
                               mode=cfg.mode)
    g = pl.pallas_call(
        kernel,
        grid=(h_s.shape[0] // bn, chunk // bv),
        in_specs=[_rows_spec(bn, h_s.shape[1]), _full_spec(w_s_DxC.shape), _rows_spec(bn, h_t.shape[1]),
                  _full_spec(w_t_ExC.shape), _row_spec(bn), _full_spec((1,))] + [_row_spec(bn)] * 5,
        out_specs=pl.BlockSpec((bn, bv), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((h_s.shape[0], chunk), jnp.float32),
        compiler_params=_compiler_params(bn, bv),
        interpret=common.use_interpret(cfg),
        name="fused_vocab_grad",
    )(h_s, w_s_DxC, h_t, w_t_ExC, y, col0_1, lse_s, lse_t, kl, dkl, dlp)
    return g[:n]
