"""GRPO with IcePop: an RL specialist for one (domain, effort) cell or a mixture.

Run (after an SFT cold start on task demos; CPU, a few minutes):

    opd-jax sft  --config configs/sft.py:tasks --workdir runs/sft_cold
    opd-jax grpo --config configs/grpo.py:tiny --config.model.init_from=runs/sft_cold \
        --workdir runs/grpo_general_high

prints reward/mean per iteration (rising) and writes checkpoints, metrics.jsonl and tb/.
Presets: ``tiny`` (general/high arithmetic), ``dapo`` (clip-higher, dynamic sampling,
token-mean), ``drgrpo`` (no std scaling, max_len aggregation).
"""
import ml_collections

from _sections import objective, policy_base


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    c = policy_base()
    c.objective = objective("grpo")
    if arg == "tiny":
        pass
    elif arg == "dapo":
        c.objective.options.eps_high = 0.28
        c.rl.dynamic_sampling = True
    elif arg == "drgrpo":
        c.rl.adv_scale = "none"
        c.objective.options.aggregation = "max_len"
        c.objective.options.max_len = 64
    else:
        raise KeyError(f"presets are tiny, dapo, drgrpo; got {arg!r}")
    return c
