"""The glm, kimi_k3 and deepseek_v4 (kimi_k3's report) claims are functions of their results: synthetic per-problem
rewards in which each claim holds, then the change that makes it fail."""
import copy
import os

import numpy as np
import pytest

from opd_jax.config import load_config
from opd_jax.recipes import recipe_module
from opd_jax.recipes import report as rp

N = 40           # problems per cell and seed


def _r(p, k=0):
    """Per-problem rewards with mean p (a deterministic 0/1 pattern, shifted by k)."""
    ones = round(p * N)
    rewards = [1.0 if (i + k) % N < ones else 0.0 for i in range(N)]
    return {"reward": sum(rewards) / N, "rewards": rewards}


def _glm(levels: dict) -> dict:
    """levels: stage -> domain -> pass rate (both seeds, both modes alike; 128 problems)."""
    stages = ["start", "reasoning_rl", "general_rl", "student", "merge"]
    row = lambda p: {"pass_rate": p, "passes": _passes(p), "reward": p, "rewards": _passes(p)}
    cells = {f"{d}/{m}": {s: [row(levels[s][d]) for _ in (0, 1)] for s in stages}
             for d in ("general", "coding") for m in ("think_on", "think_off")}
    return {"recipe": "glm", "seeds": [0, 1], "stages": stages,
            "stage_domains": {"reasoning_rl": ["general"], "general_rl": ["coding"]},
            "stage_teachers": {"general": "reasoning_rl", "coding": "general_rl"},
            "modes": {"general": ["think_on", "think_off"], "coding": ["think_on", "think_off"]},
            "cells": cells}


def test_glm_claims_read_pass_rate_gains_losses_and_recovery():
    glm = recipe_module("glm")
    good = {"start": {"general": 0.3, "coding": 0.3},
            "reasoning_rl": {"general": 0.6, "coding": 0.25},     # +0.30 on its domain
            "general_rl": {"general": 0.4, "coding": 0.6},        # +0.35; general loses 0.20
            "student": {"general": 0.59, "coding": 0.6},          # 96% recovered, 100% kept
            "merge": {"general": 0.45, "coding": 0.45}}
    cl = glm.claims(_glm(good))
    assert [c["pass"] for c in cl] == [True, True, True, True], cl
    assert "general: 96%" in cl[2]["measured"] and "coding: 100.0%" in cl[3]["measured"]
    small = copy.deepcopy(good)
    small["reasoning_rl"]["general"] = 0.42          # +0.12 < 0.15: the stage learns too little
    small["general_rl"]["general"] = 0.35            # (and so the loss is 0.07 < 0.10)
    small["student"]["general"] = 0.42
    cl = glm.claims(_glm(small))
    assert [c["pass"] for c in cl] == [False, False, True, True], cl
    half = copy.deepcopy(good)
    half["student"]["general"] = 0.5                 # recovers half of the 0.20 lost
    half["student"]["coding"] = 0.58                 # keeps 93% of the 0.30 gain
    cl = glm.claims(_glm(half))
    assert [c["pass"] for c in cl] == [True, True, False, False], cl
    assert "general: 50%" in cl[2]["measured"]
    none = copy.deepcopy(good)
    none["general_rl"]["general"] = 0.6              # nothing forgotten: nothing to recover
    cl = glm.claims(_glm(none))
    assert [c["pass"] for c in cl[1:3]] == [False, False], cl
    assert "nothing to recover" in cl[2]["measured"]


N_KIMI = 128
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _passes(rate: float, n: int = N_KIMI) -> list[float]:
    """n per-problem passes with the given rate (problem i passes when i < rate * n: the
    same problems pass for every model with a higher rate, so paired se stays small)."""
    return [1.0 if i < round(rate * n) else 0.0 for i in range(n)]


def _row(rate: float) -> dict:
    p = _passes(rate)
    return {"pass_rate": float(np.mean(p)), "reward": float(np.mean(p)), "length": 40.0,
            "passes": p, "rewards": p, "n": len(p)}


def _kimi_results(start=(0.05, 0.2, 0.4), gain=0.3, kept=0.95, merge_kept=0.3,
                  other_loss=0.2, seeds=(0, 1), mixed_kept=None, sampled_kept=None,
                  reached_at="absent"):
    """A kimi_k3 results dict (two domains x low/high/max) through the report's own
    `table`: start pass rates per effort (or a dict of them per domain), the teachers' gain, the share of it the student
    and the merge keep, and each specialist's loss on the other domain (at max).
    sampled_kept: a sampled-token student keeping that share; reached_at: the student's
    in-run curves (iterations 10, 20, 30 of 30) first reach 95% of every gain at that
    iteration (None: never; "absent": results without curves, as before 2026-12-07), each
    teacher's path costing 5.5 FLOPs, the student 3 in 30 iterations."""
    kimi = recipe_module("kimi_k3")
    domains, efforts = {"general": "chain", "coding": "code_trace"}, ["low", "high", "max"]
    cells = [f"{d}/{e}" for d in domains for e in efforts]
    per_domain = start if isinstance(start, dict) else {d: start for d in domains}
    base = {f"{d}/{e}": per_domain[d][i] for d in domains for i, e in enumerate(efforts)}
    per_seed = []
    for seed in seeds:
        shares = [("start", 0.0), ("student", kept), ("merge", merge_kept)]
        if mixed_kept is not None:
            shares.append(("mixed", mixed_kept))
        if sampled_kept is not None:
            shares.append(("sampled_student", sampled_kept))
        models = {m: {c: _row(base[c] + share * gain) for c in cells} for m, share in shares}
        cost = lambda kind, flops, it=1: {"kind": kind, "flops": flops, "wall_s": 1.0,
                                          "optimizer_steps": it, "iterations": it,
                                          "rollouts": 0, "flops_parts": {}}
        stages = {"sft_general": cost("sft", 4.5), "rl_general_max": cost("grpo", 1.0),
                  "student": cost("opd", 3.0, 30), "merge_1": cost("merge", 0.0)}
        if mixed_kept is not None:
            stages |= {"mixed_sft": cost("sft", 4.0), "mixed": cost("grpo", 2.0)}
        if sampled_kept is not None:
            stages["sampled_student"] = cost("opd", 3.0, 30)
        extra = {}
        if reached_at != "absent":
            its = [10, 20, 30]
            extra = {"paths": {c: ["rl_general_max", "sft_general"] for c in cells},
                     "curves": {"student": {c: [its, [base[c] + gain * (
                         0.95 if reached_at is not None and i >= reached_at else 0.5)
                         for i in its]] for c in cells}}}
        per_seed.append(extra | {
            "seed": seed, "models": models, "plain": {},
            "teacher": {c: _row(base[c] + gain) for c in cells},
            "specialist": {d: {f"{o}/max": _row(base[f"{o}/max"] - other_loss)
                               for o in domains if o != d} for d in domains},
            "merge_chosen": "merge_0.5", "stages": stages})
    res = {"recipe": "kimi_k3", "seeds": list(seeds), "top": "max", "domains": domains,
           "efforts": efforts, "per_seed": per_seed,
           "table": kimi.table(per_seed, cells, domains, efforts, "max")}
    return kimi, res


def test_kimi_claims_read_pass_rate_gains_and_the_precondition():
    kimi, res = _kimi_results()
    good = kimi.claims(res)
    assert [c["pass"] for c in good] == [True] * 7, good
    assert all(c.get("judged", True) for c in good)
    assert res["table"]["retention"]["general/max"] == pytest.approx(0.95, abs=0.02)
    # A student that keeps 70% of the gains fails retention (mean < 0.9), nothing else.
    _, weak = _kimi_results(kept=0.7)
    cl = kimi.claims(weak)
    assert [c["pass"] for c in cl] == [True, True, True, True, True, False, True], cl
    # Effort that does not bind at the start binds nowhere: teachers and student fail.
    _, flat = _kimi_results(start=(0.3, 0.35, 0.4))
    cl = kimi.claims(flat)
    assert [c["pass"] for c in cl][3:5] == [False, False]
    # Specialists that help the other domain: no competition.
    _, kind = _kimi_results(other_loss=-0.1)
    assert not kimi.claims(kind)[2]["pass"]
    # Teachers level with the start: PRECONDITION FAIL, every other claim not judged, and
    # the report prints that instead of a row of FAILs.
    _, none = _kimi_results(gain=0.0)
    cl = kimi.claims(none)
    assert not cl[0]["pass"] and "no gain" in cl[0]["measured"]
    assert all(c.get("judged") is False for c in cl[1:])
    lines = rp.claim_lines(cl)
    assert lines[0].startswith("- **FAIL** PRECONDITION")
    assert all(x.startswith("- **NOT JUDGED (precondition failed)**") for x in lines[1:])
    # A start with no headroom fails the precondition too.
    _, full = _kimi_results(start=(0.7, 0.8, 0.9), gain=0.05)
    assert "no headroom" in kimi.claims(full)[0]["measured"]


def test_kimi_claims_leave_out_the_cells_without_headroom():
    """A start that saturates coding above low effort (0.88 / 0.9 at high / max, as tool_chain
    does in kimi_k3 full): the precondition FAILs and names those two cells; every per-cell
    claim is judged on the other four and says so, the competition claim on every cell."""
    kimi, res = _kimi_results(start={"general": (0.05, 0.2, 0.4), "coding": (0.3, 0.88, 0.9)},
                              mixed_kept=0.6, reached_at=10)
    cl = kimi.claims(res)
    assert not cl[0]["pass"] and cl[0]["left_out"] == ["coding/high", "coding/max"]
    # On all six cells the coding effort gaps (teacher max - high 0.0) and the gains on the
    # saturated cells (+0.12 / +0.10 < 0.15) would fail; on the four judged cells all pass.
    assert [c["pass"] for c in cl] == [False] + [True] * 8, cl
    assert all(c.get("judged", True) for c in cl)
    scope = "4 of 6 cells; coding/high, coding/max left out by the precondition"
    assert [c.get("scope") for c in cl] == [None, scope, None, *[scope] * 6]
    lines = rp.claim_lines(cl)
    assert lines[1].startswith(f"- **PASS on {scope}** every teacher beats the start")
    assert lines[2].startswith("- **PASS** each specialist loses")
    assert "coding/max" in cl[1]["measured"]          # the numbers still name every cell
    # A judged cell that fails still fails the claim: a weak student on every cell.
    _, weak = _kimi_results(start={"general": (0.05, 0.2, 0.4), "coding": (0.3, 0.88, 0.9)},
                            kept=0.5)
    ret = kimi.claims(weak)[5]
    assert "keeps the teachers' gains" in ret["claim"] and not ret["pass"]
    assert rp.verdict(ret) == f"FAIL on {scope}"


def test_kimi_mixed_data_baseline_claim_and_its_compute(tmp_path):
    """With a mixed-data baseline in the results, one more claim: the student beats it on
    every cell beyond 2 se, its FLOPs (mixed_sft + mixed) printed against the specialists'
    and the student's (summed over seeds; merges and the shared start not counted)."""
    kimi, res = _kimi_results(mixed_kept=0.6)
    cl = kimi.claims(res)
    assert len(cl) == 8 and "mixed-data baseline" in cl[-1]["claim"] and cl[-1]["pass"]
    assert "mixed 1.20e+01, specialists and student 1.70e+01 (ratio 0.71)" in cl[-1]["measured"]
    _, strong = _kimi_results(mixed_kept=1.2)
    assert not kimi.claims(strong)[-1]["pass"]
    assert len(kimi.claims(_kimi_results()[1])) == 7      # no baseline, no claim
    path = tmp_path / "results.md"
    kimi.write_markdown(str(path), res | {"claims": cl, "eval": {"n": N_KIMI, "difficulty": 3},
                                          "provenance": {"command": "test", "commit": "x",
                                                         "stages_wall_s": 1.0,
                                                         "eval_wall_s": 1.0}})
    md = path.read_text()
    assert "| mixed | student - mixed (se) |" in md


def test_kimi_mixed_data_baseline_stages():
    """kimi_k3 full trains the baseline: SFT of the start on every domain's demos with the
    specialists' summed steps, then GRPO on every cell from it; reduced has none."""
    kimi = recipe_module("kimi_k3")
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:full"))
    by = {s.name: s for s in kimi.build(c, 0)}
    sft, rl = by["mixed_sft"], by["mixed"]
    assert sft.kind == "sft" and sft.init_from is None and rl.init_from == "mixed_sft"
    assert sft.config.train.steps == c.specialist_sft.train.steps * len(c.domains)
    assert dict(sft.config.data.tasks.families) == dict(c.domains)
    assert rl.kind == "grpo" and rl.config.train.steps == c.mixed_rl_steps
    assert dict(rl.config.tasks.families) == dict(c.domains)
    assert tuple(rl.config.tasks.efforts) == tuple(c.efforts)
    reduced = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:reduced"))
    assert not any(s.name.startswith("mixed") for s in kimi.build(reduced, 0))


def test_beats_is_margin_and_standard_errors():
    assert rp.beats({"diff": 0.2, "se": 0.05}, 0.15, 3.0)
    assert not rp.beats({"diff": 0.2, "se": 0.07}, 0.15, 3.0)     # 0.2 < 3 se
    assert not rp.beats({"diff": 0.14, "se": 0.01}, 0.15, 3.0)    # under the margin




def test_sampled_student_claim_reads_both_students_and_their_flops(tmp_path):
    """deepseek_v4's report is kimi_k3's; with a sampled-token student beside the student,
    one more claim: the student beats it on every cell beyond 2 se at no more compute."""
    ds = recipe_module("deepseek_v4")
    assert ds.claims is recipe_module("kimi_k3").claims
    _, res = _kimi_results(sampled_kept=0.6)
    cl = ds.claims(res)
    assert len(cl) == 8 and "sampled-token student" in cl[-1]["claim"] and cl[-1]["pass"]
    assert "student 3.00e+00, sampled-token 3.00e+00 (ratio 1.00)" in cl[-1]["measured"]
    assert res["table"]["sampled_retention"]["coding/low"] == pytest.approx(0.6, abs=0.02)
    _, level = _kimi_results(sampled_kept=0.95)            # no better than the sampled one
    assert not ds.claims(level)[-1]["pass"]
    _, costly = _kimi_results(sampled_kept=0.6)            # better, with 2x its compute
    for s in costly["per_seed"]:
        s["stages"]["student"]["flops"] = 6.0
    assert not ds.claims(costly)[-1]["pass"]
    path = tmp_path / "results.md"
    ds.write_markdown(str(path), res | {"recipe": "deepseek_v4", "claims": cl,
                                        "eval": {"n": N_KIMI, "difficulty": 3},
                                        "provenance": {"command": "test", "commit": "x",
                                                       "stages_wall_s": 1.0,
                                                       "eval_wall_s": 1.0}})
    md = path.read_text()
    assert md.startswith("# deepseek_v4 results")
    assert "| sampled-token | its gain kept | student - sampled (se) |" in md


def test_compute_claim_charges_the_teacher_path_and_the_student_until_90_percent(tmp_path):
    """The student first holding 90% of every gain at iteration 10 of 30 has spent 1.0 of
    its 3.0 FLOPs, against a teacher path (specialist SFT 4.5 + GRPO 1.0) of 5.5: 0.18 <=
    1/5, PASS; at iteration 20 (0.36) or never, FAIL, with the numbers."""
    kimi, res = _kimi_results(reached_at=10)
    cl = kimi.claims(res)
    assert len(cl) == 8 and "1/5 of the FLOPs" in cl[-1]["claim"] and cl[-1]["pass"], cl[-1]
    assert "coding/low at iteration 10: 1.00e+00 / 5.50e+00 = 0.18" in cl[-1]["measured"]
    rows = kimi.speed_rows(res)
    assert rows["general/max"]["ratio"] == pytest.approx(1.0 / 5.5)
    _, slow = _kimi_results(reached_at=20)
    assert not kimi.claims(slow)[-1]["pass"]
    _, never = _kimi_results(reached_at=None)
    cl = kimi.claims(never)
    assert not cl[-1]["pass"] and "coding/low never in 30 iterations" in cl[-1]["measured"]
    path = tmp_path / "results.md"
    kimi.write_markdown(str(path), res | {"claims": cl, "eval": {"n": N_KIMI, "difficulty": 3},
                                          "provenance": {"command": "test", "commit": "x",
                                                         "stages_wall_s": 1.0,
                                                         "eval_wall_s": 1.0}})
    assert "## Compute to 90% of each teacher's gain" in path.read_text()
