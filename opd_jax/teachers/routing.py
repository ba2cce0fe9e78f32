"""Which teacher(s) score which sample: routing by (domain, effort), domain, table or mixture.

A task's *cell* is "domain/effort". Routing maps it to teacher weights ``{key: w}`` that sum
to 1:

* ``cell``    — the teacher whose key is the cell ("general/high"); Kimi K3's MOPD.
* ``domain``  — the teacher whose key is the domain ("coding"); GLM stages, DeepSeek bank.
* ``table``   — ``table[cell]`` or ``table[domain]`` names the key (any naming scheme).
* ``mixture`` — ``weights[cell]`` or ``weights[domain]`` is ``{key: weight}``: several
  teachers per sample, for the weighted full-vocabulary objective only.

`check_routing` resolves every cell of a run before any work, so a cell without a teacher,
a key not in the bank, or weights that do not sum to 1 fail at start with the name of the
offending cell.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from opd_jax.envs import cell_name

ROUTINGS = ("cell", "domain", "table", "mixture")
WEIGHT_TOL = 1e-6


def _lookup(mapping: Mapping, domain: str, effort: str):
    return mapping.get(cell_name(domain, effort), mapping.get(domain))


def teacher_weights(domain: str, effort: str, routing: str, *, table: Mapping | None = None,
                    weights: Mapping | None = None) -> dict[str, float]:
    """Teacher weights ``{key: w}`` of one (domain, effort) cell."""
    cell = cell_name(domain, effort)
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
    if single_teacher and routing == "mixture":
        raise ValueError("teachers.routing='mixture' needs the full-vocabulary objective "
                         "(deepseek_full_vocab); sampled-token objectives use one teacher per "
                         "sample")
    out = {}
    for domain, effort in cells:
        w = teacher_weights(domain, effort, routing, table=table, weights=weights)
        missing = sorted(set(w) - set(bank_keys))
        if missing:
            raise KeyError(f"no teacher for (domain, effort) {cell_name(domain, effort)!r}: "
                           f"routing {routing!r} asks for {missing}, the bank has "
                           f"{sorted(bank_keys)}")
        out[cell_name(domain, effort)] = w
    return out
