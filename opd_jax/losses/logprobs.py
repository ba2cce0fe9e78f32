"""Log-probabilities and entropies from logits, always in fp32.

Shape letters: B batch, T tokens, V vocab. Leading dimensions are free: [..., V] logits
pair with [...] targets, so [B, T, V] and [K, B, T, V] both work.

Softmax runs in fp32 (fp64 if the logits are fp64): bf16 has an 8-bit mantissa, so a
bf16 log-sum-exp over 150k entries loses the tail probabilities that the losses weigh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.losses import _checks


def _check_logits(name: str, logits: jax.Array) -> None:
    if jnp.ndim(logits) < 1 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating [..., V] array, got dtype {logits.dtype} "
                         f"and shape {tuple(jnp.shape(logits))}")


def log_softmax(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature) over the last axis, in fp32.

    Example: `log_softmax(jnp.zeros(4))` is `[-log 4] * 4`.
    """
    _check_logits("logits", logits)
    _checks.check_scalar("temperature", temperature, lo=0.0, lo_open=True)
    dtype = _checks.compute_dtype(logits)
    return jax.nn.log_softmax(logits.astype(dtype) / jnp.asarray(temperature, dtype), axis=-1)


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
    """lp_t = log softmax(logits_t / temperature)[y_t]: the log-probability of each target.

    Computed as s_y - logsumexp(s) with s = logits / temperature in fp32; the temperature
    must match the one the sampler used, or the ratios against sampler log-probs are off.
    Targets must lie in [0, V) (not checkable at trace time; out-of-range ids are clamped).

    Example::

        logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
        token_logprobs(logits, jnp.array([[1]]))   # [[log 0.25]] = [[-1.386]]
    """
    _check_logits("logits_BxTxV", logits_BxTxV)
    if not jnp.issubdtype(jnp.asarray(targets_BxT).dtype, jnp.integer):
        raise ValueError(f"targets_BxT must hold integer token ids, got dtype "
                         f"{jnp.asarray(targets_BxT).dtype}")
    if tuple(logits_BxTxV.shape[:-1]) != tuple(jnp.shape(targets_BxT)):
        raise ValueError(f"targets_BxT has shape {tuple(jnp.shape(targets_BxT))}, expected the "
                         f"logits' leading shape {tuple(logits_BxTxV.shape[:-1])}")
    _checks.check_scalar("temperature", temperature, lo=0.0, lo_open=True)
    dtype = _checks.compute_dtype(logits_BxTxV)
    s_BxTxV = logits_BxTxV.astype(dtype) / jnp.asarray(temperature, dtype)
    lse_BxT = jax.nn.logsumexp(s_BxTxV, axis=-1)
    target_BxT = jnp.take_along_axis(s_BxTxV, targets_BxT[..., None], axis=-1,
                                     mode="clip")[..., 0]
    return target_BxT - lse_BxT


def token_entropy(logits_BxTxV: jax.Array, temperature: float = 1.0) -> jax.Array:
    """H_t = -sum_v p_v log p_v with p = softmax(logits / temperature), in fp32 (nats).

    Example: `token_entropy(jnp.zeros((1, 1, 4)))` is `[[log 4]]` = `[[1.386]]`.
    """
    logp_BxTxV = log_softmax(logits_BxTxV, temperature)
    return -xlogp(jnp.exp(logp_BxTxV), logp_BxTxV).sum(-1)


def xlogp(p: jax.Array, logp: jax.Array) -> jax.Array:
    """p * logp with 0 where p == 0, so -inf logits (masked vocab) give 0, not NaN."""
    return p * jnp.where(p > 0, logp, 0)
