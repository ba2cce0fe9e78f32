"""Experiment plumbing: stage plans are checked before work, references resolve to workdirs,
finished stages are skipped, tables and plots are written."""
import json
import os
import time
import warnings

import ml_collections
import numpy as np
import pytest

from opd_jax.config import load_config
from opd_jax.recipes import EVAL_DIFFICULTY, TESTBED, recipe_module, report as rp
from opd_jax.recipes.pipeline import (Stage, check_stages, resolved_config, run_stage,
                                      run_stages,
                                      stage_identity)
from opd_jax.trainers import builders

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(**kw):
    return ml_collections.ConfigDict(kw)


def test_check_stages_errors():
    sft = Stage("sft", "sft", _cfg())
    with pytest.raises(ValueError, match="stage name 'sft' appears twice"):
        check_stages([sft, Stage("sft", "sft", _cfg())])
    with pytest.raises(ValueError, match="stage 'rl' refers to 'teacher', which is not an "
                                         "earlier stage \\(earlier: \\['sft'\\]\\)"):
        check_stages([sft, Stage("rl", "grpo", _cfg(), init_from="teacher")])
    with pytest.raises(ValueError, match="kind='bogus', expected one of"):
        Stage("x", "bogus", _cfg())
    with pytest.raises(ValueError, match="an OPD stage needs teachers"):
        Stage("x", "opd", _cfg())


def test_resolved_config_points_at_stage_workdirs(tmp_path):
    cfg = _cfg(model=_cfg(init_from=""), teachers=_cfg(paths={}))
    st = Stage("student", "opd", cfg, init_from="sft", teachers={"general/high": "rl"})
    out = resolved_config(st, str(tmp_path))
    assert out.model.init_from == str(tmp_path / "sft")
    assert dict(out.teachers.paths) == {"general/high": str(tmp_path / "rl")}
    assert cfg.model.init_from == ""          # the plan itself is not modified


def test_finished_stages_are_skipped(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "done.json").write_text(json.dumps({"stage": "m", "wall_s": 1.0}))
    # A merge of nothing would fail if it ran: it must be skipped.
    records = run_stages([Stage("m", "merge", _cfg(method="average"))], str(tmp_path))
    assert records == {"m": {"stage": "m", "wall_s": 1.0}}
    assert "[1/1] merge m: done" in capsys.readouterr().out


def test_a_changed_finished_stage_is_refused(tmp_path):
    done = Stage("m", "merge", _cfg(method="average", scale=1.0))
    (tmp_path / "m").mkdir()
    record = {"stage": "m", "wall_s": 1.0, "identity": stage_identity(done)}
    (tmp_path / "m" / "done.json").write_text(json.dumps(record))
    same = Stage("m", "merge", _cfg(method="average", scale=1.0))
    assert run_stages([same], str(tmp_path), progress=False) == {"m": record}
    changed = Stage("m", "merge", _cfg(method="task_arithmetic", scale=1.0))
    with pytest.raises(ValueError, match="stage 'm' in .* finished with other settings \\(1 "
                                         "differ: config.method: 'average' -> "
                                         "'task_arithmetic'\\); expected the same stage"):
        run_stages([changed], str(tmp_path), progress=False)
    # Refused before any earlier stage runs (a merge of nothing would fail if it ran).
    with pytest.raises(ValueError, match="finished with other settings"):
        run_stages([Stage("first", "merge", _cfg(method="average")), changed], str(tmp_path),
                   progress=False)
    assert not (tmp_path / "first").exists()


@pytest.mark.parametrize("recipe,n_stages", [("kimi_k3", 9), ("glm", 7), ("deepseek_v4", 10)])
def test_smoke_plans(recipe, n_stages):
    c = load_config(os.path.join(ROOT, f"experiments/{recipe}/config.py:smoke"))
    stages = recipe_module(recipe).build(c, seed=3)
    check_stages(stages)
    assert len(stages) == n_stages
    assert all(s.config.seed == 3 for s in stages if s.kind != "merge")
    student = next(s for s in stages if s.name == "student")
    assert student.init_from and student.teachers


@pytest.mark.parametrize("recipe", ["kimi_k3", "glm", "deepseek_v4"])
@pytest.mark.parametrize("preset", ["reduced", "full", "smoke"])
def test_presets_start_from_the_base_on_the_testbed(recipe, preset):
    c = load_config(os.path.join(ROOT, f"experiments/{recipe}/config.py:{preset}"))
    # smoke (plumbing, default suite) is the one preset on a random 1-layer model.
    assert c.sft.model.init_from == ("" if preset == "smoke" else "builtin:base")
    assert c.start == "builtin:base"
    assert all(TESTBED[d] == f for d, f in c.domains.items())
    stages = recipe_module(recipe).build(c, seed=0)
    cold_start = c.sft.train.steps > 0
    for s in stages:
        if s.kind == "merge":
            continue
        tasks = s.config.data.tasks if s.kind == "sft" else s.config.tasks
        assert set(dict(tasks.families).items()) <= set(TESTBED.items()), s.name
        assert tasks.difficulty == c.eval.difficulty, s.name
        # Only the cold start loads a checkpoint by path, or with none (kimi_k3's research
        # presets), the stages that start from the base; the others start from a stage.
        if cold_start:
            assert (s.init_from is None) == (s.name in ("sft",)), s.name
        elif s.init_from is None:
            assert s.config.model.init_from == c.start, s.name
    # Every preset trains and evaluates at the testbed's evaluation difficulty: the claims
    # read pass rate, where the dosed base has headroom there.
    assert {EVAL_DIFFICULTY[d] for d in c.domains} == {c.eval.difficulty}


def test_reduced_and_full_plans():
    k = recipe_module("kimi_k3")
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:full"))
    stages = k.build(c, 0)
    names = [s.name for s in stages]
    by = {s.name: s for s in stages}
    assert "sft" not in by                           # no cold start: the base is the start
    # Per domain: its specialist SFT (every effort of its domain) from the start, then the
    # annealed ladder max -> high -> low, and plain teachers each from the specialist SFT.
    assert by["sft_coding"].init_from is None and by["sft_coding"].kind == "sft"
    assert dict(by["sft_coding"].config.data.tasks.families) == {"coding": "code_trace"}
    assert by["sft_coding"].config.data.tasks.efforts == ("max", "high", "low")
    assert by["rl_coding_max"].init_from == "sft_coding"
    assert by["rl_coding_high"].init_from == "rl_coding_max"
    assert by["rl_coding_low"].init_from == "rl_coding_high"
    assert by["plain_coding_low"].init_from == "sft_coding"
    # A teacher's path from the start, which the compute claim charges it: its rung, every
    # rung above it and its specialist SFT, each once; a plain teacher only its own.
    assert k.lineage(stages, "rl_coding_low", None) == ["rl_coding_low", "rl_coding_high",
                                                       "rl_coding_max", "sft_coding"]
    assert k.lineage(stages, "plain_coding_low", None) == ["plain_coding_low", "sft_coding"]
    assert len([n for n in names if n.startswith(("rl_", "plain_"))]) == 18
    assert by["student"].teachers["agent/low"] == "rl_agent_low"
    # The student starts from the merge of scale c.student_from_merge, planned before it.
    assert by["student"].init_from == "merge_1" and c.student_from_merge == 1.0
    assert names.index("merge_1") < names.index("student")
    assert by["rl_agent_low"].config.tasks.efforts == ("low",)
    # One merge per scale, on the base (no stage), of the cell teachers the student saw.
    merges = [s for s in stages if s.kind == "merge"]
    assert [m.config.scale for m in merges] == [float(x) for x in c.merge_scales]
    assert all(m.config.base == c.start and m.init_from is None
               and dict(m.teachers) == dict(by["student"].teachers) for m in merges)
    c.student_from_merge = None
    assert {s.name: s for s in k.build(c, 0)}["student"].init_from is None
    c.student_from_merge = 2.0
    with pytest.raises(ValueError, match="student_from_merge=2.0: expected one of merge_scales"):
        k.build(c, 0)
    # deepseek_v4 is kimi_k3's plan with a full-vocabulary student and the sampled-token one
    # beside it: the same specialist stages (so a kimi_k3 run's can be reused), both students
    # from the same merge, every teacher routed per cell through a cache smaller than the bank.
    d = load_config(os.path.join(ROOT, "experiments/deepseek_v4/config.py:reduced"))
    st = {s.name: s for s in recipe_module("deepseek_v4").build(d, 0)}
    kimi = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:reduced"))
    # deepseek_v4 reduced also runs the mixed-data baseline (kimi_k3's, at 120 iterations)
    assert d.mixed_rl_steps == 120 and kimi.mixed_rl_steps == 0
    kimi.mixed_rl_steps = d.mixed_rl_steps
    same = {s.name: s for s in k.build(kimi, 0)}
    assert list(st) == [*(n for n in same if not n.startswith("mixed")), "sampled_student",
                        "mixed_sft", "mixed"]
    kimi.mixed_rl_steps = 0
    assert all(stage_identity(st[n]) == stage_identity(same[n]) for n in same if n != "student")
    assert st["student"].config.objective.name == "deepseek_full_vocab"
    assert st["sampled_student"].config.objective == same["student"].config.objective
    for name in ("student", "sampled_student"):
        assert st[name].init_from == same["student"].init_from
        assert 0 < st[name].config.teachers.max_loaded < len(st[name].teachers) == 6
        assert st[name].config.rollout == same["student"].config.rollout
        assert st[name].config.train == same["student"].config.train
    g = load_config(os.path.join(ROOT, "experiments/glm/config.py:full"))
    gs = {s.name: s for s in recipe_module("glm").build(g, 0)}
    # Each stage: SFT on its domains, then RL, continuing the line from the base itself.
    assert [gs[n].init_from for n in ("sft_reasoning_rl", "reasoning_rl", "sft_agentic_rl",
                                      "agentic_rl", "sft_general_rl", "general_rl")] == [
        None, "sft_reasoning_rl", "reasoning_rl", "sft_agentic_rl", "agentic_rl",
        "sft_general_rl"]
    assert gs["sft_reasoning_rl"].config.model.init_from == g.start == "builtin:base"
    assert dict(gs["sft_agentic_rl"].config.data.tasks.families) == {"agent": "tool_chain"}
    assert gs["student"].init_from == "general_rl"
    assert gs["student"].teachers == {"general": "reasoning_rl", "agent": "agentic_rl",
                                      "coding": "general_rl"}
    # reduced: the two domains that compete, general then coding, kimi_k3's stage settings
    r = load_config(os.path.join(ROOT, "experiments/glm/config.py:reduced"))
    rs = {s.name: s for s in recipe_module("glm").build(r, 0)}
    assert list(rs) == ["sft_reasoning_rl", "reasoning_rl", "sft_general_rl", "general_rl",
                        "student", "merge"]
    assert rs["student"].teachers == {"general": "reasoning_rl", "coding": "general_rl"}
    same = lambda a, b: a.to_dict() == b.to_dict()
    assert same(rs["student"].config.train, kimi.student.train)
    assert same(rs["general_rl"].config.optim, kimi.teacher.optim)
    assert same(rs["sft_general_rl"].config.optim, kimi.specialist_sft.optim)


def test_glm_bad_stage_teacher():
    g = load_config(os.path.join(ROOT, "experiments/glm/config.py:smoke"),
                    ["--config.stage_teachers={'general': 'nope', 'coding': 'general_rl'}"])
    with pytest.raises(ValueError, match="stage_teachers \\{'general': 'nope'\\}"):
        recipe_module("glm").build(g, 0)


def test_report_helpers(tmp_path):
    d = rp.paired([1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0])
    assert d["diff"] == 0.5 and d["n"] == 4
    assert abs(d["se"] - np.std([1, 0, 0, 1], ddof=1) / 2) < 1e-12
    with pytest.raises(ValueError, match="equal lengths, got 2 and 3"):
        rp.paired([1.0, 0.0], [0.0, 0.0, 1.0])
    assert rp.fmt([0.5]) == "0.500"
    assert rp.fmt([0.5, 0.7]) == "0.600 ± 0.141"
    assert rp.fmt([0.9, 1.0], pct=True) == "95.0% ± 7.1"
    assert rp.ratio(1.0, 0.0) != rp.ratio(1.0, 0.0)       # NaN: undefined retention
    assert rp.finite_mean([0.5, float("nan"), 1.0]) == 0.75
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # no empty-slice RuntimeWarning
        assert np.isnan(rp.finite_mean([float("nan")]))
    md = rp.markdown_table(["a", "b"], [["x", "1"]])
    assert md.splitlines() == ["| a | b |", "|---|---:|", "| x | 1 |"]
    p = rp.plot_bars(str(tmp_path / "b.png"), ["c1", "c2"], {"s": [0.5, 1.0]}, title="t",
                     ylabel="y", hline=1.0)
    q = rp.plot_curves(str(tmp_path / "c.png"), {"c1": [{"x": [1, 2], "y": [0.1, 0.2],
                                                         "label": "s"},
                                                        {"y": 0.5, "label": "t"}]}, title="t")
    for f in (p, q):
        assert open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("preset", ["full", "smoke"])
def test_glm_per_turn_cells_and_general_judge(preset):
    g = load_config(os.path.join(ROOT, f"experiments/glm/config.py:{preset}"))
    stages = recipe_module("glm").build(g, 0)
    for s in stages:
        if s.kind == "merge":
            continue
        tasks = s.config.data.tasks if s.kind == "sft" else s.config.tasks
        cells = [f"{d}/{e}" for d, _, e in builders.task_cells(tasks)]
        # per-turn thinking on the multi-turn agent domain only, with both per-prompt modes
        want = [f"{d}/{m}" for d in dict(tasks.families)
                for m in ("think_on", "think_off") + (("think_mixed",) if d == "agent" else ())]
        assert sorted(cells) == sorted(want), s.name
        judge = s.config.rewards.judge.path if "rewards" in s.config else ""
        assert bool(judge) == (s.name == "general_rl"), s.name
    with pytest.raises(ValueError, match=r"per_turn \['coding'\]: expected domains .* "
                                         r"multi-turn"):
        g2 = load_config(os.path.join(ROOT, f"experiments/glm/config.py:{preset}"),
                         ["--config.per_turn=('coding',)"])
        recipe_module("glm").build(g2, 0)
    with pytest.raises(ValueError, match=r"judge_stages \['nope'\]: expected RL stages"):
        g3 = load_config(os.path.join(ROOT, f"experiments/glm/config.py:{preset}"),
                         ["--config.judge_stages=('nope',)"])
        recipe_module("glm").build(g3, 0)


def test_sft_demos_follow_the_cells():
    g = load_config(os.path.join(ROOT, "experiments/glm/config.py:smoke"))
    sft = recipe_module("glm").build(g, 0)[0]
    tasks = ml_collections.ConfigDict(sft.config.data.tasks.to_dict())
    tasks.size = 2
    examples = builders.task_demo_examples(tasks)
    assert len(examples) == 2 * len(tasks.cells) == 14
    # per-turn demos: observations carry the next turn's mode token and are not trained
    mixed = [e for e in examples if "Tools:" in e["prompt"]][2::3]
    assert len(mixed) == 2
    for e in mixed:
        obs = [p for p in e["response"] if p["text"].startswith("<|tool|>")]
        assert obs and all(not p["train"] and ("<|think_on|>" in p["text"]) !=
                           ("<|think_off|>" in p["text"]) for p in obs)
    tasks.cells = ("coding/think_mixed",)
    with pytest.raises(ValueError, match="family 'code_trace' is single-turn"):
        builders.task_demo_examples(tasks)
    tasks.cells = ("coding/low",)
    with pytest.raises(ValueError, match=r"tasks.cells \['coding/low'\] are not in"):
        builders.task_demo_examples(tasks)


def test_a_key_added_since_with_its_default_is_the_same_stage(tmp_path):
    """A stage finished by an older version whose config lacks keys added since: the same
    stage when those keys hold their schema defaults; not when one holds another value."""
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:smoke"))
    student = next(s for s in recipe_module("kimi_k3").build(c, 0) if s.name == "student")
    old = stage_identity(student)
    del old["config"]["teachers"]["served"], old["config"]["teachers"]["weighting"]
    (tmp_path / "student").mkdir()
    record = {"stage": "student", "wall_s": 1.0, "identity": old}
    (tmp_path / "student" / "done.json").write_text(json.dumps(record))
    assert run_stage(student, str(tmp_path), progress=False) == record
    cfg = student.config.to_dict()
    cfg["teachers"]["weighting"] = "confidence"
    import dataclasses
    import ml_collections
    changed = dataclasses.replace(student, config=ml_collections.ConfigDict(cfg))
    with pytest.raises(ValueError, match="1 differ: config.teachers.weighting: '<absent>' -> "
                                         "'confidence'"):
        run_stage(changed, str(tmp_path), progress=False)


def test_a_cached_evaluation_is_reused_only_for_the_same_problems_and_sampling(tmp_path, monkeypatch):
    # The cache must not hand back rows of another n (or sampling): a report re-run with a
    # larger eval.n once read the smaller run's rows.
    import ml_collections
    calls = []

    def fake_eval(model, tokenizer, tasks, sampling, *, seed, batch_size):
        calls.append(len(tasks))
        return [{"cell": "general/max", "passes": [1.0] * len(tasks)}]
    monkeypatch.setattr(rp, "evaluate_tasks", fake_eval)
    monkeypatch.setattr(rp, "ModelRef", lambda path: type("M", (), {"load": lambda self: None})())
    ev = ml_collections.ConfigDict(dict(seed=0, n=3, batch_size=4,
                                        sampling=dict(temperature=0.0, max_new_tokens=8)))
    cells = [("general", "chain", "max")]
    ask = lambda ev, **kw: rp.evaluate_stage(str(tmp_path), "student", cells, ev, tokenizer=None,
                                             difficulty=1, **kw)
    assert len(ask(ev)["general/max"]["passes"]) == 3
    assert len(ask(ev)["general/max"]["passes"]) == 3 and calls == [3]   # cached
    ev.n = 5
    assert len(ask(ev)["general/max"]["passes"]) == 5 and calls == [3, 5]
    ev.sampling.max_new_tokens = 16
    ask(ev)
    assert calls == [3, 5, 5]
    ask(ev, n=3, seed=1)
    assert calls == [3, 5, 5, 3]


def test_cached_evaluations_keep_their_time_and_the_provenance_says_what_it_counts(
        tmp_path, monkeypatch):
    """A fresh evaluation stores its seconds in its rows; a later report's read from the
    cache adds them to its evaluation time once, and a cache from before (no seconds) is
    counted apart and named in the provenance line, as are stage commits other than the
    report's."""
    import ml_collections
    monkeypatch.setattr(rp, "evaluate_tasks", lambda *a, **k: (
        time.sleep(0.05), [{"cell": "general/max", "passes": [1.0]}])[1])
    monkeypatch.setattr(rp, "ModelRef", lambda path: type("M", (), {"load": lambda self: None})())
    ev = ml_collections.ConfigDict(dict(seed=0, n=1, batch_size=4,
                                        sampling=dict(temperature=0.0, max_new_tokens=8)))
    cells = [("general", "chain", "max")]
    row = rp.evaluate_stage(str(tmp_path), "student", cells, ev, tokenizer=None,
                            difficulty=1)["general/max"]
    assert row["eval_s"] >= 0.05
    path = str(next((tmp_path / "student").glob("eval_*.json")))
    assert rp.EVAL_SECONDS[path] == pytest.approx(row["eval_s"])
    rp.EVAL_SECONDS.clear()                 # a new report (as `report` does on entry)
    ask = lambda: rp.evaluate_stage(str(tmp_path), "student", cells, ev, tokenizer=None,  # noqa: E731
                                    difficulty=1)
    ask()
    ask()       # read twice, counted once
    assert rp.EVAL_SECONDS == {path: pytest.approx(row["eval_s"])}
    with open(path, "w") as f:              # a cache from before evaluations kept their time
        json.dump({"general/max": {"cell": "general/max", "passes": [1.0]}}, f)
    ask()
    assert rp.EVAL_SECONDS == {path: None}
    meta = {"command": "c", "commit": "abc", "stages_wall_s": 10.0, "eval_wall_s": 2.0}
    assert rp.provenance_line(meta).endswith("of wall time (summed over seeds).")
    line = rp.provenance_line(meta | {"stage_commits": ["2971f25"], "eval_untimed": 3})
    assert "The stages ran at commit 2971f25." in line
    assert "3 evaluations were read from an earlier invocation's cache" in line
