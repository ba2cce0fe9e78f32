"""Sampled-token on-policy distillation: Kimi K3 MOPD and GLM cross-stage OPD.

Shape letters: B batch, T tokens. Every input is the log-probability of the token the
student sampled, y_t ~ pi_theta (or the rollout engine's copy of it).

Both forms estimate the gradient of the REVERSE KL, KL(pi_theta || pi_T) (student first):
E_{y~p}[(lp_theta(y) - lp_T(y)) grad lp_theta(y)] = grad KL(p || q), so the
sampled-token log-ratio is an unbiased (unclipped) estimate of the full-vocabulary
gradient that `reverse_kl_loss` computes exactly.

Metric names (fp32 scalars):
  kimi_mopd_loss: loss, r_mean, r_abs_mean, r_clip_frac, reverse_kl_est, entropy_est,
  glm_opd_loss:   loss, adv_mean, opd_adv_mean, reverse_kl_est, entropy_est,
  plus, with a PPO ratio (GLM always, Kimi when old_logp_BxT is given): ratio_mean,
  ratio_min, ratio_max, clip_frac, clip_frac_low, clip_frac_high, ppo_kl, [dual_clip_frac];
  and the mismatch metrics of `grpo_loss` when sampler_logp_BxT is given.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opd_jax.losses import _checks, policy
from opd_jax.losses.aggregation import masked_frac, masked_mean, sanitize

sg = jax.lax.stop_gradient


def clipped_log_ratio(teacher_logp_BxT: jax.Array, logp_BxT: jax.Array, r_max) -> jax.Array:
    """r_t = clip(sg(lp_T(y_t) - lp_theta(y_t)), -r_max, r_max), the Kimi K3 dense reward.

    r_t > 0 where the teacher likes the student's token more than the student does.
    Example: `clipped_log_ratio(jnp.log(0.5), jnp.log(0.01), 2.0)` is 2.0 (log 50 = 3.9).
    """
    _checks.check_scalar("r_max", r_max, lo=0.0, lo_open=True)
    return jnp.clip(sg(teacher_logp_BxT - logp_BxT), -r_max, r_max)


def kimi_mopd_loss(logp_BxT: jax.Array, teacher_logp_BxT: jax.Array, mask_BxT: jax.Array, *,
                   r_max: float, old_logp_BxT: jax.Array | None = None,
                   eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                   sampler_logp_BxT: jax.Array | None = None,
                   correction: policy.Correction | str | None = None,
                   aggregation: str = "token_mean", max_len: int | None = None,
                   position_gamma: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Kimi K3 multi-teacher OPD (Eq. 15), a dense clipped per-token advantage.

    r_t = clip(sg(lp_T(y_t) - lp_ref(y_t)), -r_max, r_max), lp_ref = lp_theta, or
    lp_old when `old_logp_BxT` is given (batch reuse).
    Without old_logp: l_t = -c_t r_t lp_theta(y_t) (policy-gradient form).
    With old_logp:    l_t = -c_t min(rho_t r_t, clip(rho_t, 1 - eps_low, 1 + eps_high) r_t).
    The gradient descends the REVERSE KL(pi_theta || pi_T) (exact in expectation when no
    token is clipped). `teacher_logp_BxT` is the teacher (d, e) picked per sample, scored
    on the student's tokens with its own prompt; it gets no gradient. c_t, aggregation
    and the IcePop normalizer knob are as in `grpo_loss`, with k_t = exp(lp_ref - lp_sampler).
    `position_gamma` > 0 multiplies l_t by IW-OPD's position weight 1 + gamma (1 - s_t)
    (`policy.position_weights`; s_t the row's prefix share).

    Example::

        loss, metrics = kimi_mopd_loss(logp_BxT, teacher_logp_BxT, mask_BxT, r_max=5.0)
    """
    _checks.check_bxt("logp_BxT", logp_BxT, teacher_logp_BxT=teacher_logp_BxT,
                      mask_BxT=mask_BxT, old_logp_BxT=old_logp_BxT,
                      sampler_logp_BxT=sampler_logp_BxT)
    _checks.check_scalar("r_max", r_max, lo=0.0, lo_open=True)
    policy.check_ppo_args(eps_low, eps_high, dual_clip)
    correction = policy.Correction.of(correction)
    policy.check_correction_args(correction, sampler_logp_BxT)
    m = mask_BxT
    lp, teacher = sanitize(logp_BxT, m), sg(sanitize(teacher_logp_BxT, m))
    ref = sg(lp) if old_logp_BxT is None else sg(sanitize(old_logp_BxT, m))
    log_ratio_BxT = teacher - ref
    r_BxT = clipped_log_ratio(teacher, ref, r_max)
    metrics = {}
    if old_logp_BxT is None:
        pg_BxT = -r_BxT * lp
    else:
        pg_BxT, metrics = policy.ppo_clip(lp, ref, r_BxT, m, eps_low, eps_high, dual_clip)
    loss, corr_metrics = policy.corrected_policy_loss(
        pg_BxT, ref, sampler_logp_BxT, m, correction=correction, aggregation=aggregation,
        max_len=max_len, position_gamma=position_gamma)
    metrics |= {
        "loss": sg(loss),
        "r_mean": masked_mean(r_BxT, m),
        "r_abs_mean": masked_mean(jnp.abs(r_BxT), m),
        "r_clip_frac": masked_frac(jnp.abs(log_ratio_BxT) > r_max, m),
        # k1 estimate of KL(pi_theta || pi_T) on the student's own tokens (unclipped).
        "reverse_kl_est": masked_mean(-log_ratio_BxT, m),
        "entropy_est": masked_mean(-sg(lp), m),
    } | corr_metrics
    return loss, {k: v.astype(jnp.float32) for k, v in metrics.items()}


def glm_opd_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, teacher_logp_BxT: jax.Array,
                 mask_BxT: jax.Array, *, eps_low: float = 0.2, eps_high: float = 0.2,
                 dual_clip: float | None = None, task_adv: jax.Array | None = None,
                 kl_coef: float = 1.0, sampler_logp_BxT: jax.Array | None = None,
                 correction: policy.Correction | str | None = None,
                 aggregation: str = "token_mean", max_len: int | None = None,
                 position_gamma: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GLM cross-stage OPD: the teacher log-ratio replaces the GRPO advantage (group size 1).

    A_t = task_adv - kl_coef (lp_old(y_t) - lp_T(y_t))   (slime form; task_adv default 0)
    l_t = -c_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t),
    rho_t = exp(lp_theta - lp_old). A_t is detached; its OPD part is minus a sampled
    estimate of the REVERSE KL(pi_old || pi_T) (student first), so the step descends it.
    `task_adv` is [B] or [B, T]. c_t (`correction`) and aggregation as in `grpo_loss`;
    `position_gamma` as in `kimi_mopd_loss`.

    Example::

        loss, metrics = glm_opd_loss(logp_BxT, old_logp_BxT, teacher_logp_BxT, mask_BxT,
                                     eps_low=0.2, eps_high=0.28)
    """
    shape = _checks.check_bxt("logp_BxT", logp_BxT, old_logp_BxT=old_logp_BxT,
                              teacher_logp_BxT=teacher_logp_BxT, mask_BxT=mask_BxT,
                              sampler_logp_BxT=sampler_logp_BxT)
    if task_adv is not None:
        _checks.check_adv("task_adv", task_adv, shape)
    _checks.check_scalar("kl_coef", kl_coef, lo=0.0)
    policy.check_ppo_args(eps_low, eps_high, dual_clip)
    correction = policy.Correction.of(correction)
    policy.check_correction_args(correction, sampler_logp_BxT)
    m = mask_BxT
    lp, old = sanitize(logp_BxT, m), sg(sanitize(old_logp_BxT, m))
    teacher = sg(sanitize(teacher_logp_BxT, m))
    opd_adv_BxT = teacher - old
    adv_BxT = kl_coef * opd_adv_BxT
    if task_adv is not None:
        task = task_adv if jnp.ndim(task_adv) == 2 else task_adv[:, None]
        adv_BxT = adv_BxT + sg(sanitize(jnp.broadcast_to(task, shape), m))
    pg_BxT, metrics = policy.ppo_clip(lp, old, adv_BxT, m, eps_low, eps_high, dual_clip)
    loss, corr_metrics = policy.corrected_policy_loss(
        pg_BxT, old, sampler_logp_BxT, m, correction=correction, aggregation=aggregation,
        max_len=max_len, position_gamma=position_gamma)
    metrics |= {
        "loss": sg(loss),
        "adv_mean": masked_mean(adv_BxT, m),
        "opd_adv_mean": masked_mean(opd_adv_BxT, m),
        "reverse_kl_est": masked_mean(-opd_adv_BxT, m),
        "entropy_est": masked_mean(-sg(lp), m),
    } | corr_metrics
    return loss, {k: v.astype(jnp.float32) for k, v in metrics.items()}
