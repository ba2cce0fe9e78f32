"""DAPO's soft overlong penalty in the policy driver: configured by rl.overlong_buffer,
added to the task reward before the group advantages, checked before any work."""
import os

import numpy as np
import pytest

from opd_jax import envs, losses
from opd_jax.config import load_config
from opd_jax.models import ModelConfig
from opd_jax.trainers import builders
from opd_jax.episodes import Episode
from opd_jax.trainers.phases import Batcher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(*extra):
    return load_config(os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"),
                       ["--config.rollout.group_size=2", "--config.rollout.prompts_per_step=2",
                        "--config.rollout.sampling.max_new_tokens=20",
                        "--config.rollout.sampling.max_turns=1", *extra])


def _episodes(lengths, rewards):
    task = next(iter(envs.TaskSource("arithmetic", size=1, seed=0)))
    return [Episode(task, [1, 5, 6], response_ids=[7] * n, response_mask=[1] * n,
                    sampler_logp=[-1.0] * n, reward=r) for n, r in zip(lengths, rewards)]


def test_overlong_penalty_enters_the_advantages():
    lengths, rewards = [10, 15, 20, 4], [1.0, 1.0, 0.0, 0.0]
    model = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    eps = _episodes(lengths, rewards)
    _, plain, m0 = Batcher(_cfg(), model)(eps)
    _, batch, m = Batcher(_cfg("--config.rl.overlong_buffer=10"), model)(eps)
    penalty = np.asarray(losses.overlong_penalty(np.asarray(lengths), 20, 10))
    np.testing.assert_allclose(penalty, [0.0, -0.5, -1.0, 0.0])
    expected = np.asarray(losses.group_advantages(
        np.asarray(rewards, np.float32).reshape(2, 2) + penalty.reshape(2, 2), scale="std"))
    np.testing.assert_allclose(batch["adv"], expected.reshape(-1), atol=1e-6)
    assert not np.allclose(batch["adv"], plain["adv"])
    assert m["overlong/penalty_mean"] == pytest.approx(penalty.mean())
    assert "overlong/penalty_mean" not in m0
    assert m["reward/mean"] == m0["reward/mean"] == np.mean(rewards)   # the task reward


def test_overlong_buffer_is_checked_before_work():
    with pytest.raises(ValueError, match=r"rl.overlong_buffer=30: expected 0 \(off\) to 20"):
        builders.policy_rows(_cfg("--config.rl.overlong_buffer=30"), 1)
