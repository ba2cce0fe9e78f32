"""The glm and deepseek_v4 claims are functions of a results.json dict: synthetic per-problem
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
