"""Training objectives for the policy trainers, picked by name from a small registry.

Legend: B rows, T targets, V vocab, D student hidden, E teacher hidden, S teacher slots.

An objective is a frozen dataclass called as ``objective(model, batch, teachers) ->
(loss, metrics)`` inside the jitted step. `batch` is a sequence batch
(:mod:`opd_jax.trainers.sequences`) plus what the objective lists in ``needs``;
`teachers` is a tuple of teacher unembedding matrices (only the full-vocab objective uses
it). Sampled-token objectives (grpo, kimi_mopd, glm_cross_stage) score the student with full
logits; the full-vocab objective never builds [B, T, V] logits: it feeds the student's and
the cached teachers' last-layer hidden states to the fused reverse-KL kernel.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from opd_jax import losses

OBJECTIVES: dict[str, type] = {}


def register(cls):
    OBJECTIVES[cls.name] = cls
    return cls


def make_objective(name: str, **kwargs) -> Any:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; available: {', '.join(sorted(OBJECTIVES))}")
    fields = {f.name for f in dataclasses.fields(OBJECTIVES[name])}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"objective {name!r} has no option(s) {unknown}; options: {sorted(fields)}")
    return OBJECTIVES[name](**kwargs)


def student_logp(model, batch, temperature: float = 1.0):
    logits_BxTxV = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
    return losses.token_logprobs(logits_BxTxV, batch["targets"], temperature=temperature)


def _correction_kwargs(o, batch):
    return dict(sampler_logp_BxT=batch["sampler_logp"] if o.correction else None,
                correction=o.correction, icepop_bounds=tuple(o.icepop_bounds),
                icepop_normalizer=o.icepop_normalizer, tis_cap=o.tis_cap,
                aggregation=o.aggregation, max_len=o.max_len)


def per_teacher_metrics(values: dict[str, jax.Array], onehot_BxS, mask_BxT) -> dict:
    """Masked means of per-token values over the rows routed to each teacher slot."""
    out = {}
    for s in range(onehot_BxS.shape[1]):
        m = mask_BxT * onehot_BxS[:, s:s + 1]
        for name, v in values.items():
            out[f"teacher{s}/{name}"] = losses.masked_mean(v, m)
        out[f"teacher{s}/tokens"] = jnp.sum(m).astype(jnp.float32)
    return out


@dataclasses.dataclass(frozen=True)
class _PolicyOptions:
    eps_low: float = 0.2
    eps_high: float = 0.2
    correction: str | None = "icepop"          # None | "icepop" | "tis"
    icepop_bounds: tuple = (0.5, 5.0)
    icepop_normalizer: str = "all"
    tis_cap: float = 2.0
    aggregation: str = "token_mean"
    max_len: int | None = None


@register
@dataclasses.dataclass(frozen=True)
class GRPO(_PolicyOptions):
    """GRPO / DAPO / Dr.GRPO policy loss with IcePop or TIS (see `losses.grpo_loss`)."""
    name: ClassVar[str] = "grpo"
    needs: ClassVar[tuple] = ("old_logp", "adv")
    kl_beta: float = 0.0

    def __call__(self, model, batch, teachers=()):
        logp_BxT = student_logp(model, batch)
        return losses.grpo_loss(
            logp_BxT, batch["old_logp"], batch["adv"], batch["mask"], eps_low=self.eps_low,
            eps_high=self.eps_high, ref_logp_BxT=batch.get("ref_logp"), kl_beta=self.kl_beta,
            **_correction_kwargs(self, batch))


@register
@dataclasses.dataclass(frozen=True)
class KimiMOPD(_PolicyOptions):
    """Kimi K3 MOPD: routed teacher, r = clip(sg(lp_T - lp), -r_max, r_max) per token."""
    name: ClassVar[str] = "kimi_mopd"
    needs: ClassVar[tuple] = ("old_logp", "teacher_logp", "teacher_onehot")
    r_max: float = 5.0
    ppo: bool = False            # reuse the batch: PPO ratio/clip, r from lp_old

    def __call__(self, model, batch, teachers=()):
        logp_BxT = student_logp(model, batch)
        loss, metrics = losses.kimi_mopd_loss(
            logp_BxT, batch["teacher_logp"], batch["mask"], r_max=self.r_max,
            old_logp_BxT=batch["old_logp"] if self.ppo else None, eps_low=self.eps_low,
            eps_high=self.eps_high, **_correction_kwargs(self, batch))
        ratio_BxT = jax.lax.stop_gradient(batch["teacher_logp"] - logp_BxT)
        metrics |= per_teacher_metrics(
            {"log_ratio": ratio_BxT,
             "clip_frac": (jnp.abs(ratio_BxT) > self.r_max).astype(jnp.float32),
             "reverse_kl_est": -ratio_BxT},
            batch["teacher_onehot"], batch["mask"])
        return loss, metrics


@register
@dataclasses.dataclass(frozen=True)
class GLMCrossStage(_PolicyOptions):
    """GLM cross-stage OPD: A_t = task_adv - kl_coef (lp_old - lp_T) in the PPO surrogate."""
    name: ClassVar[str] = "glm_cross_stage"
    needs: ClassVar[tuple] = ("old_logp", "teacher_logp", "teacher_onehot")
    kl_coef: float = 1.0
    task_reward_weight: float = 0.0   # > 0 mixes in the task advantage (batch["adv"])

    def __call__(self, model, batch, teachers=()):
        logp_BxT = student_logp(model, batch)
        task_adv = batch["adv"] * self.task_reward_weight if self.task_reward_weight else None
        loss, metrics = losses.glm_opd_loss(
            logp_BxT, batch["old_logp"], batch["teacher_logp"], batch["mask"],
            eps_low=self.eps_low, eps_high=self.eps_high, task_adv=task_adv,
            kl_coef=self.kl_coef, **_correction_kwargs(self, batch))
        ratio_BxT = batch["teacher_logp"] - batch["old_logp"]
        metrics |= per_teacher_metrics({"log_ratio": ratio_BxT, "reverse_kl_est": -ratio_BxT},
                                       batch["teacher_onehot"], batch["mask"])
        return loss, metrics


@register
@dataclasses.dataclass(frozen=True)
class DeepSeekFullVocab:
    """DeepSeek-V4: sum_s w_bs KL(pi_theta || pi_Ts) over the full vocabulary, fused.

    `batch["teacher_hidden"]` is a tuple of S cached teacher hidden-state arrays
    [B, T, E_s] (aligned to the student's targets); `teachers` the S unembeddings
    [E_s, V]; `batch["teacher_weights"]` [B, S] sums to 1 per row.
    """
    name: ClassVar[str] = "deepseek_full_vocab"
    needs: ClassVar[tuple] = ("teacher_hidden", "teacher_weights")
    temperature: float = 1.0
    implementation: str = "auto"

    def __call__(self, model, batch, teachers=()):
        from pallas_kernels import fused_reverse_kl
        h_BxTxD = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"],
                        return_hidden=True)
        B, T, D = h_BxTxD.shape
        w_s = model.unembedding()
        mask_BxT = batch["mask"].astype(jnp.float32)
        weights_BxS = batch["teacher_weights"]
        total_BxT = jnp.zeros((B, T), jnp.float32)
        per_teacher = {}
        for s, (h_t, w_t) in enumerate(zip(batch["teacher_hidden"], teachers)):
            routed_BxT = mask_BxT * (weights_BxS[:, s:s + 1] > 0)
            kl_N = fused_reverse_kl(h_BxTxD.reshape(B * T, D), w_s,
                                    h_t.reshape(B * T, -1), w_t, mask_N=routed_BxT.reshape(-1),
                                    temperature=self.temperature,
                                    implementation=self.implementation)
            kl_BxT = kl_N.reshape(B, T)
            total_BxT = total_BxT + weights_BxS[:, s:s + 1] * kl_BxT
            per_teacher[f"teacher{s}/kl"] = losses.masked_mean(jax.lax.stop_gradient(kl_BxT),
                                                               routed_BxT)
            per_teacher[f"teacher{s}/tokens"] = jnp.sum(routed_BxT)
        loss = jnp.sum(total_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)
        return loss, {"loss": jax.lax.stop_gradient(loss),
                      "reverse_kl": jax.lax.stop_gradient(loss)} | per_teacher
