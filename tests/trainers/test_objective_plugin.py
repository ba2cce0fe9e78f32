"""Adding an objective is one class (docs/objectives.md): an example registered here runs a
train_policy iteration on a tiny random model with no driver change, and the driver refuses
configs an objective's Needs rule out before any work."""
import dataclasses
import os
from typing import ClassVar

import jax
import ml_collections
import numpy as np
import pytest

from opd_jax import losses
from opd_jax.config import load_config
from opd_jax.models import ModelConfig, save_pretrained
from opd_jax.trainers.objectives import OBJECTIVES, Needs, register, student_logp
from opd_jax.trainers.run_policy import train_policy
from tests.models.helpers import random_model
from tests.trainers.test_policy_smoke import ROOT, SMALL


@dataclasses.dataclass(frozen=True)
class TeacherLogpReward:
    """The docs' worked example: the teacher's log-prob of each sampled token as its reward,
    l_t = -sg(lp_T(y_t)) lp_theta(y_t), reduced with `aggregation`."""
    name: ClassVar[str] = "example_teacher_logp_reward"
    needs: ClassVar[Needs] = Needs(teacher="logp", old_logp=False)
    aggregation: str = "token_mean"

    def __call__(self, model, batch, teachers=()):
        logp_BxT = student_logp(model, batch)
        reward_BxT = jax.lax.stop_gradient(batch["teacher_logp"])
        loss = losses.aggregate(-reward_BxT * logp_BxT, batch["mask"], self.aggregation)
        return loss, {"reward_logp_mean": losses.masked_mean(reward_BxT, batch["mask"])}


@dataclasses.dataclass(frozen=True)
class OneEpochTeacherReward(TeacherLogpReward):
    """The example with a config rule of its own (`check_config`, run before any work)."""
    name: ClassVar[str] = "example_one_epoch"

    def check_config(self, cfg) -> None:
        if cfg.rl.ppo_epochs != 1:
            raise ValueError(f"rl.ppo_epochs={cfg.rl.ppo_epochs}: {self.name} expected 1")


@pytest.fixture
def example_objective():
    register(TeacherLogpReward)
    yield TeacherLogpReward.name
    OBJECTIVES.pop(TeacherLogpReward.name)


def _cfg(tmp_path, name, extra=()):
    cfg_m = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=8, tie_embeddings=True)
    save_pretrained(random_model(cfg_m, seed=1), tmp_path / "m")
    path = tmp_path / "m"
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd"),
                      SMALL + ["--config.train.steps=1", f"--config.model.init_from={path}",
                               f"--config.teachers.paths={{'general/high': '{path}', "
                               f"'general': '{path}'}}", *extra])
    cfg.unlock()
    cfg.objective.name = name
    cfg.objective.options = ml_collections.ConfigDict()
    return cfg


def test_registered_example_objective_trains(tmp_path, example_objective):
    out = train_policy(_cfg(tmp_path, example_objective), str(tmp_path / "run"), progress=False)
    (h,) = out["history"]
    assert np.isfinite(h["loss"]) and np.isfinite(h["grad_norm"]) and h["reward_logp_mean"] < 0
    assert np.isfinite(h["loss/last_minibatch"])
    for phase in ("rollout", "teachers", "old_logp", "update", "eval", "iteration"):
        assert h[f"time/{phase}"] >= 0, phase
    assert "entropy" not in h            # old_logp=False: that forward is skipped
    assert "teachers_loaded" in h


def test_needs_refuse_bad_configs_before_work(tmp_path, example_objective):
    with pytest.raises(ValueError, match="one teacher.*routing='mixture'"):
        train_policy(_cfg(tmp_path, example_objective, ["--config.teachers.routing=mixture"]),
                     str(tmp_path / "mix"), progress=False)
    assert not (tmp_path / "mix").exists()
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"),
                      SMALL + ["--config.rollout.group_size=1"])
    with pytest.raises(ValueError, match="group_size >= 2.*group_size=1"):
        train_policy(cfg, str(tmp_path / "g1"), progress=False)
    assert not (tmp_path / "g1").exists()


def test_register_wants_a_needs_declaration():
    @dataclasses.dataclass(frozen=True)
    class NoNeeds:
        name: ClassVar[str] = "no_needs"
        needs: ClassVar[tuple] = ("teacher_logp",)
    with pytest.raises(TypeError, match="Needs"):
        register(NoNeeds)
    assert "no_needs" not in OBJECTIVES


def test_an_objective_declares_its_own_config_rule(tmp_path):
    register(OneEpochTeacherReward)
    try:
        cfg = _cfg(tmp_path, "example_one_epoch")
        cfg.rl.ppo_epochs = 2
        with pytest.raises(ValueError, match="rl.ppo_epochs=2: example_one_epoch expected 1"):
            train_policy(cfg, str(tmp_path / "two"), progress=False)
        assert not (tmp_path / "two").exists()
        cfg.rl.ppo_epochs = 1
        out = train_policy(cfg, str(tmp_path / "one"), progress=False)
        assert np.isfinite(out["history"][0]["loss"])
    finally:
        OBJECTIVES.pop(OneEpochTeacherReward.name)


def test_objective_options_are_checked_when_built(tmp_path):
    """A bad option value fails before any work, naming the option and its range."""
    cfg = _cfg(tmp_path, "kimi_mopd")
    cfg.objective.options = ml_collections.ConfigDict({"r_max": -1.0})
    with pytest.raises(ValueError, match="objective.options.r_max=-1.0: expected a finite "
                                         "number > 0"):
        train_policy(cfg, str(tmp_path / "bad"), progress=False)
    assert not (tmp_path / "bad").exists()
    cfg.objective.options = ml_collections.ConfigDict({"correction": "is"})
    with pytest.raises(ValueError, match="correction"):
        train_policy(cfg, str(tmp_path / "bad"), progress=False)


def test_undeclared_old_logprobs_fail_instead_of_reading_zeros(tmp_path):
    """An objective that reads batch["old_logp"] without declaring it (Needs.old_logp False)
    fails with a KeyError naming it: the driver never fills it with zeros."""
    @dataclasses.dataclass(frozen=True)
    class ReadsOld(TeacherLogpReward):
        name: ClassVar[str] = "example_reads_old"

        def __call__(self, model, batch, teachers=()):
            return losses.masked_mean(student_logp(model, batch) - batch["old_logp"],
                                      batch["mask"]), {}
    register(ReadsOld)
    try:
        with pytest.raises(KeyError, match="old_logp"):
            train_policy(_cfg(tmp_path, ReadsOld.name), str(tmp_path / "run"), progress=False)
    finally:
        OBJECTIVES.pop(ReadsOld.name)
