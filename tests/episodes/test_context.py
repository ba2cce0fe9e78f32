"""A multi-turn episode whose context outgrows the model's positions ends there
(finish "context_full") instead of failing the whole batch; a first-turn prompt that does
not fit is still an error naming it."""
import dataclasses

import pytest

from opd_jax import envs
from opd_jax.envs.base import StepResult, register_env
from opd_jax.models import ModelConfig, synthetic_tokenizer
from opd_jax.episodes import SamplingConfig, play
from tests.models.helpers import random_model

MAX_POS = 40


class _Chatty:
    """Never done: every turn gets a 5-character observation back."""
    stop_strings = ()

    def reset(self, task, role="student"):
        return task.prompt

    def step(self, text):
        return StepResult(observation="obs: ", reward=0.25, done=False)


register_env("test_chatty", _Chatty)


def _model():
    return random_model(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    max_position_embeddings=MAX_POS))


def _task(prompt):
    t = next(iter(envs.TaskSource("arithmetic", size=1, seed=0, effort="high")))
    return dataclasses.replace(t, prompt=prompt, env="test_chatty")


def test_long_multiturn_context_ends_at_the_model_positions():
    tasks = [_task("1+2=?"), _task("1+2+3+4+5+6+7=?")]
    eps = play(_model(), synthetic_tokenizer(), tasks,
               SamplingConfig(max_new_tokens=8, temperature=1.0, max_turns=10,
                              use_think_budget=False), seed=0)
    for ep in eps:
        total = len(ep.prompt_ids) + len(ep.response_ids)
        assert total <= MAX_POS, total
        assert ep.done and ep.finish == "context_full", (ep.finish, ep.turns)
        assert 1 < ep.turns < 10
        assert ep.reward == 0.25
        assert len(ep.response_mask) == len(ep.response_ids) == len(ep.sampler_logp)
    # The longer prompt has less room: it ends no later than the short one.
    assert eps[1].turns <= eps[0].turns


def test_first_turn_prompt_that_does_not_fit_is_an_error():
    with pytest.raises(ValueError, match="max_position_embeddings=40"):
        play(_model(), synthetic_tokenizer(), [_task("1" * 36 + "=?")],
             SamplingConfig(max_new_tokens=8, max_turns=2), seed=0)
