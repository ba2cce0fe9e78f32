"""The glm, deepseek_v4 and kimi_k3 claims are functions of their results: synthetic per-problem
rewards in which each claim holds, then the change that makes it fail."""
import copy

from opd_jax.recipes import recipe_module

N = 40           # problems per cell and seed


def _r(p, k=0):
    """Per-problem rewards with mean p (a deterministic 0/1 pattern, shifted by k)."""
    ones = round(p * N)
    rewards = [1.0 if (i + k) % N < ones else 0.0 for i in range(N)]
    return {"reward": sum(rewards) / N, "rewards": rewards}


def _glm(levels: dict) -> dict:
    """levels: stage -> domain -> reward (both seeds, both modes alike)."""
    stages = ["sft", "reasoning_rl", "agentic_rl", "student", "merge"]
    cells = {f"{d}/{m}": {s: [_r(levels[s][d], k) for k in (0, 1)] for s in stages}
             for d in ("general", "agent") for m in ("think_on", "think_off")}
    return {"recipe": "glm", "seeds": [0, 1], "stages": stages,
            "stage_domains": {"reasoning_rl": ["general"], "agentic_rl": ["agent"]},
            "stage_teachers": {"general": "reasoning_rl", "agent": "agentic_rl"},
            "modes": {"general": ["think_on", "think_off"], "agent": ["think_on", "think_off"]},
            "cells": cells}


def test_glm_claims_follow_the_stage_line():
    glm = recipe_module("glm")
    good = {"sft": {"general": 0.3, "agent": 0.3},
            "reasoning_rl": {"general": 0.8, "agent": 0.1},
            "agentic_rl": {"general": 0.2, "agent": 0.9},
            "student": {"general": 0.8, "agent": 0.9},
            "merge": {"general": 0.5, "agent": 0.5}}
    passed = [c["pass"] for c in glm.claims(_glm(good))]
    assert passed == [True, True, True, True], glm.claims(_glm(good))
    bad = copy.deepcopy(good)
    bad["student"]["general"] = 0.5         # recovers half of 0.6 forgotten
    bad["agentic_rl"]["agent"] = 0.1        # the agent stage learns nothing
    cl = glm.claims(_glm(bad))
    assert [c["pass"] for c in cl] == [False, True, False, True], cl
    assert "50%" in cl[2]["measured"]
    worse = copy.deepcopy(good)
    worse["student"]["agent"] = 0.8         # 89% of the last stage's own domain
    assert [c["pass"] for c in glm.claims(_glm(worse))] == [True, True, True, False]
    none = copy.deepcopy(good)
    none["agentic_rl"]["general"] = 0.8     # nothing forgotten: recovery cannot pass
    cl = glm.claims(_glm(none))
    assert [c["pass"] for c in cl[1:3]] == [False, False], cl


def _ds(levels: dict) -> dict:
    """levels: model -> cell -> reward."""
    models = ("sft", "teacher", "student", "sampled_student", "merge")
    return {"cells": {n: {"specialist": n} | {m: [_r(levels[m][n], k) for k in (0, 1)]
                                               for m in models}
                      for n in ("general/low", "agent/high")}}


def test_deepseek_claims():
    ds = recipe_module("deepseek_v4")
    good = {"sft": {"general/low": 0.2, "agent/high": 0.3},
            "teacher": {"general/low": 0.8, "agent/high": 0.9},
            "student": {"general/low": 0.8, "agent/high": 0.875},
            "sampled_student": {"general/low": 0.4, "agent/high": 0.5},
            "merge": {"general/low": 0.5, "agent/high": 0.5}}
    cl = ds.claims(_ds(good))
    assert [c["pass"] for c in cl] == [True, True, True, True], cl
    bad = copy.deepcopy(good)
    bad["student"]["agent/high"] = 0.5       # 56% of the teacher, level with the merge
    bad["teacher"]["general/low"] = 0.2      # a specialist no better than SFT
    cl = ds.claims(_ds(bad))
    assert [c["pass"] for c in cl] == [False, False, False, False], cl


def _kimi_cells(teacher_gain: float, student: float, merge: float, opd_steps):
    """Six cells (2 domains x 3 efforts) with the reward ordered by effort; per cell, the
    same numbers over two seeds."""
    cells = {}
    for d in ("general", "agent"):
        for i, e in enumerate(("low", "high", "max")):
            sft = 0.3 + 0.2 * i
            t = sft + teacher_gain
            cells[f"{d}/{e}"] = {
                "sft": [sft, sft], "teacher": [t, t], "student": [student * t] * 2,
                "merge": [merge * t] * 2, "retention": [student, student],
                "merge_retention": [merge, merge],
                "teacher_minus_sft": {"diff": teacher_gain, "se": 0.02},
                "student_minus_merge": {"diff": (student - merge) * t, "se": 0.02},
                "opd_steps": list(opd_steps), "rl_steps": [30, 30]}
    return cells


def test_kimi_claims_and_the_merge_reason():
    import os

    from opd_jax.config import load_config
    kimi = recipe_module("kimi_k3")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    c = load_config(os.path.join(root, "experiments", "kimi_k3", "config.py:reduced"))
    run = lambda cells: {x["claim"]: x for x in
                         kimi.claims({"cells": cells, "teacher_level": c.teacher_level})}
    good = run(_kimi_cells(0.2, 0.97, 0.80, (4, 6)))
    assert all(x["pass"] for x in good.values()), good
    # the slower seed needs 8 steps: 8 * 5 > 30, so speed fails on every cell
    slow = run(_kimi_cells(0.2, 0.97, 0.80, (4, 8)))
    speed = next(x for k, x in slow.items() if k.startswith("OPD reaches"))
    assert not speed["pass"] and speed["measured"].startswith("0 of 6 measurable")
    # teachers level with their start: speed is not measurable, the merge wins, and the
    # merge claim says why, with numbers computed from the cells
    flat = run(_kimi_cells(0.0, 0.95, 1.02, (None, None)))
    teacher = next(x for k, x in flat.items() if k.startswith("each teacher"))
    merge = next(x for k, x in flat.items() if "merge" in k)
    speed = next(x for k, x in flat.items() if k.startswith("OPD reaches"))
    assert not teacher["pass"] and not merge["pass"] and not speed["pass"]
    assert "6 of 6 not measurable" in speed["measured"]
    assert merge["measured"].startswith("0 of 6; measured reason: the teachers beat the SFT "
                                        "start on 0 of 6 cells (mean teacher - SFT +0.000)")
    assert "mean retention 95.0%" in merge["measured"]
    assert "(mean merge - SFT +0.010; 102.0% of the teachers' reward)" in merge["measured"]
