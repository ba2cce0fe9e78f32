"""On-policy distillation from a teacher bank; one knob picks the objective.

Run (teachers are earlier runs: HF folders or opd_jax workdirs; CPU, a few minutes):

    opd-jax opd --config configs/opd.py:kimi_mopd --config.model.init_from=runs/sft_cold \
        --config.teachers.paths="{'general/high': 'runs/grpo_general_high'}" \
        --workdir runs/opd_kimi

prints reward/mean and per-teacher log-ratio / KL per iteration.
Presets: ``kimi_mopd`` (route by (domain, effort), clipped sampled-token signal),
``glm_cross_stage`` (log-ratio advantage in the PPO surrogate, group size 1),
``deepseek_full_vocab`` (weighted full-vocab reverse KL through the fused kernel, teacher
hidden states cached, teachers loaded on demand into a bounded cache), ``topk_distill``
(the KL over each teacher's top-k tokens plus a tail bucket: the signal of a served teacher).
"""
import ml_collections

from _sections import objective, policy_base
from opd_jax.trainers.config_schema import section


def get_config(arg: str = "kimi_mopd") -> ml_collections.ConfigDict:
    c = policy_base()
    c.teachers = section("teachers")
    c.rollout.group_size = 1
    presets = ("kimi_mopd", "glm_cross_stage", "deepseek_full_vocab", "topk_distill")
    if arg not in presets:
        raise KeyError(f"presets are {', '.join(presets)}; got {arg!r}")
    c.objective = objective(arg)       # every option at its declared default
    if arg != "kimi_mopd":
        c.teachers.routing = "domain"
    return c
