"""Training objectives for the policy trainers, picked by name from a small registry.

Legend: B rows, T targets, V vocab, D student hidden, E teacher hidden, S teacher slots.

An objective is a frozen dataclass called as ``objective(model, batch, teachers) ->
(loss, metrics)`` inside the jitted step. `batch` is a sequence batch
(:mod:`opd_jax.episodes.sequences`) plus what the objective declares in ``needs`` (a
`Needs`; the driver reads it and never switches on names; docs/objectives.md);
`teachers` is a tuple of teacher unembedding matrices (only the full-vocab objective uses
it). Sampled-token objectives (grpo, kimi_mopd, glm_cross_stage) score the student with full
logits; the full-vocab objective never builds [B, T, V] logits: it feeds the student's and
the cached teachers' last-layer hidden states to the fused reverse-KL kernel.

Vocab-parallel kernel. An objective whose `Needs` declare ``vocab_parallel`` (the
full-vocab one) runs its fused kernel with V sharded when the run's mesh splits the
`vocab` logical axis (default rules: the "tensor" mesh axis, when its size is > 1): the
driver calls `Needs.on_mesh`, which fills the objective's `vocab_parallel` field (a
`VocabParallel`: mesh, vocab axis, token axes) and checks that V divides over that axis,
and passes the teacher unembeddings [E, V] into the step sharded over V
(`Needs.unembedding_sharding`) instead of replicated. Otherwise the kernel runs per device
on whole unembeddings, as before.

Behaviour distribution. The sampled-token objectives take ``behaviour``, the rollout
sampler's settings (``cfg.rollout.sampling``: temperature, top-k, top-p). The log-probs that
enter the PPO ratio exp(lp - lp_old) and the IcePop/TIS mismatch exp(lp_old - lp_sampler)
are computed under the distribution the sampler drew from (`behaviour_logprobs`: the
sampler's own `process_logits`, i.e. logits / T, then its top-k/top-p truncation,
renormalised over the kept tokens), so the mismatch measures only train/inference numerics.
The OPD teacher comparison (Kimi's r_t, GLM's lp_old - lp_T, the per-teacher metrics) keeps
the plain T = 1 student log-probs, the distribution the teacher's log-probs are on.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

import ml_collections

from opd_jax import losses
from opd_jax.rollout.sampling import SamplingParams, process_logits
from opd_jax.schema import Bool, Choice, Float, Int, check_options, option, option_fields
from pallas_kernels.common import IMPLEMENTATIONS
from opd_jax.trainers.needs import TEACHER_KINDS, Needs, PolicyBatch, VocabParallel  # noqa: F401

# The registry: name -> objective class (`register`); `make_objective` builds one.
OBJECTIVES: dict[str, type] = {}


def register(cls):
    """Class decorator: add an objective to the registry under ``cls.name``. The class
    declares ``name: ClassVar[str]`` and ``needs: ClassVar[Needs]``."""
    if not isinstance(getattr(cls, "needs", None), Needs):
        raise TypeError(f"objective {cls.__name__}: `needs` must be a Needs(...), got "
                        f"{getattr(cls, 'needs', None)!r}")
    if cls.needs.vocab_parallel and "vocab_parallel" not in {
            f.name for f in dataclasses.fields(cls)}:
        raise TypeError(f"objective {cls.__name__}: Needs(vocab_parallel=True) needs a field "
                        f"`vocab_parallel: VocabParallel | None = None` (Needs.on_mesh sets it)")
    OBJECTIVES[cls.name] = cls
    return cls


def needs_of(name: str) -> Needs:
    """The `Needs` of the registered objective `name` (e.g. for the scale-up estimator)."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; available: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name].needs


def check_needs(name: str, cfg) -> None:
    """`Needs.check` of the registered objective `name` against `cfg`."""
    mixture = [n for n, c in OBJECTIVES.items() if c.needs.mixture]
    needs_of(name).check(name, cfg, mixture)


def default_options(name: str, **overrides) -> ml_collections.ConfigDict:
    """The options section of objective `name` (``objective.options`` of a config): every
    declared option at its declared default (the mismatch correction as a sub-section),
    then `overrides`."""
    cls = OBJECTIVES[name]
    out = {k: f.default for k, f in option_fields(cls).items()}
    if "correction" in {f.name for f in dataclasses.fields(cls)}:
        out["correction"] = dataclasses.asdict(losses.Correction())
    unknown = sorted(set(overrides) - set(out))
    if unknown:
        raise ValueError(f"objective {name!r} has no option(s) {unknown}; options: {sorted(out)}")
    return ml_collections.ConfigDict(out | overrides)


def make_objective(name: str, *, sampling=None, **kwargs) -> Any:
    """The objective `name` with its options; `sampling` (the rollout sampling config, e.g.
    ``cfg.rollout.sampling``) sets the behaviour distribution of objectives that have one."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; available: {', '.join(sorted(OBJECTIVES))}")
    kwargs = {k: v.to_dict() if hasattr(v, "to_dict") else v      # config sections
              for k, v in kwargs.items()}
    fields = {f.name for f in dataclasses.fields(OBJECTIVES[name])}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"objective {name!r} has no option(s) {unknown}; options: {sorted(fields)}")
    if sampling is not None and "behaviour" in fields:
        if "behaviour" in kwargs:
            raise ValueError(f"objective {name!r}: behaviour comes from the rollout sampling "
                             f"config; do not also set it as an option")
        kwargs["behaviour"] = Behaviour.of(sampling)
    if "vocab_parallel" in kwargs and OBJECTIVES[name].needs.vocab_parallel:
        raise ValueError(f"objective {name!r}: vocab_parallel comes from the run's mesh "
                         f"(mesh.shape, mesh.rules; Needs.on_mesh); do not set it as an option")
    try:       # option values are checked here, before any work (their __post_init__)
        return OBJECTIVES[name](**kwargs)
    except ValueError as e:
        raise ValueError(f"objective {name!r}, --config.objective.options: {e}") from None


# Log-prob given to a sampled token that the recomputed top-k/top-p set excludes (possible
# after a policy update, or at a numerical tie at the cut): finite, so PPO ratios and IcePop
# stay finite (k_t ~ 0: IcePop/TIS weight the token ~0), and exp(-LOGP_FLOOR) fits in fp32.
LOGP_FLOOR = -30.0


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """The rollout sampler's distribution: softmax(truncate(logits / temperature)).

    temperature 0 (greedy) is a point mass, which has no useful log-prob: the objectives
    then keep the plain T = 1 log-probs (the sampler reports 0 for greedy tokens, so
    IcePop/TIS stay degenerate, as `builders` warns). top_k 0 and top_p 1 mean off.
    """
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def of(cls, sampling) -> Behaviour:
        """From anything with temperature / top_k / top_p (SamplingConfig, ConfigDict)."""
        get = sampling.get if hasattr(sampling, "get") else functools.partial(getattr, sampling)
        return cls(float(get("temperature", 1.0)), int(get("top_k", 0)),
                   float(get("top_p", 1.0)))

    @property
    def plain(self) -> bool:
        """True when the training log-probs are the plain T = 1 ones (untempered and
        untruncated sampling, or greedy)."""
        return self.temperature == 0 or (self.temperature == 1.0 and self.top_k == 0
                                         and self.top_p == 1.0)


def behaviour_logprobs(logits_BxTxV, targets_BxT, behaviour: Behaviour | None) -> jax.Array:
    """lp_t = log p_behaviour(y_t): the log-prob of each target under the distribution the
    sampler drew from, computed by the sampler's own `rollout.process_logits` (fp32).

    Plain behaviour (None, T = 1 untruncated, or greedy) gives `losses.token_logprobs`, the
    T = 1 log-probs, unchanged. Targets outside the top-k/top-p set get LOGP_FLOOR.
    With top-k/top-p this sorts the vocabulary of every position ([B*T, V] buffers).
    """
    if behaviour is None or behaviour.plain:
        return losses.token_logprobs(logits_BxTxV, targets_BxT)
    *lead, V = logits_BxTxV.shape
    n = math.prod(lead)
    params = SamplingParams.create(n, temperature=behaviour.temperature,
                                   top_k=behaviour.top_k, top_p=behaviour.top_p)
    logp_NxV = process_logits(logits_BxTxV.reshape(n, V), params)
    lp_N = jnp.take_along_axis(logp_NxV, targets_BxT.reshape(n, 1), axis=-1, mode="clip")[:, 0]
    lp_N = jnp.where(jnp.isneginf(lp_N), LOGP_FLOOR, lp_N)
    return lp_N.reshape(targets_BxT.shape)


def student_logp(model, batch, temperature: float = 1.0):
    logits_BxTxV = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
    return losses.token_logprobs(logits_BxTxV, batch["targets"], temperature=temperature)


def student_logps(model, batch, behaviour: Behaviour | None):
    """(plain T = 1 log-probs, behaviour log-probs) of the targets from one forward; the
    same array twice when the behaviour is plain."""
    logits_BxTxV = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
    plain_BxT = losses.token_logprobs(logits_BxTxV, batch["targets"])
    if behaviour is None or behaviour.plain:
        return plain_BxT, plain_BxT
    return plain_BxT, behaviour_logprobs(logits_BxTxV, batch["targets"], behaviour)


def old_plain_logp(o, batch):
    """The plain T = 1 old log-probs: batch["old_logp_plain"], or batch["old_logp"] itself
    when the behaviour is plain."""
    if o.behaviour.plain:
        return batch["old_logp"]
    if "old_logp_plain" not in batch:
        raise KeyError(f"{o.name} with behaviour {o.behaviour} needs batch['old_logp_plain'] "
                       f"(the T = 1 old log-probs; `policy.batch_logprobs` returns them)")
    return batch["old_logp_plain"]


def _correction_kwargs(o, batch):
    return dict(sampler_logp_BxT=batch["sampler_logp"] if o.correction.kind else None,
                correction=o.correction, aggregation=o.aggregation, max_len=o.max_len)


# Per-teacher metrics are arrays [S] under this prefix: slot s of "teacher/log_ratio" is the
# s-th teacher of the iteration (the driver names it: "teacher/<key>/log_ratio").
PER_TEACHER = "teacher/"


def per_teacher_metrics(values: dict[str, jax.Array], onehot_BxS, mask_BxT) -> dict:
    """Masked means of per-token values over the rows routed to each teacher slot, as
    arrays [S] ("teacher/<name>"), with the tokens each slot scored ("teacher/tokens")."""
    m_SxBxT = mask_BxT[None] * onehot_BxS.T[:, :, None]
    out = {f"{PER_TEACHER}{name}": jax.vmap(lambda m, v=v: losses.masked_mean(v, m))(m_SxBxT)
           for name, v in values.items()}
    out[f"{PER_TEACHER}tokens"] = jnp.sum(m_SxBxT, axis=(1, 2)).astype(jnp.float32)
    return out


# Options more than one objective declares.
AGGREGATION = Choice("token_mean", losses.AGGREGATIONS)
MAX_LEN = Int(None, lo=1, optional=True, hint="the max_len aggregation's normalizer")


@dataclasses.dataclass(frozen=True)
class _PolicyOptions:
    # Option fields: each declares its default, type and range (the config schema's).
    eps_low: float = option(Float(0.2, lo=0, hi=1, hi_open=True))
    eps_high: float = option(Float(0.2, lo=0))
    correction: losses.Correction = losses.Correction()   # IcePop by default
    aggregation: str = option(AGGREGATION)
    max_len: int | None = option(MAX_LEN)
    behaviour: Behaviour = Behaviour()   # set from cfg.rollout.sampling by make_objective

    def __post_init__(self):   # option values checked when the objective is built (no work yet)
        check_options(self)
        # a config value (None, "tis", a {kind, icepop_bounds, ...} section) -> Correction
        object.__setattr__(self, "correction", losses.Correction.of(self.correction))


@register
@dataclasses.dataclass(frozen=True)
class GRPO(_PolicyOptions):
    """GRPO / DAPO / Dr.GRPO policy loss with IcePop or TIS (see `losses.grpo_loss`)."""
    name: ClassVar[str] = "grpo"
    needs: ClassVar[Needs] = Needs(min_group_size=2, reference="kl_beta")
    kl_beta: float = option(Float(0.0, lo=0, hint="0: no KL to the reference"))

    def __call__(self, model, batch: PolicyBatch, teachers: tuple = ()):
        # old_logp / ref_logp are scored under the same behaviour (`batch_logprobs`).
        _, logp_BxT = student_logps(model, batch, self.behaviour)
        return losses.grpo_loss(
            logp_BxT, batch["old_logp"], batch["adv"], batch["mask"], eps_low=self.eps_low,
            eps_high=self.eps_high, ref_logp_BxT=batch.get("ref_logp"), kl_beta=self.kl_beta,
            **_correction_kwargs(self, batch))


@register
@dataclasses.dataclass(frozen=True)
class KimiMOPD(_PolicyOptions):
    """Kimi K3 MOPD: routed teacher, r = clip(sg(lp_T - lp), -r_max, r_max) per token."""
    name: ClassVar[str] = "kimi_mopd"
    needs: ClassVar[Needs] = Needs(teacher="logp")
    r_max: float = option(Float(5.0, lo=0, lo_open=True))
    # reuse the batch: PPO ratio/clip, r from lp_old
    ppo: bool = option(Bool(False))
    # IW-OPD position weight 1 + gamma (1 - prefix share)
    position_gamma: float = option(Float(0.0, lo=0))

    def check_config(self, cfg) -> None:
        """Without the PPO ratio a second pass over the batch is off-policy."""
        if not self.ppo and cfg.rl.ppo_epochs > 1:
            raise ValueError(f"rl.ppo_epochs={cfg.rl.ppo_epochs} with kimi_mopd ppo=False: a "
                             f"second pass over the batch would use r_t and the gradient of "
                             f"a policy that no longer sampled it; expected ppo_epochs=1, or "
                             f"--config.objective.options.ppo=True (importance-sampled reuse "
                             f"with the PPO ratio and the IcePop gate)")

    def __call__(self, model, batch: PolicyBatch, teachers: tuple = ()):
        plain_BxT, logp_BxT = student_logps(model, batch, self.behaviour)
        teacher_BxT = batch["teacher_logp"]
        if not self.behaviour.plain:
            # The loss forms r_t = teacher - ref from ref = the behaviour log-prob (lp, or
            # lp_old with ppo); shift the teacher by sg(ref - ref_plain) so that r_t compares
            # the teacher with the plain T = 1 student: r_t = teacher - ref_plain.
            ref_BxT, ref_plain_BxT = ((batch["old_logp"], old_plain_logp(self, batch))
                                      if self.ppo else (logp_BxT, plain_BxT))
            teacher_BxT = teacher_BxT + jax.lax.stop_gradient(ref_BxT - ref_plain_BxT)
        loss, metrics = losses.kimi_mopd_loss(
            logp_BxT, teacher_BxT, batch["mask"], r_max=self.r_max,
            old_logp_BxT=batch["old_logp"] if self.ppo else None, eps_low=self.eps_low,
            eps_high=self.eps_high, position_gamma=self.position_gamma,
            **_correction_kwargs(self, batch))
        ratio_BxT = jax.lax.stop_gradient(batch["teacher_logp"] - plain_BxT)
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
    needs: ClassVar[Needs] = Needs(teacher="logp")
    kl_coef: float = option(Float(1.0, lo=0))
    # > 0 mixes in the task advantage (batch["adv"])
    task_reward_weight: float = option(Float(0.0, lo=0))
    # IW-OPD position weight 1 + gamma (1 - prefix share)
    position_gamma: float = option(Float(0.0, lo=0))

    def __call__(self, model, batch: PolicyBatch, teachers: tuple = ()):
        _, logp_BxT = student_logps(model, batch, self.behaviour)
        task_adv = batch["adv"] * self.task_reward_weight if self.task_reward_weight else None
        old_plain_BxT = old_plain_logp(self, batch)
        # The loss forms lp_old - lp_T from the behaviour lp_old; shift the teacher by
        # sg(lp_old - lp_old_plain) so the OPD advantage is lp_old_plain - lp_T (T = 1).
        teacher_BxT = batch["teacher_logp"]
        if not self.behaviour.plain:
            teacher_BxT = teacher_BxT + jax.lax.stop_gradient(batch["old_logp"] - old_plain_BxT)
        loss, metrics = losses.glm_opd_loss(
            logp_BxT, batch["old_logp"], teacher_BxT, batch["mask"],
            eps_low=self.eps_low, eps_high=self.eps_high, task_adv=task_adv,
            kl_coef=self.kl_coef, position_gamma=self.position_gamma,
            **_correction_kwargs(self, batch))
        ratio_BxT = batch["teacher_logp"] - old_plain_BxT
        metrics |= per_teacher_metrics({"log_ratio": ratio_BxT, "reverse_kl_est": -ratio_BxT},
                                       batch["teacher_onehot"], batch["mask"])
        return loss, metrics


@register
@dataclasses.dataclass(frozen=True)
class DeepSeekFullVocab:
    """DeepSeek-V4: sum_s w_bs KL(pi_theta || pi_Ts) over the full vocabulary, fused.

    `batch["teacher_hidden"]` is a tuple of S cached teacher hidden-state arrays
    [B, T, E_s] (aligned to the student's targets); `teachers` the S unembeddings
    [E_s, V]; `batch["teacher_weights"]` [B, S] sums to 1 per row. The loss is
    `losses.reverse_kl_loss_from_hidden` (routed form: teacher s only on its rows), reduced
    with `aggregation` like the other objectives.

    `vocab_parallel` is not an option: the driver sets it from the run's mesh
    (`Needs.on_mesh`); then the kernel splits V over that mesh axis (the student's and the
    teachers' unembeddings sharded over V, per-shard statistics combined) and the tokens
    over the batch axes, with the same result.
    """
    name: ClassVar[str] = "deepseek_full_vocab"
    needs: ClassVar[Needs] = Needs(teacher="hidden", mixture=True, old_logp=False,
                                   vocab_parallel=True)
    temperature: float = option(Float(1.0, lo=0, lo_open=True))
    implementation: str = option(Choice("auto", IMPLEMENTATIONS))
    aggregation: str = option(AGGREGATION)
    max_len: int | None = option(MAX_LEN)
    vocab_parallel: VocabParallel | None = None

    def __post_init__(self):
        check_options(self)

    def __call__(self, model, batch: PolicyBatch, teachers: tuple = ()):
        h_BxTxD = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"],
                        return_hidden=True)
        kernel_kw = self.vocab_parallel.kernel_kw() if self.vocab_parallel else {}
        loss, metrics = losses.reverse_kl_loss_from_hidden(
            h_BxTxD, model.unembedding(), tuple(batch["teacher_hidden"]), tuple(teachers),
            batch["mask"], weights=batch["teacher_weights"], temperature=self.temperature,
            aggregation=self.aggregation, max_len=self.max_len,
            implementation=self.implementation, **kernel_kw)
        out = {"loss": metrics["loss"], "reverse_kl": metrics["reverse_kl"]}
        mask_BxT = batch["mask"].astype(jnp.float32)
        B, T = mask_BxT.shape
        # [S, B, T] whatever the weights' form ([B, S] per row, [B, T, S] per token)
        w_SxBxT = losses.kl.weights_KxBxT(batch["teacher_weights"], len(teachers), B, T)
        out[f"{PER_TEACHER}kl"] = jnp.stack([metrics[f"reverse_kl_teacher{s}"]
                                             for s in range(len(teachers))])
        out[f"{PER_TEACHER}tokens"] = jnp.sum((w_SxBxT > 0) * mask_BxT, axis=(1, 2))
        # The share of the minibatch's loss weight each teacher carries (sums to 1 over the
        # teachers) and the share of its tokens it scores: over the whole (global) batch.
        total = jnp.maximum(jnp.sum(mask_BxT), 1.0)
        out[f"{PER_TEACHER}weight"] = jnp.sum(w_SxBxT * mask_BxT, axis=(1, 2)) / total
        out[f"{PER_TEACHER}load"] = out[f"{PER_TEACHER}tokens"] / total
        return loss, out


@register
@dataclasses.dataclass(frozen=True)
class TopKDistill:
    """Top-k teacher signal: the KL between the student and each row's teacher over the
    teacher's `top_k` most likely tokens plus a tail bucket (`losses.topk_kl_loss`), the
    form a served teacher can send (top-k log-probs per position). `direction` "reverse"
    (student first, the OPD direction) or "forward" (verl's `forward_kl_topk`). The teacher
    is scored at `temperature` and the student compared at the same one (`Needs.scoring_kw`
    hands it to the scorer). One teacher per row (routing cell / domain / table)."""
    name: ClassVar[str] = "topk_distill"
    needs: ClassVar[Needs] = Needs(teacher="topk", old_logp=False)
    top_k: int = option(Int(32, lo=1, hint="the teacher's tokens per position (verl: 32)"))
    direction: str = option(Choice("reverse", losses.topk.DIRECTIONS))
    temperature: float = option(Float(1.0, lo=0, lo_open=True))
    aggregation: str = option(AGGREGATION)
    max_len: int | None = option(MAX_LEN)

    def __post_init__(self):
        check_options(self)

    def __call__(self, model, batch: PolicyBatch, teachers: tuple = ()):
        logits_BxTxV = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
        mask_BxT = batch["mask"]
        div_BxT, per = losses.topk.topk_divergence(
            logits_BxTxV, batch["teacher_topk_ids"], batch["teacher_topk_logp"],
            direction=self.direction, temperature=self.temperature)
        loss = losses.aggregate(div_BxT, mask_BxT, self.aggregation, max_len=self.max_len)
        sg = jax.lax.stop_gradient
        metrics = {"loss": sg(loss), "topk_kl": losses.masked_mean(sg(div_BxT), mask_BxT)}
        metrics |= {name: losses.masked_mean(v, mask_BxT) for name, v in per.items()}
        metrics |= per_teacher_metrics({"kl": sg(div_BxT),
                                        "topk_mass": per["teacher_topk_mass"]},
                                       batch["teacher_onehot"], mask_BxT)
        return loss, {k: v.astype(jnp.float32) for k, v in metrics.items()}
