"""Vocab-parallel fused ops: W sharded over V on a mesh axis, per-shard stats combined.

Legend: N tokens, D student hidden, E teacher hidden, V vocab, S vocab shards.

Each shard runs a backend's `stats` on its V/S columns and the shards combine
per-token numbers only (never [N, V]):
  lse   = m + log psum(e^(lse_k - m)),  m = pmax(lse_k)
  E_p[s - t] = psum(e^(lse_s,k - lse_s) E_pk[s - t])
  s_y   = psum(s_y,k)     (a target hits exactly one shard)
The backward runs driver.backward per shard with the global statistics; dh_s is a
psum over shards (and dW_s a psum over token shards when tokens are sharded too).
The custom_vjp sits outside the two shard_maps, so nothing differentiates through them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import common, driver


class Layout:
    """Where V and N live on the mesh (hashable: a custom_vjp nondiff arg)."""
    def __init__(self, mesh, vocab_axis: str, token_axis: str | tuple[str, ...] | None):
        if vocab_axis not in mesh.axis_names:
            raise ValueError(f"vocab_axis={vocab_axis!r} is not a mesh axis; mesh has {mesh.axis_names}")
        self.mesh, self.vocab_axis, self.token_axis = mesh, vocab_axis, token_axis

    def __hash__(self):
        return hash((self.mesh, self.vocab_axis, self.token_axis))

    def __eq__(self, other):
        return (self.mesh, self.vocab_axis, self.token_axis) == (other.mesh, other.vocab_axis, other.token_axis)

    def shard_map(self, fn, in_specs, out_specs):
        # pallas_call inside shard_map needs check_vma=False (see docs/kernels.md).
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _local_forward(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, *, cfg, layout):
    axis = layout.vocab_axis
    offset = jax.lax.axis_index(axis) * w_s_DxV.shape[1]
    backend = driver.backend_module(cfg.implementation)
    parts = backend.stats(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N - offset, cfg)
    lse_s, lse_t, ekl, s_y, t_y = common.combine_partial_stats(
        parts, lambda x: jax.lax.pmax(x, axis), lambda x: jax.lax.psum(x, axis))
    return ekl - lse_s + lse_t, s_y - lse_s, t_y - lse_t, lse_s, lse_t


def _local_backward(h_s, w_s, h_t, w_t, y, lse_s, lse_t, kl, dkl, dlp, *, cfg, layout):
    offset = jax.lax.axis_index(layout.vocab_axis) * w_s.shape[1]
    dh_s, dw_s = driver.backward(h_s, w_s, h_t, w_t, y, lse_s, lse_t, kl, dkl, dlp, cfg, col_offset=offset)
    dh_s = jax.lax.psum(dh_s.astype(jnp.float32), layout.vocab_axis).astype(h_s.dtype)
    if layout.token_axis is not None:
        dw_s = jax.lax.psum(dw_s.astype(jnp.float32), layout.token_axis).astype(w_s.dtype)
    return dh_s, dw_s


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def fused_sharded(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg: common.Config, layout: Layout):
    """(kl, logp_s(y), logp_t(y)) per token with V sharded on layout.vocab_axis."""
    return _fwd(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg, layout)[0]


def _fwd(h_s, w_s, h_t, w_t, y, cfg, layout):
    vocab = w_s.shape[1]
    shards = layout.mesh.shape[layout.vocab_axis]
    if vocab % shards:
        raise ValueError(f"vocab {vocab} is not divisible by the {shards} shards of axis {layout.vocab_axis!r}")
    rows, cols = P(layout.token_axis), P(None, layout.vocab_axis)
    fn = layout.shard_map(functools.partial(_local_forward, cfg=cfg, layout=layout),
                          in_specs=(rows, cols, rows, cols, rows), out_specs=(rows,) * 5)
    kl, lp_s, lp_t, lse_s, lse_t = fn(h_s, w_s, h_t, w_t, y)
    return (kl, lp_s, lp_t), (h_s, w_s, h_t, w_t, y, lse_s, lse_t, kl)


def _bwd(cfg, layout, res, cts):
    dkl, dlp_s, _ = cts  # the teacher's logp_t gets no gradient
    rows, cols = P(layout.token_axis), P(None, layout.vocab_axis)
    fn = layout.shard_map(functools.partial(_local_backward, cfg=cfg, layout=layout),
                          in_specs=(rows, cols, rows, cols) + (rows,) * 6, out_specs=(rows, cols))
    dh_s, dw_s = fn(*res, dkl, dlp_s)
    return dh_s, dw_s, None, None, None


fused_sharded.defvjp(_fwd, _bwd)
