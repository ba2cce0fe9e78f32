"""Public ops: fused full-vocabulary reverse KL and fused clipped log-ratio.

Legend: N tokens, D student hidden, E teacher hidden, V vocab.

Both take last-layer hidden states and unembedding matrices; no [N, V] array is built
except by implementation="reference" (the specification).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common, driver, onepass, reference, sharded, tuning


def _config(implementation, mode, temperature, knobs, interpret, h_s_NxD, w_s_DxV, h_t_NxE):
    """Knobs left None come from the tuned table (triton) or tuning.DEFAULTS."""
    impl = common.resolve_implementation(implementation)
    (n, d), (e, v) = h_s_NxD.shape, (h_t_NxE.shape[1], w_s_DxV.shape[1])
    cfg = common.Config(implementation=impl, mode=mode,
                        temperature=float(temperature) if isinstance(temperature, (int, float)) else temperature,
                        interpret=interpret, **tuning.resolve(impl, knobs, n, d, e, v, h_s_NxD.dtype))
    common.check_config(cfg)
    return cfg


def _fused(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg, mesh, vocab_axis, token_axis):
    """Single-device driver, or the vocab-parallel one when a mesh is given."""
    if mesh is None:
        return driver.fused(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg)
    layout = sharded.Layout(mesh, vocab_axis, token_axis)
    return sharded.fused_sharded(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg, layout)


def _apply_mask(mask_N, h_s_NxD, h_t_NxE, y_N):
    """Masked tokens get zero hidden states (finite, uniform) and target 0; outputs zeroed later."""
    if mask_N is None:
        return h_s_NxD, h_t_NxE, y_N
    keep_Nx1 = mask_N.astype(bool)[:, None]
    return (jnp.where(keep_Nx1, h_s_NxD, 0), jnp.where(keep_Nx1, h_t_NxE, 0),
            None if y_N is None else jnp.where(mask_N.astype(bool), y_N, 0))


def fused_reverse_kl(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, *, mask_N=None, temperature: float = 1.0,
                     implementation: str = "auto", block_n: int | None = None,
                     block_v: int | None = None, block_d: int | None = None, chunk_v: int | None = None,
                     interpret: bool | None = None, vocab_splits: int | None = None, mesh=None,
                     vocab_axis: str = "tensor", token_axis=None):
    """Per-token reverse KL(p_s || p_t) in fp32, p = softmax(h W / temperature), STUDENT FIRST.

    KL_n = sum_v p_s,nv (log p_s,nv - log p_t,nv). Differentiable in h_s and w_s; the
    teacher (h_t, w_t) gets no gradient. Masked tokens (mask_N == 0) give 0 and no gradient.
    With `mesh`, W is vocab-parallel: sharded over V on `vocab_axis` (tokens optionally on
    `token_axis`), per-shard (max, sum, acc) combined with pmax/psum; same result.
    Block sizes left None: "triton" takes them from its tuned table for this device and
    shape class (pallas_kernels/tuning.py), every other case from tuning.DEFAULTS.

    >>> kl_N = fused_reverse_kl(h_s, w_s, h_t, w_t, temperature=1.0)  # [N] fp32
    >>> loss = jnp.sum(kl_N * mask_N) / jnp.sum(mask_N)
    """
    n, _ = common.check_inputs(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, None, mask_N)
    knobs = dict(block_n=block_n, block_v=block_v, block_d=block_d, chunk_v=chunk_v, vocab_splits=vocab_splits)
    cfg = _config(implementation, "kl", temperature, knobs, interpret, h_s_NxD, w_s_DxV, h_t_NxE)
    h_s_NxD, h_t_NxE, _ = _apply_mask(mask_N, h_s_NxD, h_t_NxE, None)
    if cfg.implementation == "reference":
        kl_N = reference.reverse_kl_reference(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, temperature=cfg.temperature)
    else:
        y_N = jnp.zeros((n,), jnp.int32)
        kl_N = _fused(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg, mesh, vocab_axis, token_axis)[0]
    return kl_N if mask_N is None else jnp.where(mask_N.astype(bool), kl_N, 0.0)


def fused_clipped_log_ratio(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, targets_N, *, r_max: float,
                            mask_N=None, temperature: float = 1.0, implementation: str = "auto",
                            block_n: int | None = None, block_v: int | None = None,
                            block_d: int | None = None, chunk_v: int | None = None,
                            interpret: bool | None = None, vocab_splits: int | None = None, mesh=None,
                     vocab_axis: str = "tensor", token_axis=None):
    """(logp_s(y), logp_t(y), r) per token, r = clip(sg(logp_t - logp_s), -r_max, r_max).

    Gradient flows only through logp_s (d logp_s / d s_v = 1[v = y] - p_v); logp_t and r
    carry none. Masked tokens give zeros. Targets must lie in [0, V) where unmasked.
    `mesh`/`vocab_axis`/`token_axis`: vocab-parallel, as in fused_reverse_kl.

    >>> lp_s, lp_t, r = fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y, r_max=5.0)
    >>> loss = -jnp.mean(r * lp_s)   # Kimi MOPD dense advantage
    """
    n, _ = common.check_inputs(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, targets_N, mask_N)
    if not (isinstance(r_max, (int, float)) and r_max > 0):
        raise ValueError(f"r_max={r_max!r}; expected a float > 0")
    knobs = dict(block_n=block_n, block_v=block_v, block_d=block_d, chunk_v=chunk_v, vocab_splits=vocab_splits)
    cfg = _config(implementation, "logratio", temperature, knobs, interpret, h_s_NxD, w_s_DxV, h_t_NxE)
    h_s_NxD, h_t_NxE, y_N = _apply_mask(mask_N, h_s_NxD, h_t_NxE, targets_N.astype(jnp.int32))
    if cfg.implementation == "reference":
        lp_s, lp_t, r = reference.clipped_log_ratio_reference(
            h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, r_max=r_max, temperature=cfg.temperature)
    else:
        _, lp_s, lp_t = _fused(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, y_N, cfg, mesh, vocab_axis, token_axis)
        lp_t = jax.lax.stop_gradient(lp_t)
        r = jnp.clip(jax.lax.stop_gradient(lp_t - lp_s), -r_max, r_max)
    if mask_N is None:
        return lp_s, lp_t, r
    keep = mask_N.astype(bool)
    return jnp.where(keep, lp_s, 0.0), jnp.where(keep, lp_t, 0.0), jnp.where(keep, r, 0.0)


def fused_reverse_kl_loss(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, weights_N, *, temperature: float = 1.0,
                          implementation: str = "auto", block_n: int | None = None, **kernel_kw):
    """Scalar sum_n weights_n KL(p_s,n || p_t,n) (reverse KL, student first); weights get no gradient.

    With fixed weights (mask / count, times a teacher weight) the gradient is formed in
    the forward pass: "xla" then runs one pass over [block_n, V] rows (onepass.py), the
    FLOPs of full-logits autodiff in O(block_n V) memory. Other implementations weight
    fused_reverse_kl. Masked tokens are those with weight 0.

    >>> loss = fused_reverse_kl_loss(h_s, w_s, h_t, w_t, mask_N / mask_N.sum())
    """
    n, _ = common.check_inputs(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, None, weights_N)
    impl = common.resolve_implementation(implementation)
    if impl == "xla" and "mesh" not in kernel_kw:
        cfg = _config(impl, "kl", temperature, dict(block_n=block_n), None, h_s_NxD, w_s_DxV, h_t_NxE)
        return onepass.weighted_reverse_kl(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, weights_N, cfg.block_n,
                                           cfg.temperature)
    kl_N = fused_reverse_kl(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, mask_N=weights_N != 0, temperature=temperature,
                            implementation=impl, block_n=block_n, **kernel_kw)
    return jnp.sum(jax.lax.stop_gradient(weights_N).astype(jnp.float32) * kl_N)
