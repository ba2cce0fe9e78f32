"""Does training learn? Two specialist teachers, one weaker student, every objective.

Teachers: SFT specialists on arithmetic (general/high) and on Python expressions
(coding/high). Student: a shorter SFT on both. Then, from the student, GRPO and each OPD
objective (student distills both teachers, routed per sample), each with the same
rollout budget. Rewards are greedy on held-out tasks (a seed no trainer sees), per task, so
a change is judged by a paired difference on the same tasks.

    python -m opd_jax.recipes.learning_check --workdir runs/learning_check

prints, per run and cell: student reward before -> after, the teacher's reward, and the
fraction of the teacher's reward reached. `tests/trainers/test_learning.py` runs parts of
it (slow tier) with assertions.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from opd_jax.recipes import trainer_config

FAMILIES = {"general": "arithmetic", "coding": "code_expr"}
CELLS = ("general/high", "coding/high")
# Settings measured to be stable for this toy (see the closing notes of issue 7).
OPD = dict(lr=3e-4, warmup=10, prompts=32, minibatches=4, epochs=2)


def sft(workdir: str, families: dict, steps: int) -> str:
    from opd_jax.trainers.run_sft import train_sft
    cfg = trainer_config("sft.py:tasks", f"--config.data.tasks.families={families}",
                         "--config.data.tasks.efforts=('high',)", f"--config.train.steps={steps}",
                         f"--config.train.ckpt_every={steps}")
    train_sft(cfg, workdir, progress=False)
    return workdir


def rewards(path: str, n: int = 32) -> dict[str, np.ndarray]:
    """Per-task held-out rewards of a checkpoint, per cell (greedy: deterministic)."""
    from opd_jax.models import synthetic_tokenizer
    from opd_jax.teachers import TeacherSpec
    from opd_jax.trainers.episodes import SamplingConfig, play
    from opd_jax.trainers.evaluate import heldout_tasks
    tasks = heldout_tasks(FAMILIES, ("high",), n=n, seed=0)
    eps = play(TeacherSpec(path).load(), synthetic_tokenizer(), tasks,
               SamplingConfig(max_new_tokens=24, temperature=0.0, max_turns=1), seed=0)
    out: dict[str, list] = {c: [] for c in CELLS}
    for e in eps:
        out[f"{e.task.domain}/{e.task.effort}"].append(e.reward)
    return {c: np.asarray(v) for c, v in out.items()}


def setup(root: str, *, teacher_steps: int = 150, student_steps: int = 100) -> dict:
    t_gen = sft(os.path.join(root, "t_gen"), {"general": "arithmetic"}, teacher_steps)
    t_code = sft(os.path.join(root, "t_code"), {"coding": "code_expr"}, teacher_steps)
    student = sft(os.path.join(root, "student"), FAMILIES, student_steps)
    return {"root": root, "t_gen": t_gen, "t_code": t_code, "student": student,
            "teacher_reward": {"general/high": float(rewards(t_gen)["general/high"].mean()),
                               "coding/high": float(rewards(t_code)["coding/high"].mean())},
            "student_rewards": rewards(student)}


def train(models: dict, objective: str, iterations: int, *, lr: float = OPD["lr"]) -> str:
    """GRPO ("grpo") or an OPD objective from the student; returns the run folder."""
    from opd_jax.trainers.run_policy import train_policy
    preset = "grpo.py:tiny" if objective == "grpo" else f"opd.py:{objective}"
    extra = []
    if objective != "grpo":
        paths = {"general/high": models["t_gen"], "coding/high": models["t_code"],
                 "general": models["t_gen"], "coding": models["t_code"]}
        extra = [f"--config.teachers.paths={paths}"]
    prompts = OPD["prompts"] // (4 if objective == "grpo" else 1)   # same rollout budget
    cfg = trainer_config(
        preset, f"--config.tasks.families={FAMILIES}", "--config.tasks.efforts=('high',)",
        f"--config.model.init_from={models['student']}", f"--config.train.steps={iterations}",
        f"--config.optim.lr={lr}", f"--config.optim.warmup_steps={OPD['warmup']}",
        f"--config.rollout.prompts_per_step={prompts}",
        f"--config.rl.minibatches={OPD['minibatches']}", f"--config.rl.ppo_epochs={OPD['epochs']}",
        "--config.eval.every=0", "--config.eval.n=8", *extra)
    run = os.path.join(models["root"], objective)
    train_policy(cfg, run, progress=False)
    return run


def summarize(models: dict, run: str) -> dict:
    before, after = models["student_rewards"], rewards(run)
    out = {}
    for c in CELLS:
        d = after[c] - before[c]
        out[c] = {"before": float(before[c].mean()), "after": float(after[c].mean()),
                  "teacher": models["teacher_reward"][c],
                  "fraction_of_teacher": float(after[c].mean() / models["teacher_reward"][c]),
                  "paired_diff": float(d.mean()),
                  "paired_se": float(d.std(ddof=1) / np.sqrt(len(d)))}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--objectives", nargs="+", default=["deepseek_full_vocab", "kimi_mopd",
                                                        "glm_cross_stage", "grpo"])
    a = p.parse_args(argv)
    models = setup(a.workdir)
    results = {}
    for obj in a.objectives:
        results[obj] = summarize(models, train(models, obj, a.iterations))
        for c, r in results[obj].items():
            print(f"{obj:22s} {c:13s} student {r['before']:.3f} -> {r['after']:.3f}  teacher "
                  f"{r['teacher']:.3f}  reached {r['fraction_of_teacher']:.0%}  paired diff "
                  f"{r['paired_diff']:+.3f} (se {r['paired_se']:.3f})", flush=True)
    with open(os.path.join(a.workdir, "learning_check.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
