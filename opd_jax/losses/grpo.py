"""GRPO (DeepSeekMath) with the DAPO, Dr.GRPO, IcePop and TIS variants.

Shape letters: B batch (sequences; prompts in `rewards_BxG`), T tokens, G group size.

Metric names returned by `grpo_loss` (all fp32 scalars, stable across releases):
  loss, pg_loss, entropy_est, adv_mean,
  ratio_mean, ratio_min, ratio_max, clip_frac, clip_frac_low, clip_frac_high, ppo_kl,
  [dual_clip_frac]                       when dual_clip is set,
  [kl_ref, kl_loss]                      when ref_logp_BxT is given,
  [mismatch_min, mismatch_mean, mismatch_max] when sampler_logp_BxT is given,
  [icepop_masked_frac]                   with correction="icepop",
  [tis_clip_frac, tis_weight_mean]       with correction="tis".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.losses import _checks, policy
from opd_jax.losses.aggregation import aggregate, masked_mean, sanitize


def group_advantages(rewards_BxG: jax.Array, scale: str = "std", eps: float = 1e-6, *,
                     ddof: int = 1) -> jax.Array:
    """GRPO group-relative advantages, one per response.

    scale="std":  A_i = (R_i - mean_g R) / (std_g R + eps)   (GRPO)
    scale="none": A_i = R_i - mean_g R                        (Dr.GRPO)
    `ddof=1` is the unbiased std that verl, TRL and OpenRLHF use (torch.std); ddof=0 gives
    the population std. A group with equal rewards gets A = 0. Flatten with
    `adv.reshape(-1)` to match sequences laid out prompt-major.

    Example::

        group_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0]]))  # [[0.866, -0.866, -0.866, 0.866]]
    """
    _checks.check_rank("rewards_BxG", rewards_BxG, (2,), "[B, G]")
    _checks.check_choice("scale", scale, ("std", "none"))
    _checks.check_scalar("eps", eps, lo=0.0)
    g = rewards_BxG.shape[1]
    if scale == "std" and g <= ddof:
        raise ValueError(f"group size G={g} is too small for scale='std' with ddof={ddof}")
    r_BxG = rewards_BxG.astype(_checks.compute_dtype(rewards_BxG))
    centered_BxG = r_BxG - r_BxG.mean(-1, keepdims=True)
    if scale == "none":
        return centered_BxG
    return centered_BxG / (r_BxG.std(-1, ddof=ddof, keepdims=True) + eps)


def dapo_group_filter(rewards_BxG: jax.Array) -> jax.Array:
    """DAPO dynamic sampling: keep_B = True where the group's rewards are not all equal.

    Such groups carry zero advantage and only dilute the batch. Multiply the loss mask by
    `jnp.repeat(keep_B, G)[:, None]` (or resample) to drop the others.

    Example: `dapo_group_filter(jnp.array([[1., 1.], [0., 1.]]))` is `[False, True]`.
    """
    _checks.check_rank("rewards_BxG", rewards_BxG, (2,), "[B, G]")
    return rewards_BxG.max(-1) != rewards_BxG.min(-1)


def overlong_penalty(lengths_B: jax.Array, max_len: int, cache_len: int) -> jax.Array:
    """DAPO soft overlong punishment, measured in tokens, added to the task reward:

    R = 0 if L <= max_len - cache_len; (max_len - cache_len - L) / cache_len if
    L <= max_len; -1 beyond.

    Example: `overlong_penalty(jnp.array([10, 15, 30]), max_len=20, cache_len=10)` is
    `[0., -0.5, -1.]`.
    """
    if not (isinstance(max_len, (int, np.integer)) and isinstance(cache_len, (int, np.integer))
            and 0 < cache_len <= max_len):
        raise ValueError(f"need ints 0 < cache_len <= max_len, got cache_len={cache_len!r}, "
                         f"max_len={max_len!r}")
    length_B = jnp.asarray(lengths_B).astype(jnp.float32)
    soft = max_len - cache_len
    ramp_B = (soft - length_B) / cache_len
    return jnp.where(length_B <= soft, 0.0, jnp.where(length_B <= max_len, ramp_B, -1.0))


def kl_k3(lp_BxT: jax.Array, ref_BxT: jax.Array) -> jax.Array:
    """Schulman's k3 estimate of KL(pi_theta || pi_ref) per sampled token (REVERSE KL,
    policy first): exp(lp_ref - lp) - (lp_ref - lp) - 1 >= 0, unbiased for y ~ pi_theta.

    Example: `kl_k3(jnp.log(0.5), jnp.log(0.25))` is 0.5 - log 0.5 - 1 = 0.193.
    """
    d = ref_BxT - lp_BxT
    return jnp.exp(d) - d - 1


def grpo_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, adv_B_or_BxT: jax.Array,
              mask_BxT: jax.Array, *, eps_low: float = 0.2, eps_high: float = 0.2,
              dual_clip: float | None = None, ref_logp_BxT: jax.Array | None = None,
              kl_beta: float = 0.0, sampler_logp_BxT: jax.Array | None = None,
              correction: policy.Correction | str | None = None,
              aggregation: str = "token_mean", max_len: int | None = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO/PPO-clip policy loss with optional reference KL and mismatch correction.

    rho_t = exp(lp_theta - lp_old)
    l_t = -c_t min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
          + kl_beta KL_k3(pi_theta || pi_ref)         (REVERSE KL, policy first)
    DAPO clip-higher: eps_high > eps_low. c_t is the detached mismatch correction with
    k_t = exp(lp_old - lp_sampler), a `policy.Correction` (or its kind: None, "icepop",
    "tis"): IcePop c_t = 1[alpha <= k_t <= beta], TIS c_t = min(k_t, tis_cap), else 1. It
    multiplies the policy term only. IcePop-rejected tokens stay in the normalizer by
    default (icepop_normalizer="all", as verl); "kept" removes them. `aggregation`: "token_mean" (DAPO, default), "seq_mean" (GRPO),
    "max_len" (Dr.GRPO, sum / (B * max_len)); the KL term is aggregated the same way.
    `adv_B_or_BxT` is per sequence [B] or per token [B, T]; it gets no gradient.

    Example::

        adv_B = group_advantages(rewards_BxG).reshape(-1)
        loss, metrics = grpo_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, eps_high=0.28,
                                  sampler_logp_BxT=vllm_logp_BxT, correction="icepop")
    """
    shape = _checks.check_bxt("logp_BxT", logp_BxT, old_logp_BxT=old_logp_BxT, mask_BxT=mask_BxT,
                              ref_logp_BxT=ref_logp_BxT, sampler_logp_BxT=sampler_logp_BxT)
    _checks.check_adv("adv_B_or_BxT", adv_B_or_BxT, shape)
    policy.check_ppo_args(eps_low, eps_high, dual_clip)
    correction = policy.Correction.of(correction)
    policy.check_correction_args(correction, sampler_logp_BxT)
    _checks.check_scalar("kl_beta", kl_beta, lo=0.0)
    beta = _checks.concrete(kl_beta)
    if ref_logp_BxT is None and (beta is None or float(beta) != 0.0):
        raise ValueError(f"kl_beta={kl_beta} needs ref_logp_BxT, got None")
    m = mask_BxT
    sg = jax.lax.stop_gradient
    # Only the current policy gets gradients; old/ref/sampler log-probs are data.
    lp, old = sanitize(logp_BxT, m), sg(sanitize(old_logp_BxT, m))
    adv = adv_B_or_BxT if jnp.ndim(adv_B_or_BxT) == 2 else adv_B_or_BxT[:, None]
    adv_BxT = jax.lax.stop_gradient(sanitize(jnp.broadcast_to(adv, shape), m))

    pg_BxT, metrics = policy.ppo_clip(lp, old, adv_BxT, m, eps_low, eps_high, dual_clip)
    pg_loss, corr_metrics = policy.corrected_policy_loss(
        pg_BxT, old, sampler_logp_BxT, m, correction=correction, aggregation=aggregation,
        max_len=max_len)
    loss = pg_loss
    metrics |= {"pg_loss": sg(pg_loss), "entropy_est": masked_mean(-sg(lp), m),
                "adv_mean": masked_mean(adv_BxT, m)}
    if ref_logp_BxT is not None:
        kl_BxT = kl_k3(lp, sg(sanitize(ref_logp_BxT, m)))
        kl_loss = aggregate(kl_BxT, m, aggregation, max_len=max_len)
        loss = loss + kl_beta * kl_loss
        metrics |= {"kl_ref": masked_mean(sg(kl_BxT), m), "kl_loss": sg(kl_loss)}
    metrics |= corr_metrics
    metrics["loss"] = sg(loss)
    return loss, {k: v.astype(jnp.float32) for k, v in metrics.items()}
