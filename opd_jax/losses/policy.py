"""Policy-gradient building blocks shared by GRPO and the sampled-token OPD losses:
the PPO-clip surrogate and the training/inference mismatch corrections (IcePop, TIS).

Shape letters: B batch, T tokens. All inputs here are already sanitized (masked entries
replaced by finite values) and in fp32/fp64.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from opd_jax.losses import _checks
from opd_jax.losses.aggregation import (aggregate, masked_frac, masked_max, masked_mean,
                                        masked_min, sanitize)
from opd_jax.schema import Choice, Float, Seq, check_options, option

CORRECTIONS = (None, "icepop", "tis")
ICEPOP_NORMALIZERS = ("all", "kept")


def check_ppo_args(eps_low, eps_high, dual_clip) -> None:
    _checks.check_scalar("eps_low", eps_low, lo=0.0, hi=1.0, hi_open=True)
    _checks.check_scalar("eps_high", eps_high, lo=0.0)
    if dual_clip is not None:
        _checks.check_scalar("dual_clip", dual_clip, lo=1.0, lo_open=True)


def ppo_clip(lp_BxT: jax.Array, old_BxT: jax.Array, adv_BxT: jax.Array, mask_BxT: jax.Array,
             eps_low, eps_high, dual_clip=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """l_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), rho = exp(lp - old).

    With `dual_clip` = c > 1 (dual-clip PPO), tokens with A_t < 0 are further bounded by
    l_t <= -c A_t, so a huge ratio on a negative advantage cannot blow up the loss.
    Returns the per-token loss and the ratio/clip metrics.

    Example: rho = e^0.5 = 1.65 with A = 1 is clipped to 1.2, so l = -1.2::

        ppo_clip(jnp.full((1, 1), 0.5), jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.ones((1, 1)),
                 0.2, 0.2)[0]   # [[-1.2]]
    """
    log_rho_BxT = lp_BxT - old_BxT
    rho_BxT = jnp.exp(log_rho_BxT)
    clipped_BxT = jnp.clip(rho_BxT, 1 - eps_low, 1 + eps_high)
    pg_BxT = -jnp.minimum(rho_BxT * adv_BxT, clipped_BxT * adv_BxT)
    sg_rho, sg_adv = jax.lax.stop_gradient(rho_BxT), jax.lax.stop_gradient(adv_BxT)
    high_BxT = (sg_adv > 0) & (sg_rho > 1 + eps_high)
    low_BxT = (sg_adv < 0) & (sg_rho < 1 - eps_low)
    metrics = {
        "ratio_mean": masked_mean(sg_rho, mask_BxT),
        "ratio_min": masked_min(sg_rho, mask_BxT),
        "ratio_max": masked_max(sg_rho, mask_BxT),
        "clip_frac": masked_frac(high_BxT | low_BxT, mask_BxT),
        "clip_frac_low": masked_frac(low_BxT, mask_BxT),
        "clip_frac_high": masked_frac(high_BxT, mask_BxT),
        # k1 estimate of KL(pi_old || pi_theta) on tokens sampled from pi_old.
        "ppo_kl": masked_mean(-jax.lax.stop_gradient(log_rho_BxT), mask_BxT),
    }
    if dual_clip is not None:
        bound_BxT = -dual_clip * adv_BxT
        dual_BxT = (sg_adv < 0) & (jax.lax.stop_gradient(pg_BxT) > jax.lax.stop_gradient(bound_BxT))
        pg_BxT = jnp.where(adv_BxT < 0, jnp.minimum(pg_BxT, bound_BxT), pg_BxT)
        metrics["dual_clip_frac"] = masked_frac(dual_BxT, mask_BxT)
    return pg_BxT, metrics


@dataclasses.dataclass(frozen=True)
class Correction:
    """The training/inference mismatch correction of the sampled-token losses, one object
    shared by `grpo_loss`, `kimi_mopd_loss`, `glm_opd_loss`, the objectives and the configs
    (``objective.options.correction``). k_t = exp(lp_old_train(y_t) - lp_sampler(y_t)):

    - kind None: no correction (the mismatch metrics are still logged);
    - kind "icepop": weight 1[alpha <= k_t <= beta], (alpha, beta) = `icepop_bounds`;
      rejected tokens stay in the normalizer with `icepop_normalizer` "all" (verl's
      choice), "kept" drops them from it;
    - kind "tis": weight min(k_t, `tis_cap`) (truncated importance sampling).

    Values are checked when the object is built: a config's bad value fails before work.
    ``Correction.of("tis")``, ``Correction.of(None)`` and ``Correction.of({"kind": ...})``
    build one from a config value.
    """
    # Each field declares its default, type and range (the config schema's, opd_jax.schema).
    kind: str | None = option(Choice("icepop", ("icepop", "tis", "none", "None"),
                                     optional=True, hint="None: no correction"))
    icepop_bounds: tuple[float, float] = option(Seq((0.5, 5.0), hint="(alpha, beta)"))
    icepop_normalizer: str = option(Choice("all", ICEPOP_NORMALIZERS))
    tis_cap: float = option(Float(2.0, lo=0, lo_open=True, allow_inf=True, hint="inf: no cap"))

    def __post_init__(self):
        if self.kind in ("none", "None"):     # a config override: --config...kind=None
            object.__setattr__(self, "kind", None)
        if not isinstance(self.icepop_bounds, tuple):
            object.__setattr__(self, "icepop_bounds", tuple(self.icepop_bounds))
        check_options(self, "correction.")
        if self.kind == "icepop":
            if len(self.icepop_bounds) != 2:
                raise ValueError(f"icepop_bounds={self.icepop_bounds!r}, expected (alpha, beta)")
            lo, hi = self.icepop_bounds
            _checks.check_scalar("icepop_bounds[0]", lo, lo=0.0)
            _checks.check_scalar("icepop_bounds[1]", hi, lo=0.0)
            a, b = _checks.concrete(lo), _checks.concrete(hi)
            if a is not None and b is not None and not float(a) < float(b):
                raise ValueError(f"icepop_bounds={self.icepop_bounds}: need alpha < beta")

    @classmethod
    def of(cls, value) -> Correction:
        """A Correction from a kind (None, "icepop", "tis"), a mapping of its fields (a
        config section), or a Correction."""
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, str):
            return cls(kind=value)
        if hasattr(value, "to_dict"):      # an ml_collections ConfigDict section
            value = value.to_dict()
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(f"correction has no field(s) {unknown}; fields: "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
            return cls(**dict(value))
        raise ValueError(f"correction={value!r}: expected None, 'icepop', 'tis', a mapping "
                         f"of Correction fields, or a Correction")


def check_correction_args(correction: Correction, sampler_logp_BxT) -> None:
    if correction.kind is not None and sampler_logp_BxT is None:
        raise ValueError(f"correction={correction.kind!r} needs sampler_logp_BxT (the rollout "
                         f"engine's log-probs of the sampled tokens), got None")


def mismatch_correction(old_BxT: jax.Array, sampler_BxT: jax.Array | None, mask_BxT: jax.Array,
                        correction: Correction | str | None
                        ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Per-token weight on the policy loss and the denominator mask, from the mismatch
    k_t = exp(lp_old_train(y_t) - lp_sampler(y_t)) (detached).

    `correction` (a `Correction`, or its kind): None weight 1 (the mismatch metrics are
    still logged when sampler log-probs exist); "icepop" M_t = 1[alpha <= k_t <= beta]
    (rejected tokens stay in the denominator with icepop_normalizer "all", not with
    "kept"); "tis" min(k_t, tis_cap).

    Example: k = e^2 = 7.4 is outside IcePop's (0.5, 5), so the token gets weight 0::

        w, denom, metrics = mismatch_correction(jnp.zeros((1, 1)), jnp.full((1, 1), -2.0),
                                                jnp.ones((1, 1)), Correction("icepop"))
    """
    c = Correction.of(correction)
    one_BxT = jnp.ones_like(old_BxT)
    if sampler_BxT is None:
        return one_BxT, mask_BxT, {}
    k_BxT = jnp.exp(jax.lax.stop_gradient(old_BxT - sampler_BxT))
    metrics = {
        "mismatch_min": masked_min(k_BxT, mask_BxT),
        "mismatch_mean": masked_mean(k_BxT, mask_BxT),
        "mismatch_max": masked_max(k_BxT, mask_BxT),
    }
    if c.kind == "icepop":
        lo, hi = c.icepop_bounds
        keep_BxT = (k_BxT >= lo) & (k_BxT <= hi)
        metrics["icepop_masked_frac"] = masked_frac(~keep_BxT, mask_BxT)
        weight_BxT = keep_BxT.astype(old_BxT.dtype)
        denom_BxT = mask_BxT if c.icepop_normalizer == "all" else mask_BxT * weight_BxT
        return weight_BxT, denom_BxT, metrics
    if c.kind == "tis":
        weight_BxT = jnp.minimum(k_BxT, c.tis_cap)
        metrics["tis_clip_frac"] = masked_frac(k_BxT > c.tis_cap, mask_BxT)
        metrics["tis_weight_mean"] = masked_mean(weight_BxT, mask_BxT)
        return weight_BxT, mask_BxT, metrics
    return one_BxT, mask_BxT, metrics


def position_weights(mask_BxT: jax.Array, gamma) -> jax.Array:
    """IW-OPD's position weighting: w_t = 1 + gamma (1 - s_t), s_t the row's prefix share.

    s_t = (loss tokens of the row before t) / (loss tokens of the row), so a row's first
    token gets 1 + gamma and its weights fall linearly towards 1 at its end: the early
    tokens of a student rollout, where the teacher still scores a prefix close to its own,
    count more than the late ones, where the prefix has drifted (On the Position Bias of
    On-Policy Distillation, 2026). Masked positions (tool outputs in a multi-turn row,
    padding) are skipped by the count. gamma = 0 gives weight 1 everywhere.

    Example: one row of 4 loss tokens with gamma 0.5 gets 1.5, 1.375, 1.25, 1.125::

        position_weights(jnp.ones((1, 4)), 0.5)
    """
    _checks.check_scalar("position_gamma", gamma, lo=0.0)
    m = (mask_BxT != 0).astype(jnp.float32)
    before_BxT = jnp.cumsum(m, axis=-1) - m
    n_B1 = jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    return jnp.where(m != 0, 1.0 + gamma * (1.0 - before_BxT / n_B1), 1.0)


def corrected_policy_loss(pg_BxT: jax.Array, old_BxT: jax.Array,
                          sampler_logp_BxT: jax.Array | None, mask_BxT: jax.Array, *,
                          correction: Correction, aggregation, max_len,
                          position_gamma=0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weight a per-token policy loss by the mismatch correction (and, with
    `position_gamma` > 0, by `position_weights`), then aggregate it.

    The shared tail of `grpo_loss`, `kimi_mopd_loss` and `glm_opd_loss`: `old_BxT` is the
    (detached) training-engine log-prob the sampler is compared with. The position weights
    enter the numerator only: the denominator stays the mask (or IcePop's kept tokens).
    """
    sampler_BxT = jax.lax.stop_gradient(sanitize(sampler_logp_BxT, mask_BxT))
    weight_BxT, denom_BxT, metrics = mismatch_correction(old_BxT, sampler_BxT, mask_BxT,
                                                         correction)
    if not (isinstance(position_gamma, (int, float)) and position_gamma == 0):
        weight_BxT = weight_BxT * position_weights(mask_BxT, position_gamma).astype(
            weight_BxT.dtype)
    loss = aggregate(pg_BxT * weight_BxT, mask_BxT, aggregation, max_len=max_len,
                     denom_mask_BxT=denom_BxT)
    return loss, metrics
