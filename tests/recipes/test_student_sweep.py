"""studies.student_sweep's patches: what a variant changes and that every variant's config is
valid before any training (the end-to-end run is in test_recipes_smoke's kimi_k3 case)."""
import json
import os

import ml_collections
import pytest

from opd_jax.config import load_config
from opd_jax.recipes import recipe_module
from opd_jax.recipes.pipeline import resolved_config
from opd_jax.trainers import config_schema
from studies import student_sweep as sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_patched_updates_nested_and_replaces_marked_sections():
    cfg = {"optim": {"lr": 1e-4, "b1": 0.9}, "objective": {"name": "a", "options": {"x": 1}}}
    out = sweep.patched(cfg, {"optim": {"lr": 3e-4}, "=objective": {"name": "b", "options": {}}})
    assert out == {"optim": {"lr": 3e-4, "b1": 0.9}, "objective": {"name": "b", "options": {}}}
    assert cfg["optim"]["lr"] == 1e-4 and cfg["objective"]["options"] == {"x": 1}  # untouched


@pytest.mark.parametrize("variant", [v for v, (_, p) in sweep.VARIANTS.items()
                                     if p and "@average" not in p])
def test_every_variant_is_a_valid_student_config(variant, tmp_path):
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:reduced"))
    student = next(s for s in recipe_module("kimi_k3").build(c, 0) if s.name == "student")
    cfg = json.loads(json.dumps(resolved_config(student, str(tmp_path)).to_dict()))
    stage = sweep.variant_stage(c, 0, variant, merge="merge_1.5")   # validated there
    out = json.loads(json.dumps(resolved_config(stage, str(tmp_path)).to_dict()))
    config_schema.validate(ml_collections.ConfigDict(out))
    assert out != cfg or stage.init_from != student.init_from or variant in sweep.ADOPTED
    if sweep.VARIANTS[variant][1].get("@init") == "merge":
        with pytest.raises(ValueError, match="give the seed's merge stage"):
            sweep.variant_stage(c, 0, variant)
    if "@init" in sweep.VARIANTS[variant][1]:
        assert stage.init_from == {"merge": "merge_1.5",
                                   "start": None}[sweep.VARIANTS[variant][1]["@init"]]


@pytest.mark.parametrize("variant", [v for v, (_, p) in sweep.VARIANTS.items()
                                     if p and "@average" in p])
def test_an_averaging_variant_names_a_trained_variant_and_is_no_stage(variant):
    source, k = sweep.VARIANTS[variant][1]["@average"]
    assert source in sweep.VARIANTS and "@average" not in (sweep.VARIANTS[source][1] or {})
    assert isinstance(k, int) and k >= 2
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:reduced"))
    with pytest.raises(ValueError, match="averages another variant's checkpoints"):
        sweep.variant_stage(c, 0, variant)


def test_adopted_variants_are_what_the_preset_now_runs(tmp_path):
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:reduced"))
    student = next(s for s in recipe_module("kimi_k3").build(c, 0) if s.name == "student")
    as_json = lambda stage: json.loads(json.dumps(resolved_config(stage, str(tmp_path)).to_dict()))
    for variant in sweep.ADOPTED:
        stage = sweep.variant_stage(c, 0, variant)
        assert as_json(stage) == as_json(student) and stage.init_from == student.init_from, variant


def test_unknown_variant_is_refused_by_name(tmp_path):
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:smoke"))
    with pytest.raises(KeyError, match="no_such"):
        sweep.train_variant(c, str(tmp_path), 0, "no_such")


def test_joint_sft_trains_the_start_on_every_domain_with_the_specialists_summed_steps():
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:reduced"))
    stage = sweep.variant_stage(c, 0, "joint_sft")
    assert stage.kind == "sft" and stage.init_from is None       # the start (builtin:base)
    assert dict(stage.config.data.tasks.families) == dict(c.domains)
    assert tuple(stage.config.data.tasks.efforts) == tuple(c.efforts)
    assert stage.config.train.steps == 2 * c.specialist_sft.train.steps
    assert stage.config.optim.lr == c.specialist_sft.optim.lr
