"""A dict literal for a structured section checks every key, recursively, before setting
any; free-form maps (FREE_FORM_MAPS: task families, teacher paths/table/weights, an
experiment's domains and stage_teachers) are replaced whole and take any keys."""
import copy

import pytest

from opd_jax.config import ConfigError, apply_overrides, load_config

SFT, GRPO, OPD, GLM = ("configs/sft.py:tiny", "configs/grpo.py", "configs/opd.py:kimi_mopd",
                       "experiments/glm/config.py:smoke")


@pytest.fixture(scope="module")
def glm():
    return load_config(GLM)


def test_unknown_key_names_key_section_and_known_keys_and_sets_nothing():
    cfg = load_config(SFT)
    with pytest.raises(ConfigError) as e:
        apply_overrides(cfg, ["--config.optim={'lr': 1e-3, 'bogus': 1}"])
    msg = str(e.value)
    assert msg.startswith("unknown config key 'optim.bogus' in section 'optim'; known keys: ")
    assert "b1, b2, eps, grad_accum" in msg and "lr" in msg
    assert cfg.optim.lr == load_config(SFT).optim.lr          # nothing was set
    # a typo close to a key still gets its suggestion
    with pytest.raises(ConfigError, match="'optim.lrr' \\(did you mean 'lr'\\?\\) in section"):
        load_config(SFT, ["--config.optim={'lrr': 1e-3}"])


@pytest.mark.parametrize("override, match", [
    ("--config.rollout={'sampling': {'temprature': 0.5}}",
     "unknown config key 'rollout.sampling.temprature' \\(did you mean 'temperature'\\?\\) "
     "in section 'rollout.sampling'; known keys: .*max_new_tokens"),
    ("--config.rollout={'sampling': {'temperature': 'hot'}}",
     "'rollout.sampling.temperature' expects float, got str"),
    ("--config.rollout={'sampling': 3}", "'rollout.sampling' is a section"),
    ("--config.tasks={'families': {'general': 'arithmetic'}, 'bogus': 1}",
     "unknown config key 'tasks.bogus' in section 'tasks'"),
])
def test_nested_sections_are_checked(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(GRPO, [override])


def test_nested_dict_sets_each_key():
    cfg = load_config(GRPO, ["--config.rollout={'group_size': 2, 'sampling': "
                             "{'temperature': 0.5}}"])
    base = load_config(GRPO)
    assert cfg.rollout.group_size == 2 and cfg.rollout.sampling.temperature == 0.5
    assert cfg.rollout.sampling.top_p == base.rollout.sampling.top_p    # others kept


def test_a_string_valued_section_is_structured(glm):
    """experiments/glm's `merge` holds only a string: it was taken for a map and replaced
    whole, so a typo dropped `method` and added a field."""
    cfg = copy.deepcopy(glm)
    with pytest.raises(ConfigError, match="unknown config key 'merge.metod' \\(did you mean "
                                          "'method'\\?\\) in section 'merge'; known keys: "
                                          "method"):
        apply_overrides(cfg, ["--config.merge={'metod': 'ties'}"])
    apply_overrides(cfg, ["--config.merge={'method': 'ties'}"])
    assert cfg.merge.to_dict() == {"method": "ties"}


def test_free_form_maps_take_new_keys(glm):
    cfg = load_config(OPD, [
        "--config.teachers.paths={'general/max': 'runs/a', 'coding/max': 'runs/b'}",
        "--config.teachers.table={'general': 'general/max'}",
        "--config.teachers.weights={'general': {'general/max': 1.0}}",
        # once it holds numbers it is still a map: new names replace it whole
        "--config.teachers.weights={'coding': {'coding/max': 0.5, 'general/max': 0.5}}",
        "--config.tasks.families={'general': 'arithmetic', 'coding': 'code_expr'}",
        "--config.teachers={'paths': {'agent/max': 'runs/c'}, 'max_loaded': 1}",
    ])
    assert cfg.teachers.paths.to_dict() == {"agent/max": "runs/c"}
    assert cfg.teachers.table.to_dict() == {"general": "general/max"}
    assert cfg.teachers.weights.to_dict() == {"coding": {"coding/max": 0.5, "general/max": 0.5}}
    assert cfg.tasks.families.to_dict() == {"general": "arithmetic", "coding": "code_expr"}
    assert cfg.teachers.max_loaded == 1
    sft = load_config(SFT, ["--config.data={'tasks': {'families': {'agent': 'tool_lookup'}}}"])
    assert sft.data.tasks.families.to_dict() == {"agent": "tool_lookup"}
    g = copy.deepcopy(glm)
    apply_overrides(g, ["--config.domains={'general': 'chain', 'math': 'arithmetic'}",
                        "--config.stage_teachers={'general': 'reasoning_rl'}",
                        "--config.student.teachers.paths={'x': 'runs/x'}"])
    assert g.domains.to_dict() == {"general": "chain", "math": "arithmetic"}
    assert g.stage_teachers.to_dict() == {"general": "reasoning_rl"}
    assert g.student.teachers.paths.to_dict() == {"x": "runs/x"}
