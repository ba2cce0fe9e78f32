"""Which teacher(s) score which sample: routing by (domain, effort), domain, table, mixture
or a uniform ensemble.

A task's *cell* is "domain/effort". Routing maps it to teacher weights ``{key: w}`` that sum
to 1:

* ``cell``    — the teacher whose key is the cell ("general/high"); Kimi K3's MOPD.
* ``domain``  — the teacher whose key is the domain ("coding"); GLM stages, DeepSeek bank.
* ``table``   — ``table[cell]`` or ``table[domain]`` names the key (any naming scheme).
* ``mixture`` — ``weights[cell]`` or ``weights[domain]`` is ``{key: weight}``: several
  teachers per sample, for the weighted full-vocabulary objective only.
* ``uniform`` — every teacher of the bank, weight 1 / (bank size), on every sample (an
  ensemble; full-vocabulary objective only).

`teachers.weighting="confidence"` then reweights per token (`confidence_weights`): these
per-sample weights become the prior of a softmax over each teacher's entropy.

`check_routing` resolves every cell of a run before any work, so a cell without a teacher,
a key not in the bank, or weights that do not sum to 1 fail at start with the name of the
offending cell.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import jax.numpy as jnp

from opd_jax.envs import cell_name

ROUTINGS = ("cell", "domain", "table", "mixture", "uniform")
SEVERAL = ("mixture", "uniform")          # routings that weight several teachers per sample
WEIGHT_TOL = 1e-6


def _lookup(mapping: Mapping, domain: str, effort: str):
    return mapping.get(cell_name(domain, effort), mapping.get(domain))


def teacher_weights(domain: str, effort: str, routing: str, *, table: Mapping | None = None,
                    weights: Mapping | None = None, keys: Sequence[str] = ()
                    ) -> dict[str, float]:
    """Teacher weights ``{key: w}`` of one (domain, effort) cell (`keys`: the bank's, for
    the uniform ensemble)."""
    cell = cell_name(domain, effort)
    if routing == "uniform":
        if not keys:
            raise ValueError("teachers.routing='uniform' weights every teacher of the bank; "
                             "the bank is empty")
        return {str(k): 1.0 / len(keys) for k in keys}
    if routing == "cell":
        return {cell: 1.0}
    if routing == "domain":
        return {domain: 1.0}
    if routing == "table":
        key = _lookup(table or {}, domain, effort)
        if key is None:
            raise KeyError(f"no teacher for (domain, effort) {cell!r}: teachers.table has "
                           f"neither {cell!r} nor {domain!r} (keys: {sorted(table or {})})")
        return {str(key): 1.0}
    if routing == "mixture":
        mix = _lookup(weights or {}, domain, effort)
        if mix is None:
            raise KeyError(f"no teacher weights for (domain, effort) {cell!r}: "
                           f"teachers.weights has neither {cell!r} nor {domain!r}")
        mix = {str(k): float(w) for k, w in dict(mix).items()}
        if any(w < 0 for w in mix.values()):
            raise ValueError(f"teacher weights for {cell!r} must be >= 0, got {mix}")
        total = sum(mix.values())
        if abs(total - 1.0) > WEIGHT_TOL:
            raise ValueError(f"teacher weights for {cell!r} sum to {total:.6g}, expected 1 "
                             f"(got {mix})")
        return {k: w for k, w in mix.items() if w > 0}
    raise ValueError(f"teachers.routing={routing!r}: expected one of {ROUTINGS}")


def check_routing(cells: Iterable[tuple[str, str]], bank_keys: Sequence[str], routing: str, *,
                  table: Mapping | None = None, weights: Mapping | None = None,
                  single_teacher: bool = False) -> dict[str, dict[str, float]]:
    """Resolve every (domain, effort) cell; errors name the cell and the missing key.

    single_teacher: the objective uses one teacher per sample (sampled-token objectives).
    """
    if single_teacher and routing in SEVERAL:
        raise ValueError(f"teachers.routing={routing!r} needs the full-vocabulary objective "
                         f"(deepseek_full_vocab); sampled-token and top-k objectives use one "
                         f"teacher per sample")
    out = {}
    for domain, effort in cells:
        w = teacher_weights(domain, effort, routing, table=table, weights=weights,
                            keys=bank_keys)
        missing = sorted(set(w) - set(bank_keys))
        if missing:
            raise KeyError(f"no teacher for (domain, effort) {cell_name(domain, effort)!r}: "
                           f"routing {routing!r} asks for {missing}, the bank has "
                           f"{sorted(bank_keys)}")
        out[cell_name(domain, effort)] = w
    return out


WEIGHTINGS = ("static", "confidence")


def confidence_weights(prior_BxS, entropy_SxBxT, temperature: float = 1.0):
    """Per-token teacher weights [B, T, S]: w_bts proportional to prior_bs exp(-H_sbt / tau),
    normalised over the teachers (a teacher with prior 0 keeps weight 0). A confident
    teacher (low entropy at that token) gets more weight; tau -> inf gives the prior back.

    Computed from each token's values alone (no reduction over rows), so it is the same on
    a sharded batch as on the whole one (`tests/trainers/test_sharded_teachers.py`).
    """
    prior_BxS = jnp.asarray(prior_BxS, jnp.float32)
    logits_BxTxS = (jnp.log(jnp.where(prior_BxS > 0, prior_BxS, 1.0))[:, None, :]
                    - jnp.moveaxis(jnp.asarray(entropy_SxBxT, jnp.float32), 0, -1)
                    / temperature)
    logits_BxTxS = jnp.where(prior_BxS[:, None, :] > 0, logits_BxTxS, -jnp.inf)
    w = jnp.exp(logits_BxTxS - logits_BxTxS.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)
