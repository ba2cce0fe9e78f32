"""Token aggregation shared by every loss, and the masked statistics used in metrics.

Shape letters: B batch (sequences), T tokens.

Three ways to turn per-token losses l_t and a mask m_t into a scalar:

| aggregation  | formula                                              | used by            |
|--------------|------------------------------------------------------|--------------------|
| "token_mean" | sum_{b,t} l m / sum_{b,t} m   (whole batch)          | DAPO, the default  |
| "seq_mean"   | mean_b [ sum_t l m / sum_t m ] over rows with m != 0 | GRPO (DeepSeekMath)|
| "max_len"    | sum_{b,t} l m / (B * max_len)  (max_len default T)   | Dr.GRPO            |

`denom_mask_BxT` lets the denominator count other tokens than the numerator: IcePop keeps
its rejected tokens in the normalizer by passing the full mask here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.losses import _checks

AGGREGATIONS = ("token_mean", "seq_mean", "max_len")


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    # A fully masked batch gives 0, not NaN, and no NaN in the gradient either.
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def aggregate(loss_BxT: jax.Array, mask_BxT: jax.Array, aggregation: str = "token_mean", *,
              max_len: int | None = None, denom_mask_BxT: jax.Array | None = None) -> jax.Array:
    """Masked reduction of per-token losses to a scalar (see the module table).

    Masked tokens are selected out with `where`, so NaN/inf garbage there never reaches
    the value. Example::

        aggregate(jnp.ones((2, 3)), jnp.array([[1, 1, 0], [1, 0, 0]]))  # 1.0
        aggregate(jnp.ones((2, 3)), jnp.array([[1, 1, 0], [1, 0, 0]]), "max_len")  # 0.5
    """
    _checks.check_choice("aggregation", aggregation, AGGREGATIONS)
    _checks.check_bxt("loss_BxT", loss_BxT, mask_BxT=mask_BxT, denom_mask_BxT=denom_mask_BxT)
    if max_len is not None and aggregation != "max_len":
        raise ValueError(f"max_len={max_len} is only used by aggregation='max_len', "
                         f"got aggregation={aggregation!r}")
    dtype = _checks.compute_dtype(loss_BxT)
    m = mask_BxT.astype(dtype)
    dm = m if denom_mask_BxT is None else denom_mask_BxT.astype(dtype)
    num_BxT = jnp.where(m != 0, loss_BxT.astype(dtype) * m, 0)
    if aggregation == "token_mean":
        return _safe_div(num_BxT.sum(), dm.sum())
    if aggregation == "seq_mean":
        den_B = dm.sum(-1)
        per_seq_B = _safe_div(num_BxT.sum(-1), den_B)
        rows = (den_B > 0).astype(dtype)
        return _safe_div((per_seq_B * rows).sum(), rows.sum())
    b, t = loss_BxT.shape
    max_len = t if max_len is None else max_len
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len <= 0:
        raise ValueError(f"max_len={max_len!r} must be a positive int (the Dr.GRPO constant)")
    return num_BxT.sum() / jnp.asarray(b * max_len, dtype)


def masked_mean(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """sum(x m) / sum(m) over the whole batch, 0 if nothing is valid; for metrics."""
    return aggregate(x_BxT, mask_BxT, "token_mean")


def masked_min(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Minimum over valid tokens, 0 if nothing is valid."""
    valid = mask_BxT != 0
    return jnp.where(valid.any(), jnp.min(jnp.where(valid, x_BxT, jnp.inf)), 0).astype(
        _checks.compute_dtype(x_BxT))


def masked_max(x_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Maximum over valid tokens, 0 if nothing is valid."""
    valid = mask_BxT != 0
    return jnp.where(valid.any(), jnp.max(jnp.where(valid, x_BxT, -jnp.inf)), 0).astype(
        _checks.compute_dtype(x_BxT))


def masked_frac(cond_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Fraction of valid tokens where `cond` holds (the mask's weights count)."""
    return masked_mean(cond_BxT.astype(jnp.float32), mask_BxT)


def sanitize(x_BxT: jax.Array | None, mask_BxT: jax.Array, fill: float = 0.0):
    """Replace masked entries by `fill` in fp32 (fp64 stays), so padding such as -inf
    log-probs can never produce inf * 0 = NaN downstream, in values or gradients."""
    if x_BxT is None:
        return None
    dtype = _checks.compute_dtype(x_BxT)
    return jnp.where(mask_BxT != 0, x_BxT.astype(dtype), jnp.asarray(fill, dtype))
