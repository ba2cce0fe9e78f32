"""Learning, not just running (slow tier): GRPO raises a tiny model's reward beyond noise, and
an OPD student distilled from two different teachers reaches >= 90% of each teacher's
reward on that teacher's cell, for each of the three objectives.

Setup (fixed seeds, all from scratch in the test): two SFT specialists — arithmetic
(general/high) and Python expressions (coding/high) — and a student given a shorter SFT on
both. Rewards are measured greedily on held-out tasks (a seed the trainers never see), so
they are deterministic functions of the weights; "beyond noise" is a paired difference on
the same held-out tasks larger than 3 standard errors.
"""
import os

import numpy as np
import pytest

from opd_jax.config import load_config
from opd_jax.models import synthetic_tokenizer
from opd_jax.teachers import TeacherSpec
from opd_jax.trainers.episodes import SamplingConfig, play
from opd_jax.trainers.evaluate import heldout_tasks
from opd_jax.trainers.run_policy import train_policy
from opd_jax.trainers.run_sft import train_sft

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAMILIES = {"general": "arithmetic", "coding": "code_expr"}
CELLS = ("general/high", "coding/high")
N_EVAL = 32
OPD_LR = {"deepseek_full_vocab": "2e-3", "kimi_mopd": "2e-4", "glm_cross_stage": "2e-4"}


def _sft(workdir, families, steps):
    cfg = load_config(os.path.join(ROOT, "configs/sft.py:tasks"), [
        f"--config.data.tasks.families={families}", "--config.data.tasks.efforts=('high',)",
        f"--config.train.steps={steps}", f"--config.train.ckpt_every={steps}"])
    train_sft(cfg, str(workdir), progress=False)
    return str(workdir)


def _rewards(path) -> dict[str, np.ndarray]:
    """Per-task held-out rewards of a checkpoint, per cell (greedy: deterministic)."""
    tasks = heldout_tasks(FAMILIES, ("high",), n=N_EVAL, seed=0)
    eps = play(TeacherSpec(path).load(), synthetic_tokenizer(), tasks,
               SamplingConfig(max_new_tokens=24, temperature=0.0, max_turns=1), seed=0)
    out = {c: [] for c in CELLS}
    for e in eps:
        out[f"{e.task.domain}/{e.task.effort}"].append(e.reward)
    return {c: np.asarray(v) for c, v in out.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    t_gen = _sft(root / "t_gen", "{'general': 'arithmetic'}", 150)
    t_code = _sft(root / "t_code", "{'coding': 'code_expr'}", 150)
    student = _sft(root / "student", str(FAMILIES), 100)
    return {"root": root, "t_gen": t_gen, "t_code": t_code, "student": student,
            "teacher_reward": {"general/high": _rewards(t_gen)["general/high"].mean(),
                               "coding/high": _rewards(t_code)["coding/high"].mean()},
            "student_rewards": _rewards(student)}


def _policy(preset, workdir, init_from, *extra):
    cfg = load_config(os.path.join(ROOT, f"configs/{preset}"), [
        f"--config.tasks.families={FAMILIES}", "--config.tasks.efforts=('high',)",
        f"--config.model.init_from={init_from}", "--config.eval.every=0",
        "--config.eval.n=8", "--config.rollout.prompts_per_step=32",
        "--config.rl.minibatches=2", *extra])
    train_policy(cfg, str(workdir), progress=False)
    return str(workdir)


def test_grpo_reward_rises_beyond_noise(models):
    run = _policy("grpo.py:tiny", models["root"] / "grpo", models["student"],
                  "--config.train.steps=30", "--config.optim.lr=1e-3",
                  "--config.rollout.prompts_per_step=16", "--config.rollout.group_size=4")
    before, after = models["student_rewards"], _rewards(run)
    diff = np.concatenate([after[c] - before[c] for c in CELLS])
    se = diff.std(ddof=1) / np.sqrt(len(diff))
    print(f"GRPO held-out reward {np.mean(np.concatenate(list(before.values()))):.3f} -> "
          f"{np.mean(np.concatenate(list(after.values()))):.3f}; paired diff "
          f"{diff.mean():.3f} (se {se:.3f})")
    assert diff.mean() > 3 * se and diff.mean() > 0.05


@pytest.mark.parametrize("objective", ["deepseek_full_vocab", "kimi_mopd", "glm_cross_stage"])
def test_opd_student_reaches_teachers(models, objective):
    teachers = {"general/high": models["t_gen"], "coding/high": models["t_code"],
                "general": models["t_gen"], "coding": models["t_code"]}
    run = _policy(f"opd.py:{objective}", models["root"] / objective, models["student"],
                  "--config.train.steps=40", f"--config.optim.lr={OPD_LR[objective]}",
                  f"--config.teachers.paths={teachers}")
    start, end = models["student_rewards"], _rewards(run)
    report = {c: (round(float(start[c].mean()), 3), round(float(end[c].mean()), 3),
                  round(float(models["teacher_reward"][c]), 3)) for c in CELLS}
    print(f"{objective} (student start, student end, teacher) per cell: {report}")
    # The test means something: the student starts below 90% of a teacher somewhere ...
    assert any(start[c].mean() < 0.9 * models["teacher_reward"][c] for c in CELLS)
    # ... and ends at >= 90% of each teacher on that teacher's cell.
    for c in CELLS:
        assert end[c].mean() >= 0.9 * models["teacher_reward"][c], (c, report)
