"""Issue 30, one schema for the config: every field declares a type and a range or set
beside its default (opd_jax/schema_sections.py; objective options on the objective's
dataclass), and every command checks every value before anything is written or compiled.

The walk below takes each numeric field of each trainer root, tries the values just outside
its range through the command line in-process, and expects one line naming the field, exit
status 2, and no file written."""
import os

import pytest

from opd_jax.trainers import config_schema as schema
from opd_jax.cli import main
from opd_jax.config import ConfigError, load_config
from tests.faults.conftest import ROOT

CONFIGS = os.path.join(ROOT, "opd_jax/configs")
COMMANDS = [("sft", "sft.py:tiny"), ("grpo", "grpo.py:tiny"), ("opd", "opd.py:kimi_mopd"),
            ("opd", "opd.py:glm_cross_stage"), ("opd", "opd.py:deepseek_full_vocab"),
            ("eval", "eval.py:grid")]


def _cases():
    for command, spec in COMMANDS:
        cfg = load_config(os.path.join(CONFIGS, spec))
        for key, field in schema.numeric_fields(schema.root_of(cfg), cfg):
            for bad in field.out_of_range():
                yield pytest.param(command, spec, key, bad, field, id=f"{spec}-{key}={bad}")


def test_every_numeric_field_declares_a_range():
    for command, spec in COMMANDS:
        cfg = load_config(os.path.join(CONFIGS, spec))
        for key, field in schema.numeric_fields(schema.root_of(cfg), cfg):
            assert field.out_of_range(), f"{spec}: {key} declares no bound"


@pytest.mark.parametrize("command, spec, key, bad, field", list(_cases()))
def test_out_of_range_values_fail_in_one_line_before_any_write(tmp_path, capsys, command, spec,
                                                               key, bad, field):
    workdir, out = tmp_path / "run", tmp_path / "out"
    argv = [command, "--config", os.path.join(CONFIGS, spec), f"--config.{key}={bad!r}",
            "--no-progress", "--out", str(out)]
    argv += ["--checkpoint", str(tmp_path / "none")] if command == "eval" else \
        ["--workdir", str(workdir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {key}={bad!r}: expected {field.expected()}\n"
    assert not workdir.exists() and not out.exists()


def test_every_shipped_preset_and_experiment_stage_holds_to_the_schema():
    from opd_jax.recipes import check_stages, recipe_module
    for spec in ["sft.py:tiny", "sft.py:tasks", "sft.py:base", "sft.py:jsonl",
                 "sft.py:qwen3_1p7b", "grpo.py:tiny", "grpo.py:dapo", "grpo.py:drgrpo",
                 "opd.py:kimi_mopd", "opd.py:glm_cross_stage", "opd.py:deepseek_full_vocab",
                 "eval.py:grid", "eval.py:general"]:
        schema.validate(load_config(os.path.join(CONFIGS, spec)))
    for name, presets in [("kimi_k3", ("smoke", "reduced", "full", "scale_8xh100")),
                          ("glm", ("smoke", "reduced", "full")),
                          ("deepseek_v4", ("smoke", "reduced", "full")),
                          ("real_smollm2", ("smoke", "default"))]:
        for preset in presets:
            c = load_config(os.path.join(ROOT, f"experiments/{name}/config.py:{preset}"))
            check_stages(recipe_module(c.recipe).build(c, 0))     # validates each stage


def test_a_key_the_schema_does_not_declare_is_refused():
    cfg = load_config(os.path.join(CONFIGS, "sft.py:tiny"))
    with cfg.unlocked():
        cfg.optim.lr_decay = 0.5
    with pytest.raises(ConfigError, match="config key 'optim.lr_decay' is not in the schema"):
        schema.validate(cfg)
    with pytest.raises(ConfigError, match="'objective.options.r_max' is not an option of "
                                          "objective 'grpo'"):
        schema.validate(_grpo_with_option("r_max", 5.0))


def _grpo_with_option(key, value):
    cfg = load_config(os.path.join(CONFIGS, "grpo.py:tiny"))
    with cfg.objective.options.unlocked():
        cfg.objective.options[key] = value
    return cfg


def test_types_and_choices_are_checked_too(tmp_path, capsys):
    for override, msg in [
            ("--config.rl.adv_scale='mean'", "rl.adv_scale='mean': expected one of 'std', "
                                              "'none'"),
            ("--config.objective.options.correction.kind='popice'",
             "objective.options.correction.kind='popice': expected one of 'icepop', 'tis'"),
            ("--config.objective.options.aggregation='sum'",
             "objective.options.aggregation='sum': expected one of 'token_mean'"),
            ("--config.model.dtype='float8'", "model.dtype='float8': expected one of")]:
        argv = ["grpo", "--config", os.path.join(CONFIGS, "grpo.py:tiny"), override,
                "--workdir", str(tmp_path / "run"), "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {msg}") and err.count("\n") == 1
        assert not (tmp_path / "run").exists()


def test_an_experiment_checks_every_stage_before_writing(tmp_path, capsys):
    workdir = tmp_path / "exp"
    argv = ["experiment", "--config", os.path.join(ROOT, "experiments/kimi_k3/config.py:smoke"),
            "--config.student.optim.b1=1.0", "--workdir", str(workdir), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("error: stage 'student': optim.b1=1.0: expected a number in [0, 1)\n")
    assert not workdir.exists()


def test_model_shape_overrides_init_from_would_ignore_are_refused(tmp_path, capsys):
    """`init_from=builtin:base` with another hidden_size silently ignored it."""
    argv = ["sft", "--config", os.path.join(CONFIGS, "sft.py:tasks"),
            "--config.model.init_from=builtin:base", "--config.model.hidden_size=256",
            "--workdir", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "error: model.hidden_size=256 would be ignored: model.init_from='builtin:base' brings "
        "its own architecture (hidden_size=192); expected 192 or no override\n")
    assert not (tmp_path / "run").exists()
    # the base's own value, and the section's defaults, are accepted
    from opd_jax.trainers import builders
    for extra in (["--config.model.hidden_size=192"], []):
        builders.setup(load_config(os.path.join(CONFIGS, "sft.py:tasks"), [
            "--config.model.init_from=builtin:base", *extra]))


@pytest.mark.parametrize("override, msg", [
    ("--config.val_n=0", "val_n=0: expected an int >= 1"),
    ("--config.seeds=(0, -1)", "seeds=(0, -1): element 1 (-1) expected an int >= 0"),
    ("--config.effort_schedule='ladder'", "effort_schedule='ladder': expected one of"),
    ("--config.eval.difficulty=7", "eval.difficulty=7: expected an int in [1, 5]"),
])
def test_an_experiments_own_values_are_checked_before_writing(tmp_path, capsys, override, msg):
    """The probe: teacher_level=2.0 ran the whole experiment (the teacher-level bar then
    meant twice the teacher's reward); teacher_level is gone with the reward claims, the
    check is the same for every experiment value."""
    workdir = tmp_path / "exp"
    argv = ["experiment", "--config", os.path.join(ROOT, "experiments/kimi_k3/config.py:smoke"),
            override, "--workdir", str(workdir), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {msg}") and err.count("\n") == 1, err
    assert not workdir.exists()


def test_convert_of_a_missing_file_says_so(tmp_path, capsys):
    assert main(["convert", "--from", str(tmp_path / "none.gguf"), "--to",
                 str(tmp_path / "out")]) == 2
    assert "none.gguf': no such file" in capsys.readouterr().err


@pytest.mark.parametrize("override, msg", [
    ("--config.teachers.prompt_role='assistant'",
     "teachers.prompt_role='assistant': expected one of 'student', 'teacher'"),
    ("--config.objective.options.correction.icepop_bounds=(5.0, 0.5)",
     "objective 'kimi_mopd', --config.objective.options: icepop_bounds=(5.0, 0.5): need "
     "alpha < beta"),
    ("--config.objective.options.eps_low=1.0",
     "objective.options.eps_low=1.0: expected a number in [0, 1)"),
    ("--config.teachers.routing='round_robin'", "teachers.routing='round_robin': expected one of"),
])
def test_objective_and_teacher_options_fail_before_any_write(tmp_path, capsys, override, msg):
    """The issue's list: objective option values (correction, aggregation, r_max, icepop
    bounds, eps, kl_beta, role) were checked only after the first rollout, with config.json
    already written."""
    workdir = tmp_path / "run"
    argv = ["opd", "--config", os.path.join(CONFIGS, "opd.py:kimi_mopd"), override,
            "--workdir", str(workdir), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {msg}") and err.count("\n") == 1, err
    assert not workdir.exists()
