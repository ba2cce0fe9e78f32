"""Stage times: done.json records wall and compile seconds; benchmarks/opd_iteration.py
reads them back per stage (old records without compile times too) and builds each
objective's profiling run from its reduced recipe with builtin:base models."""
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from opd_jax.recipes.pipeline import CompileClock, Stage, run_stage
from tests.benchmarks import load



def _opd_iteration():
    return load("opd_iteration")


def test_compile_clock_counts_compiles_only_while_active():
    with CompileClock() as clock:
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.5)(jnp.ones((3, 5))).block_until_ready()
    assert clock.compiles >= 1 and clock.compile_s > 0 and len(clock.log) >= clock.compiles
    seen = clock.record()
    jax.jit(lambda x: jnp.cos(x) - 2.0)(jnp.ones((7,))).block_until_ready()
    assert clock.record() == seen


def test_done_json_records_wall_and_compile_seconds(tmp_path, monkeypatch):
    import opd_jax.trainers.run_sft as run_sft

    def fake_train_sft(cfg, workdir, progress=True):
        os.makedirs(workdir)
        jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((4, 6))).block_until_ready()
        time.sleep(0.2)          # a known floor for the stage's wall time
        return {"step": 3}
    monkeypatch.setattr(run_sft, "train_sft", fake_train_sft)
    record = run_stage(Stage("sft", "sft", ml_collections.ConfigDict({"x": 1})), str(tmp_path))
    on_disk = json.loads((tmp_path / "sft" / "done.json").read_text())
    assert on_disk == record
    assert record["compiles"] >= 1 and 0 <= record["compile_s"] <= record["wall_s"]
    assert record["wall_s"] >= 0.2
    assert record["optimizer_steps"] == 3 and record["kind"] == "sft"


def test_stage_table_reads_old_and_new_records(tmp_path):
    mod = _opd_iteration()
    seed = tmp_path / "seed0"
    for name, rec in (("sft", {"kind": "sft", "iterations": 30, "wall_s": 40.0}),   # written before compile_s
                      ("student", {"kind": "opd", "iterations": 2, "wall_s": 60.0, "compile_s": 12.5,
                                   "compiles": 40})):
        (seed / name).mkdir(parents=True)
        (seed / name / "done.json").write_text(json.dumps(rec))
        os.utime(seed / name / "done.json", (1e9 + len(name), 1e9 + len(name)))   # sft first
    rows = [{"step": i, "time/rollout": 10.0, "time/teachers": 5.0, "time/old_logp": 1.0, "time/update": 4.0,
             "time/eval": 0.5 * i} for i in (1, 2)]
    (seed / "student" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    lines = mod.stage_table(str(tmp_path))
    assert lines[2] == "| seed0/sft | sft | 30 | 40.0 | 40% | - | - | - | - | - | - |"
    assert lines[3] == "| seed0/student | opd | 2 | 60.0 | 60% | 12.5 (40) | 20.0 | 10.0 | 2.0 | 8.0 | 1.5 |"
    assert lines[4] == "| total | | | 100.0 | 100% | 12.5 | 20.0 | 10.0 | 2.0 | 8.0 | 1.5 |"
    with pytest.raises(FileNotFoundError, match="no \\*/done.json"):
        mod.stage_table(str(tmp_path / "empty"))


@pytest.mark.parametrize("objective", ["kimi_mopd", "glm_cross_stage", "deepseek_full_vocab"])
def test_profiling_runs_are_the_reduced_recipes_students_on_the_base(objective):
    mod = _opd_iteration()
    args = mod.argparse.Namespace(iterations=3, prompts=8, max_new_tokens=16, max_turns=0)
    cfg = mod.student_config(objective, args)
    assert cfg.objective.name == objective and cfg.model.init_from == "builtin:base"
    assert cfg.teachers.paths and set(dict(cfg.teachers.paths).values()) == {"builtin:base"}
    assert (cfg.train.steps, cfg.rollout.prompts_per_step, cfg.rollout.sampling.max_new_tokens) == (3, 8, 16)
    assert cfg.rollout.sampling.max_turns == 10 and cfg.rl.minibatches == 4   # the recipe's


@pytest.mark.parametrize("name,objective", [("kimi_mopd_smollm2", "kimi_mopd"),
                                            ("full_vocab_smollm2", "deepseek_full_vocab")])
def test_real_model_profiles_are_real_smollm2s_students_on_smollm2(name, objective):
    mod = _opd_iteration()
    args = mod.argparse.Namespace(iterations=2, prompts=0, max_new_tokens=0, max_turns=0)
    cfg = mod.student_config(name, args)
    assert cfg.objective.name == objective and cfg.model.init_from == "builtin:smollm2"
    assert set(dict(cfg.teachers.paths)) == {"general/chat", "agent/chat"}
    assert set(dict(cfg.teachers.paths).values()) == {"builtin:smollm2"}
    assert cfg.rollout.prompts_per_step == 16 and cfg.train.steps == 2    # the recipe's, 2 iterations


def test_flops_table_gives_each_phase_its_share_and_rate():
    mod = _opd_iteration()
    r = {"objective": "kimi_mopd", "recipe": "kimi_k3", "stage": "student",
         "flops": {"rollout": 2e9, "teachers": 1e9, "old_logp": 0.0, "update": 7e9},
         "median": {"rollout": 2.0, "teachers": 0.5, "old_logp": 0.0, "update": 3.5}}
    row = mod.flops_table([r])[2]
    assert row == ("| kimi_mopd (kimi_k3: student) | 1.00e+10 | 2.00e+09 (20%) | 1.0 | "
                   "1.00e+09 (10%) | 2.0 | 0 | - | 7.00e+09 (70%) | 2.0 |")


@pytest.mark.slow
def test_iteration_profile_writes_its_table(tmp_path):
    # 32 prompts / 4 minibatches: 8 rows a step, one per fake device of the test suite.
    out = tmp_path / "opd_iteration.txt"
    _opd_iteration().main(["--objectives", "kimi_mopd", "--prompts", "32", "--max-new-tokens", "8",
                           "--max-turns", "1", "--iterations", "2", "--out", str(out)])
    text = out.read_text()
    assert "# load average before" in text and "# commit" in text
    assert "| kimi_mopd (kimi_k3: student; 2.2M; 6 teachers) | 32 x 4 |" in text
    assert "| kimi_mopd (kimi_k3: student) |" in text      # the FLOPs table
