"""Shared pieces of the fused vocabulary kernels: config, input checks, tile math.

Legend: N tokens, D student hidden, E teacher hidden, V vocab, C vocab chunk,
Bn/Bv/Bd token/vocab/hidden block sizes.

Every backend (xla, triton, mosaic) computes the same per-token statistics in one
pass over vocab tiles, with the online-softmax recurrence (docs/kernels.md):
  m <- max(m, max_v s_v);  l <- l e^(m_old - m) + sum_v e^(s_v - m)
  a <- a e^(m_old - m) + sum_v e^(s_v - m) (s_v - t_v)
so that lse = m + log l and E_p[s - t] = a / l; the reverse KL is
  KL(p||q) = E_p[s - t] - lse_s + lse_t.
The tile functions below are plain jnp, so they run inside Pallas kernels too.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# Finite, so masked columns give s - t = 0 and exp(MASK - m) = 0 without inf - inf NaNs.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
IMPLEMENTATIONS = ("auto", "reference", "xla", "triton", "mosaic")
MODES = ("kl", "logratio")


@dataclasses.dataclass(frozen=True)
class Config:
    """Static knobs of one fused call (hashable: it is a custom_vjp nondiff arg)."""
    implementation: str
    mode: str = "kl"
    temperature: float = 1.0
    block_n: int = 64
    block_v: int = 128
    block_d: int = 128
    chunk_v: int = 8192  # vocab chunk of the backward (and of the xla forward)
    vocab_splits: int = 0  # triton forward: programs per token block along V (0: auto)
    interpret: bool | None = None  # None: interpret exactly when running on CPU


def resolve_implementation(implementation: str) -> str:
    """'auto' -> triton on GPU, mosaic on TPU, xla elsewhere."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; expected one of {IMPLEMENTATIONS}")
    if implementation != "auto":
        return implementation
    backend = jax.default_backend()
    return {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic"}.get(backend, "xla")


def use_interpret(cfg: Config) -> bool:
    return jax.default_backend() == "cpu" if cfg.interpret is None else bool(cfg.interpret)


def check_inputs(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, targets_N=None, mask_N=None) -> tuple[int, int]:
    """Shape/dtype checks at trace time; returns (N, V)."""
    for name, x in (("h_s", h_s_NxD), ("w_s", w_s_DxV), ("h_t", h_t_NxE), ("w_t", w_t_ExV)):
        if x.ndim != 2:
            raise ValueError(f"{name} has shape {x.shape}; expected a rank-2 array")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} has dtype {x.dtype}; expected a floating dtype")
    n, d = h_s_NxD.shape
    if w_s_DxV.shape[0] != d:
        raise ValueError(f"w_s has shape {w_s_DxV.shape}; expected [D={d}, V] to match h_s {h_s_NxD.shape}")
    if h_t_NxE.shape[0] != n:
        raise ValueError(f"h_t has {h_t_NxE.shape[0]} tokens; expected N={n} like h_s")
    if w_t_ExV.shape[0] != h_t_NxE.shape[1]:
        raise ValueError(f"w_t has shape {w_t_ExV.shape}; expected [E={h_t_NxE.shape[1]}, V] to match h_t")
    v = w_s_DxV.shape[1]
    if w_t_ExV.shape[1] != v:
        raise ValueError(f"teacher vocab {w_t_ExV.shape[1]} != student vocab {v}")
    if targets_N is not None:
        if targets_N.shape != (n,) or not jnp.issubdtype(targets_N.dtype, jnp.integer):
            raise ValueError(f"targets has shape {targets_N.shape} dtype {targets_N.dtype}; expected int [N={n}]")
    if mask_N is not None and mask_N.shape != (n,):
        raise ValueError(f"mask has shape {mask_N.shape}; expected [N={n}]")
    return n, v


def check_config(cfg: Config) -> None:
    if not (isinstance(cfg.temperature, (int, float)) and math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ValueError(f"temperature={cfg.temperature!r}; expected a finite float > 0")
    if cfg.mode not in MODES:
        raise ValueError(f"mode={cfg.mode!r}; expected one of {MODES}")
    if not (isinstance(cfg.vocab_splits, int) and cfg.vocab_splits >= 0):
        raise ValueError(f"vocab_splits={cfg.vocab_splits!r}; expected an int >= 0 (0: auto)")
    for name in ("block_n", "block_v", "block_d", "chunk_v"):
        value = getattr(cfg, name)
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name}={value!r}; expected a positive int")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, multiple: int):
    """Zero-pads `axis` up to a multiple; no copy when already aligned."""
    size = x.shape[axis]
    extra = round_up(size, multiple) - size
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def dot_f32(a, b):
    """a @ b with fp32 accumulation (bf16 inputs stay bf16 on the MXU/tensor cores)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def mask_logits(s_BxC, valid_BxC):
    return jnp.where(valid_BxC, s_BxC, MASK_VALUE)


def init_stats(shape):
    """(m_s, l_s, m_t, l_t, a, s_y, t_y), all fp32."""
    neg = jnp.full(shape, MASK_VALUE, jnp.float32)
    zero = jnp.zeros(shape, jnp.float32)
    return (neg, zero, neg, zero, zero, zero, zero)


def update_stats(stats, s_BxC, t_BxC, hit_BxC):
    """One online-softmax step over a tile of masked, temperature-scaled logits.

    hit_BxC marks the target column (at most one per row over the whole vocab); None when
    the caller needs no target logits (the KL alone): s_y and t_y then stay as they are.
    Rows are the trailing axis of stats, so the same code serves [B] and [B, 1].
    """
    m_s, l_s, m_t, l_t, a, s_y, t_y = stats
    keep = (lambda x: x) if m_s.ndim == s_BxC.ndim else (lambda x: x[..., 0])
    expand = (lambda x: x) if m_s.ndim == s_BxC.ndim else (lambda x: x[..., None])
    new_m_s = jnp.maximum(m_s, keep(jnp.max(s_BxC, axis=-1, keepdims=True)))
    new_m_t = jnp.maximum(m_t, keep(jnp.max(t_BxC, axis=-1, keepdims=True)))
    alpha_s, alpha_t = jnp.exp(m_s - new_m_s), jnp.exp(m_t - new_m_t)
    e_s = jnp.exp(s_BxC - expand(new_m_s))
    e_t = jnp.exp(t_BxC - expand(new_m_t))
    row_sum = lambda x: keep(jnp.sum(x, axis=-1, keepdims=True))
    return (new_m_s, l_s * alpha_s + row_sum(e_s),
            new_m_t, l_t * alpha_t + row_sum(e_t),
            a * alpha_s + row_sum(e_s * (s_BxC - t_BxC)),
            s_y if hit_BxC is None else s_y + row_sum(jnp.where(hit_BxC, s_BxC, 0.0)),
            t_y if hit_BxC is None else t_y + row_sum(jnp.where(hit_BxC, t_BxC, 0.0)))


def finalize_stats(stats):
    """-> (lse_s, lse_t, E_p[s - t], s_y, t_y)."""
    m_s, l_s, m_t, l_t, a, s_y, t_y = stats
    # l_s = 0 only for a vocab split without a valid column; its weight in the combine is 0.
    return m_s + jnp.log(l_s), m_t + jnp.log(l_t), jnp.where(l_s > 0, a / l_s, 0.0), s_y, t_y


def combine_partial_stats(parts, max_fn, sum_fn):
    """Merge finalize_stats outputs of disjoint vocab parts (splits or shards).

    lse = m + log sum_k e^(lse_k - m);  E_p[s - t] = sum_k e^(lse_s,k - lse_s) E_pk[s - t];
    target logits add up (a target lies in exactly one part). max_fn/sum_fn reduce over
    the parts: an array axis, or pmax/psum over a mesh axis.
    """
    lse_s_k, lse_t_k, ekl_k, s_y_k, t_y_k = parts

    def lse(x):
        m = max_fn(x)
        w = jnp.exp(x - m)
        total = sum_fn(w)
        return m + jnp.log(total), w / total

    lse_s, share_s = lse(lse_s_k)
    lse_t, _ = lse(lse_t_k)
    return lse_s, lse_t, sum_fn(share_s * ekl_k), sum_fn(s_y_k), sum_fn(t_y_k)


def grad_tile(s_BxC, t_BxC, hit_BxC, lse_s_B, lse_t_B, kl_B, dkl_B, dlp_B, *, mode: str, inv_temp: float):
    """d(loss)/d(logits before temperature) for one tile, rows broadcast from [B].

    kl:       g_v = dKL p_v (log p_v - log q_v - KL)
    logratio: g_v = dlp (1[v = y] - p_v)
    Masked columns carry MASK_VALUE logits, so p_v = 0 there and g_v = 0.
    Row statistics may come as [B] or as [B, 1] (TPU layout).
    """
    col = lambda x: x if x.ndim == 2 else x[:, None]
    logp_s = s_BxC - col(lse_s_B)
    p = jnp.exp(logp_s)
    if mode == "kl":
        g = p * (col(dkl_B) * (logp_s - (t_BxC - col(lse_t_B)) - col(kl_B)))
    else:
        g = col(dlp_B) * (jnp.where(hit_BxC, 1.0, 0.0) - p)
    return g * inv_temp
