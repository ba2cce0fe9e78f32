"""Supervised fine-tuning: masked negative log-likelihood.

Shape letters: B batch, T tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.losses import _checks
from opd_jax.losses.aggregation import aggregate, masked_mean, sanitize


def sft_loss(logp_BxT: jax.Array, mask_BxT: jax.Array, *, aggregation: str = "token_mean",
             max_len: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L = - sum_t m_t lp_theta(y_t) / sum_t m_t (token mean over the whole batch).

    `lp_theta` comes from `token_logprobs(logits, targets)`. Masked bad spans are m_t = 0;
    fractional m_t are per-token weights. `aggregation` picks "token_mean" (default),
    "seq_mean" or "max_len" as in `aggregate`.

    Metrics: `loss`, `nll` (token-mean NLL, whatever the aggregation), `perplexity`
    (exp of `nll`), `num_tokens` (sum of the mask).

    Example::

        logp = token_logprobs(logits_BxTxV, targets_BxT)
        loss, metrics = sft_loss(logp, mask_BxT)
    """
    _checks.check_bxt("logp_BxT", logp_BxT, mask_BxT=mask_BxT)
    lp_BxT = sanitize(logp_BxT, mask_BxT)
    loss = aggregate(-lp_BxT, mask_BxT, aggregation, max_len=max_len)
    nll = jax.lax.stop_gradient(masked_mean(-lp_BxT, mask_BxT))
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "nll": nll,
        "perplexity": jnp.exp(nll),
        "num_tokens": mask_BxT.astype(jnp.float32).sum(),
    }
    return loss, metrics
