"""Each recipe end to end at the smallest size: every stage runs and checkpoints, a second
run resumes (finished stages are skipped, an unfinished one resumes from its checkpoint),
and the results table, JSON and plots are written."""
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from opd_jax.config import load_config
from opd_jax.models import ModelRef
from opd_jax.recipes import recipe_module, run_experiment
from opd_jax.recipes.pipeline import is_done
from opd_jax.trainers.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE_HEAD = {"kimi_k3": "| cell | start | teacher | teacher - start (se) | student |",
              "glm": "| domain | start | reasoning_rl | general_rl | student | merge |",
              # kimi_k3's report, with the sampled-token student's columns
              "deepseek_v4": "| sampled-token | its gain kept | student - sampled (se) |"}


@pytest.mark.parametrize("recipe", [
    "kimi_k3",
    pytest.param("glm", marks=pytest.mark.slow),
    pytest.param("deepseek_v4", marks=pytest.mark.slow),
])
def test_recipe_smoke(tmp_path, recipe, capsys):
    c = load_config(os.path.join(ROOT, f"experiments/{recipe}/config.py:smoke"))
    results = run_experiment(c, str(tmp_path), progress=False)
    stages = recipe_module(recipe).build(c, 0)
    sw = tmp_path / "seed0"
    for s in stages:
        assert is_done(str(sw), s.name), s.name
        if s.kind != "merge":
            assert any(d.isdigit() for d in os.listdir(sw / s.name / "checkpoints")), s.name
        else:
            assert (sw / s.name / "config.json").is_file()     # an HF folder
    md = (tmp_path / "results.md").read_text()
    assert TABLE_HEAD[recipe] in md.replace(" (forgotten)", "")
    assert json.load(open(tmp_path / "results.json"))["recipe"] == recipe
    assert json.load(open(tmp_path / "config.json"))["recipe"] == recipe
    if recipe == "glm":   # per-turn thinking has its own rows; General RL logged its judge
        for mode in ("think_on", "think_off", "think_mixed"):
            assert f"| agent/{mode} |" in md, mode
        assert "| general/think_mixed |" not in md
        judged = [m for m in read_metrics(str(sw / "general_rl")) if "reward/judge_mean" in m]
        assert judged and all(0.0 <= m["reward/judge_mean"] <= 1.0 for m in judged)
        assert not any("reward/judge_mean" in m for m in read_metrics(str(sw / "reasoning_rl")))
    if recipe == "deepseek_v4":   # the full-vocabulary student, its teachers through a cache
        cache = json.load(open(sw / "student" / "teacher_cache.json"))["stats"]
        assert cache["loads"] > 0 and cache["evictions"] > 0    # 1 loaded of 2 in the bank
        assert f"{cache['loads']} loads, {cache['evictions']} evictions" in md
        assert "the student beats the sampled-token student" in md
    # the table is a function of results.json alone
    out = tmp_path / "again.md"
    recipe_module(recipe).write_markdown(str(out), json.load(open(tmp_path / "results.json")))
    assert out.read_text() == md
    prov = results["provenance"]
    assert prov["commit"] and prov["stages_wall_s"] > 0 and "command" in prov
    pngs = [f for f in os.listdir(tmp_path) if f.endswith(".png")]
    assert pngs and all(open(tmp_path / f, "rb").read(4) == b"\x89PNG" for f in pngs)

    # Resume: the last trainer stage is marked unfinished; it resumes from its final
    # checkpoint (no new optimizer steps), the others are skipped, the table is the same.
    last = [s for s in stages if s.kind in ("grpo", "opd")][-1]
    os.remove(sw / last.name / "done.json")
    capsys.readouterr()
    again = run_experiment(c, str(tmp_path), progress=False)
    out = capsys.readouterr().out
    assert f"{last.kind} {last.name}: running" in out
    assert out.count(": done") == len(stages) - 1
    # the same measurements (the invocation's provenance, its wall times, may differ)
    again.pop("provenance", None), results.pop("provenance", None)
    for r in (again, results):            # kimi_k3's per-stage costs: the wall times
        for s in r.get("per_seed", []):
            for cost in s.get("stages", {}).values():
                cost.pop("wall_s", None)
    # the resumed stage's compute continued from its checkpoint: the same counts
    if recipe == "kimi_k3":
        assert results["per_seed"][0]["stages"][last.name]["flops"] > 0
        _check_student_sweep(c, tmp_path)
    assert json.dumps(again, sort_keys=True, default=str) == json.dumps(results, sort_keys=True,
                                                                          default=str)


def _check_student_sweep(c, tmp_path):
    """studies.student_sweep on the finished smoke run: a variant re-trains the student with
    its patch (here seq_mean), the preset row is the run's own student, the rows pair with
    the run's start / teachers / merge, and results.md is a function of results.json."""
    from studies import student_sweep as sweep
    res = sweep.run(c, str(tmp_path), (0,), ("preset", "seq_mean"))
    cfg = json.load(open(tmp_path / "seed0" / "sweep_seq_mean" / "config.json"))
    assert cfg["objective"]["options"]["aggregation"] == "seq_mean"
    assert json.load(open(tmp_path / "seed0" / "student" / "config.json"))[
        "objective"]["options"]["aggregation"] == "token_mean"
    models = res["per_seed"][0]["models"]
    n = c.eval.n
    assert set(models) == {"start", "teacher", "merge", "preset", "seq_mean"}
    assert all(len(v) == n for m in models.values() for v in m.values())
    s = sweep.summarize(res)
    assert s["variants"]["seq_mean"]["cost"]["optimizer_steps"] == (
        c.student.train.steps * c.student.rl.minibatches)
    md = sweep.write_results(str(tmp_path), res, "test")
    again = json.load(open(tmp_path / "student_sweep" / "results.json"))
    assert sweep.report_md(again) == md and "| seq_mean |" in md
    _check_averaged_iterates(c, tmp_path, sweep)


def _check_averaged_iterates(c, tmp_path, sweep):
    """An "@average" variant is the uniform average of its source variant's last k
    checkpoints, written once as a model folder, evaluated like any row, costed as its
    source; a source that kept fewer checkpoints is refused."""
    patches = {"every_ckpt": ("test", {"train": {"ckpt_every": 1, "keep_checkpoints": 2}}),
               "every_ckpt_avg_2": ("test", {"@average": ["every_ckpt", 2]}),
               "every_ckpt_avg_3": ("test", {"@average": ["every_ckpt", 3]})}
    old = dict(sweep.VARIANTS)
    sweep.VARIANTS.update(patches)
    try:
        res = sweep.run(c, str(tmp_path), (0,), ("every_ckpt", "every_ckpt_avg_2"))
        with pytest.raises(ValueError, match="2 checkpoints kept, 3 to average"):
            sweep.run(c, str(tmp_path), (0,), ("every_ckpt_avg_3",))
    finally:
        sweep.VARIANTS.clear()
        sweep.VARIANTS.update(old)
    ck = tmp_path / "seed0" / "sweep_every_ckpt" / "checkpoints"
    steps = sorted(int(s) for s in os.listdir(ck) if s.isdigit())
    assert len(steps) == 2
    ps = [nnx.state(ModelRef(str(ck / str(s))).load(), nnx.Param) for s in steps]
    avg = nnx.state(ModelRef(str(tmp_path / "seed0" / "sweep_every_ckpt_avg_2")).load(),
                    nnx.Param)
    for a, b, m in zip(jax.tree.leaves(ps[0]), jax.tree.leaves(ps[1]), jax.tree.leaves(avg)):
        np.testing.assert_allclose(np.asarray(m), (np.asarray(a) + np.asarray(b)) / 2,
                                   rtol=1e-6, atol=1e-7)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(ps[0]), jax.tree.leaves(ps[1])))
    per_seed = res["per_seed"][0]
    assert per_seed["cost"]["every_ckpt_avg_2"] == per_seed["cost"]["every_ckpt"]
    assert len(per_seed["models"]["every_ckpt_avg_2"]) == len(per_seed["models"]["start"])
