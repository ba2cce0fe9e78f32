"""Weight-merging baselines: what logit-level OPD is compared against.

    merged = merge_models([m_a, m_b], weights=[0.5, 0.5])                   # weight averaging
    merged = merge_models([m_a, m_b], base=m_sft, method="task_arithmetic", scale=1.0)

average:          theta = sum_i w_i theta_i
task_arithmetic:  theta = theta_base + scale * sum_i w_i (theta_i - theta_base)
Models must share one architecture (same config up to dtypes); weights are non-negative and
sum to 1. Merging runs in fp32 and casts back to each parameter's dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

METHODS = ("average", "task_arithmetic")


def merge_models(models: Sequence[nnx.Module], *, weights: Sequence[float] | None = None,
                 method: str = "average", base: nnx.Module | None = None,
                 scale: float = 1.0) -> nnx.Module:
    if not models:
        raise ValueError("merge_models needs at least one model")
    if method not in METHODS:
        raise ValueError(f"merge method {method!r}: expected one of {METHODS}")
    if method == "task_arithmetic" and base is None:
        raise ValueError("method='task_arithmetic' needs base= (the shared starting model)")
    weights = [1.0 / len(models)] * len(models) if weights is None else list(weights)
    if len(weights) != len(models):
        raise ValueError(f"{len(weights)} weights for {len(models)} models")
    if min(weights) < 0 or abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"merge weights {weights} must be non-negative and sum to 1")
    ref = base if base is not None else models[0]
    key = _arch(ref)
    for i, m in enumerate(models):
        if _arch(m) != key:
            raise ValueError(f"model {i} has a different architecture than "
                             f"{'the base' if base is not None else 'model 0'}; "
                             "only same-shape models can be merged")
    graphdef, ref_state = nnx.split(ref)
    states = [nnx.state(m) for m in models]

    def combine(ref_x, *xs):
        acc = sum(w * x.astype(jnp.float32) for w, x in zip(weights, xs))
        if method == "task_arithmetic":
            r = ref_x.astype(jnp.float32)
            acc = r + scale * (acc - r)
        return acc.astype(ref_x.dtype)

    merged = jax.tree.map(combine, ref_state, *states)
    return nnx.merge(graphdef, merged)


def _arch(model) -> dict:
    return model.config.architecture()
