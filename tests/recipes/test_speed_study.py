"""The speed study's table and claim are functions of its results: synthetic runs in which the
claim holds for one objective and fails for the other; its plan; and (slow) the whole study at
the smallest size, resumed."""
import json
import os

import pytest

from studies import speed_study as ss

CELLS = ["general/max", "coding/max"]


def _run(lr, passes, flops_per_it, kind="opd", its=(2, 4, 6), rollouts=64):
    n = its[-1]
    return {"stage": "", "kind": kind, "lr": lr, "rollouts_per_iteration": rollouts,
            "optimizer_steps_per_iteration": 1.0, "summed_lr": lr * n,
            "path_length": 2.0, "distance": 1.0,
            "cost": {"flops": flops_per_it * n, "iterations": n, "optimizer_steps": n,
                     "wall_s": 1.0, "rollouts": rollouts * n},
            "curves": {cell: [list(its), list(p)] for cell, p in passes.items()}}


def _results(seeds=(0, 1)):
    both = lambda *p: {cell: list(p) for cell in CELLS}
    per_seed = []
    for seed in seeds:
        runs = {"grpo_5e-05": _run(5e-5, both(0.55, 0.6, 0.65), 100, "grpo", rollouts=64),
                "grpo_0.0001": _run(1e-4, both(0.6, 0.7, 0.8), 100, "grpo", rollouts=64),
                # 0.77 = start + 90% of the 0.3 gain: reached at iteration 4 (40 FLOPs <= 600/5)
                "kimi_mopd_0.0001": _run(1e-4, both(0.65, 0.8, 0.8), 10),
                "kimi_mopd_0.0002": _run(2e-4, both(0.6, 0.7, 0.8), 10),
                # never past 0.7
                "deepseek_full_vocab_0.0001": _run(1e-4, both(0.6, 0.65, 0.7), 10)}
        per_seed.append({"seed": seed, "teacher": "grpo_0.0001",
                         "validation": {"grpo_5e-05": 0.6, "grpo_0.0001": 0.7},
                         "start": {cell: 0.5 for cell in CELLS}, "runs": runs})
    return {"study": "speed_study", "seeds": list(seeds), "incomplete": [], "cells": CELLS,
            "shares": [0.5, 0.75, 0.9], "eval": {"n": 128, "every": 2, "difficulty": 3},
            "per_seed": per_seed}


def test_reach_counts_compute_rollouts_and_steps_to_each_share():
    res = _results()
    g = ss.gains(res)
    assert g["coding/max"]["gain"] == pytest.approx(0.3)
    r = ss.reach(res, "kimi_mopd_0.0001")["general/max"]
    assert r["0.5"]["iteration"] == 2 and r["0.9"]["iteration"] == 4
    assert r["0.9"] == {"iteration": 4, "flops": 40.0, "rollouts": 256, "optimizer_steps": 4.0}
    assert ss.reach(res, "deepseek_full_vocab_0.0001")["general/max"]["0.9"] is None
    assert ss.teacher_flops(res) == 600.0
    assert ss.best_run(res, "kimi_mopd") == "kimi_mopd_0.0001"      # fewer FLOPs to 90%
    assert set(ss.methods(res)) == {"grpo", "kimi_mopd", "deepseek_full_vocab"}


def test_claims_pass_within_a_fifth_of_the_teachers_compute_and_fail_otherwise(tmp_path):
    res = _results()
    cl = {c["claim"].split(" ")[0]: c for c in ss.claims(res)}
    assert set(cl) == {"kimi_mopd", "deepseek_full_vocab"}
    assert cl["kimi_mopd"]["pass"], cl
    assert "general/max at iteration 4: 4.00e+01 FLOPs (0.07 of the teacher's)" in \
        cl["kimi_mopd"]["measured"]
    assert not cl["deepseek_full_vocab"]["pass"]
    assert "never in 6 iterations" in cl["deepseek_full_vocab"]["measured"]
    # The same student with a cheaper teacher (its run 10x cheaper): 40 > 60 / 5, FAIL.
    for s in res["per_seed"]:
        s["runs"]["grpo_0.0001"]["cost"]["flops"] = 60.0
    assert not {c["claim"].split(" ")[0]: c for c in ss.claims(res)}["kimi_mopd"]["pass"]
    res = _results()
    res["claims"] = ss.claims(res)
    res["provenance"] = {"command": "test", "commit": "x", "stages_wall_s": 1.0,
                         "eval_wall_s": 1.0}
    ss.write_markdown(str(tmp_path / "results.md"), res)
    md = (tmp_path / "results.md").read_text()
    assert "| kimi_mopd_0.0001 | 0.0001 | 6.00e-04 |" in md
    assert "4.0e+01 (0.07x) / 256 / 4" in md and "- **FAIL** deepseek_full_vocab" in md
    ss.plot(str(tmp_path), res)
    assert (tmp_path / "pass_vs_flops.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_shares_the_start_and_the_problems():
    c = ss.load_config(ss.CONFIG)
    plan = ss.seed_plan(c, 1, "grpo_0.0001")
    assert [s.name for s in plan] == [
        "grpo_5e-05", "grpo_0.0001", "grpo_0.0002", "deepseek_full_vocab_5e-05",
        "deepseek_full_vocab_0.0001", "deepseek_full_vocab_0.0002", "kimi_mopd_5e-05",
        "kimi_mopd_0.0001", "kimi_mopd_0.0002"]
    for s in plan:
        cfg = s.config
        assert s.init_from is None and cfg.model.init_from == "builtin:base"
        assert cfg.optim.warmup_steps == 0 and cfg.optim.schedule == "constant"
        assert cfg.rl.minibatches == 1 and cfg.eval.every == 2 and cfg.eval.n >= 128
        assert dict(cfg.tasks.families) == ss.DOMAINS and tuple(cfg.tasks.efforts) == ("max",)
        assert cfg.tasks.seed == 1 and cfg.tasks.difficulty == c.eval.difficulty == 3
    opd = [s for s in plan if s.kind == "opd"]
    assert all(dict(s.teachers) == {cell: "grpo_0.0001" for cell in CELLS} for s in opd)
    assert {s.config.objective.name for s in opd} == set(ss.OPD_LRS)
    with pytest.raises(ValueError, match="objective 'topk': expected one of"):
        ss.opd_stage(c, 0, "topk", 1e-4, "grpo_0.0001")


@pytest.mark.slow
def test_the_study_runs_resumes_and_reports(tmp_path, monkeypatch):
    """At the smallest size (the smoke preset's sizes on the shipped base, one lr per
    method, 2 iterations): every run finishes, the report is written, a second invocation
    trains nothing and reports the same numbers."""
    for name, value in dict(GRPO_LRS=(1e-4,), OPD_LRS={"deepseek_full_vocab": (1e-4,),
                                                       "kimi_mopd": (1e-4,)},
                            GRPO_ITERS=2, OPD_ITERS=2, EVAL_EVERY=1, EVAL_N=2,
                            VAL_N=2).items():
        monkeypatch.setattr(ss, name, value)
    smoke = ss.CONFIG.replace(":reduced", ":smoke")
    wd = str(tmp_path / "w")
    ss.main(["--workdir", wd, "--config", smoke, "--seeds", "0"])
    res = json.load(open(os.path.join(wd, "speed_study", "results.json")))
    assert res["seeds"] == [0] and len(res["per_seed"][0]["runs"]) == 3
    teacher = res["per_seed"][0]["runs"]["grpo_0.0001"]
    assert teacher["distance"] >= 0 and teacher["cost"]["flops"] > 0
    assert [len(v[0]) for v in teacher["curves"].values()] == [2, 2]
    before = os.path.getmtime(os.path.join(wd, "seed0", "kimi_mopd_0.0001", "done.json"))
    ss.main(["--workdir", wd, "--config", smoke, "--seeds", "0"])
    again = json.load(open(os.path.join(wd, "speed_study", "results.json")))
    assert os.path.getmtime(os.path.join(wd, "seed0", "kimi_mopd_0.0001", "done.json")) == before
    assert again["claims"] == res["claims"] and again["per_seed"] == res["per_seed"]


def test_committed_results_are_regenerated_from_their_json(tmp_path):
    """experiments/speed_study/results: the table and the claims are the report code's
    function of the committed results.json alone."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "experiments", "speed_study", "results")
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
        res = json.load(f)
    assert ss.claims(res) == res["claims"]
    ss.write_markdown(str(tmp_path / "results.md"), res)
    with open(os.path.join(folder, "results.md"), encoding="utf-8") as f:
        assert (tmp_path / "results.md").read_text() == f.read()
    assert res["provenance"]["commit"] != "unknown" and res["seeds"]
