"""DeepSeek-V4 recipe: a bank of specialists -> weighted full-vocabulary reverse-KL OPD.

Run (from the repository root):

    opd-jax experiment --config experiments/deepseek_v4/config.py:reduced --workdir runs/deepseek_v4

On the testbed (docs/testbed.md), from the shipped base. Four specialists (general at low
and max effort — different thinking budgets and length penalties — agent, coding), each GRPO
from a shared SFT start; the student distills all four
through the fused kernel with a teacher cache of 2 (< the bank), hidden-state caching on;
a sampled-token OPD student with the same rollouts and steps and the merged specialists are
the baselines. Presets: ``reduced`` (1 seed), ``full`` (3 seeds), ``smoke`` (tests; a random
1-layer model), ``scale_v5p64`` / ``scale_8xh100`` (Qwen3-1.7B students, Qwen3-8B specialists from their own
SFT stage, on a TPU v5p-64 or 8xH100 mesh; compile-checked, not run:
``python -m studies.scale_estimate --config experiments/deepseek_v4/config.py:scale_8xh100``).
"""
import ml_collections

from opd_jax.recipes import policy_overrides as run
from opd_jax.recipes import on_testbed, shrink_for_smoke
from opd_jax.recipes import trainer_config as base
from opd_jax.recipes import TESTBED
from studies.scale_up import MESHES, apply_scale


def get_config(arg: str = "reduced") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.recipe = "deepseek_v4"
    c.tokenizer = "synthetic"
    c.seeds = (0,)
    c.domains = dict(TESTBED)     # general: chain, agent: tool_chain, coding: code_trace
    # specialist key -> (domain, effort); effort = thinking budget + length penalty
    c.specialists = {"math_short": ("general", "low"), "math_long": ("general", "max"),
                     "agent": ("agent", "high"), "code": ("coding", "high")}
    # The cold start: a short SFT of the shipped base on every domain's demos (all efforts).
    c.sft = base("sft.py:tasks", "--config.train.steps=30", "--config.train.ckpt_every=30",
                 "--config.optim.lr=3e-4", "--config.optim.warmup_steps=5")
    # Each specialist first fine-tunes on its own cell' demos, then RL (train.steps=0: RL only).
    c.specialist_sft = base("sft.py:tasks", "--config.train.steps=60",
                            "--config.train.ckpt_every=60", "--config.optim.lr=5e-4",
                            "--config.optim.warmup_steps=5")
    c.specialist = base("grpo.py:tiny", *run(steps=20, lr=2e-4, prompts=16))
    # Both students: the same rollouts and optimizer steps (the full-vocabulary objective's
    # learning_check settings: 64 prompts x 4 minibatches, lr 3e-4 with cosine decay).
    opd = [*run(steps=60, lr=3e-4, prompts=64), "--config.teachers.max_loaded=2",
           "--config.rl.minibatches=4", "--config.optim.schedule=cosine"]
    c.student = base("opd.py:deepseek_full_vocab", *opd)
    c.sampled_student = base("opd.py:kimi_mopd", *opd)
    c.merge = ml_collections.ConfigDict(dict(method="task_arithmetic", scale=1.0))
    c.eval = base("eval.py:grid").eval
    c.eval.n = 64
    # Difficulty 2, not the testbed's 3, as in kimi_k3 (its config says why): at 3 the
    # low-effort and direct-answer cells of the base score about 0.05, where ratios are noise.
    on_testbed(c, ("sft", "specialist_sft"), ("specialist", "student", "sampled_student"),
               difficulty=2 if arg in ("reduced", "full") else None)
    if arg == "reduced":
        pass
    elif arg == "full":
        c.seeds = (0, 1, 2)
        c.specialist.train.steps = 40
        c.student.train.steps = c.sampled_student.train.steps = 120
    elif arg == "smoke":
        c.domains = {"general": "chain", "coding": "code_trace"}
        c.specialists = {"math_short": ("general", "low"), "math_long": ("general", "max"),
                         "code": ("coding", "low")}
        shrink_for_smoke(c, c.specialist, c.student, c.sampled_student)
        c.specialist_sft.train.steps = 2
    elif arg in MESHES:          # scale_v5p64, scale_8xh100: real sizes, compile-checked
        c.specialist_sft.train.steps = 0
        apply_scale(c, arg)
    else:
        raise KeyError(f"presets are reduced, full, smoke, {', '.join(MESHES)}; got {arg!r}")
    return c
