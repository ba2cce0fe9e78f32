"""On-policy distillation from a teacher bank; one knob picks the objective.

Run (teachers are earlier runs: HF folders or opd_jax workdirs; CPU, a few minutes):

    opd-jax opd --config configs/opd.py:kimi_mopd --config.model.init_from=runs/sft_cold \
        --config.teachers.paths="{'general/high': 'runs/grpo_general_high'}" \
        --workdir runs/opd_kimi

prints reward/mean and per-teacher log-ratio / KL per iteration.
Presets: ``kimi_mopd`` (route by (domain, effort), clipped sampled-token signal),
``glm_cross_stage`` (log-ratio advantage in the PPO surrogate, group size 1),
``deepseek_full_vocab`` (weighted full-vocab reverse KL through the fused kernel, teacher
hidden states cached, teachers loaded on demand into a bounded cache).
"""
import ml_collections

from _sections import correction_config, policy_base


def get_config(arg: str = "kimi_mopd") -> ml_collections.ConfigDict:
    c = policy_base()
    c.teachers = ml_collections.ConfigDict(dict(
        paths={},                 # key -> checkpoint folder
        routing="cell",           # "cell" (domain/effort) | "domain" | "table" | "mixture"
        table={},                 # routing="table": cell or domain -> key
        weights={},               # routing="mixture": cell or domain -> {key: weight}, sum 1
        max_loaded=0,             # LRU bound on loaded teachers (0 = unbounded)
        prompt_role="student",    # teachers see the student's prompt ("teacher": no effort token)
    ))
    c.rollout.group_size = 1
    pg = dict(eps_low=0.2, eps_high=0.2, correction=correction_config(),
              aggregation="token_mean", max_len=None,
              position_gamma=0.0)    # IW-OPD position weighting (docs/objectives.md)
    if arg == "kimi_mopd":
        opts = dict(pg, r_max=5.0, ppo=False)
    elif arg == "glm_cross_stage":
        opts = dict(pg, kl_coef=1.0, task_reward_weight=0.0)
        c.teachers.routing = "domain"
    elif arg == "deepseek_full_vocab":
        opts = dict(temperature=1.0, implementation="auto")
        c.teachers.routing = "domain"
    else:
        raise KeyError(f"presets are kimi_mopd, glm_cross_stage, deepseek_full_vocab; got {arg!r}")
    c.objective = ml_collections.ConfigDict(dict(name=arg, options=ml_collections.ConfigDict(opts)))
    return c
