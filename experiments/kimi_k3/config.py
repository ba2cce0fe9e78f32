"""Kimi K3 recipe: SFT cold start -> 9 GRPO teachers (domain x effort) -> MOPD student.

Run (from the repository root):

    opd-jax experiment --config experiments/kimi_k3/config.py:reduced --workdir runs/kimi_k3

Presets:
  ``reduced`` — the README's main job: one testbed domain (general: chain) x 3 efforts,
                from the shipped base, short runs, one seed. Prints the retention table.
  ``full``    — 3 domains x 3 efforts, annealed and plain effort ladders, 3 seeds (hours on
                a CPU; minutes on an accelerator).
  ``smoke``   — the smallest pipeline for tests (a random 1-layer model, one domain, two
                efforts, a few iterations).
  ``scale_v5p64``, ``scale_8xh100`` — real sizes (Qwen3-1.7B student, Qwen3-8B teachers from
                their own SFT stage, 3 domains x 3 efforts, annealed ladder) on a TPU v5p-64
                or an 8xH100 mesh; compile-checked, not run (placeholder checkpoint paths):

    python -m opd_jax.recipes.scale_up --config experiments/kimi_k3/config.py:scale_8xh100

Every stage resumes from its checkpoints if the command is re-run with the same workdir.
"""
import ml_collections

from opd_jax.recipes import policy_overrides as run
from opd_jax.recipes import on_testbed, shrink_for_smoke
from opd_jax.recipes import trainer_config as base
from opd_jax.recipes.scale_up import MESHES, apply_scale
from opd_jax.recipes.testbed import TESTBED


def get_config(arg: str = "reduced") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.recipe = "kimi_k3"
    c.tokenizer = "synthetic"
    c.seeds = (0,)
    c.domains = dict(TESTBED)     # general: chain, agent: tool_chain, coding: code_trace
    c.efforts = ("low", "high", "max")
    c.effort_schedule = "anneal"          # "anneal" (Kimi's ladder) | "plain" | "both"
    c.teacher_level = 0.95                # "teacher level" = this fraction of teacher reward
    # The cold start: a short SFT of the shipped base on every domain's demos (all efforts).
    c.sft = base("sft.py:tasks", "--config.train.steps=30", "--config.train.ckpt_every=30",
                 "--config.optim.lr=3e-4", "--config.optim.warmup_steps=5")
    # Each domain's top teacher first fine-tunes the cold start on its own cell's demos
    # (train.steps=0: GRPO straight from the cold start, as the seed's Kimi ladder reads).
    c.specialist_sft = base("sft.py:tasks", "--config.train.steps=60",
                            "--config.train.ckpt_every=60", "--config.optim.lr=5e-4",
                            "--config.optim.warmup_steps=5")
    c.teacher = base("grpo.py:tiny", *run(steps=20, lr=2e-4, prompts=16))
    # Sampled-token OPD needs many rollouts per step at a small lr (see learning_check).
    c.student = base("opd.py:kimi_mopd", *run(steps=40, lr=1e-4, prompts=64),
                     "--config.rl.minibatches=4")
    c.merge = ml_collections.ConfigDict(dict(method="task_arithmetic", scale=1.0))
    c.eval = base("eval.py:grid").eval
    c.eval.n = 64
    on_testbed(c, ("sft", "specialist_sft"), ("teacher", "student"))
    if arg == "reduced":
        c.domains = {"general": "chain"}
    elif arg == "full":
        c.seeds = (0, 1, 2)
        c.effort_schedule = "both"
        c.teacher.train.steps = 40
        c.student.train.steps = 40
    elif arg == "smoke":
        c.domains = {"general": "chain"}
        c.efforts = ("high", "max")
        shrink_for_smoke(c, c.teacher, c.student)
        c.specialist_sft.train.steps = 2
    elif arg in MESHES:          # scale_v5p64, scale_8xh100: real sizes, compile-checked
        c.specialist_sft.train.steps = 0    # teachers' own cold start is c.teacher_sft
        apply_scale(c, arg)
    else:
        raise KeyError(f"presets are reduced, full, smoke, {', '.join(MESHES)}; got {arg!r}")
    return c
