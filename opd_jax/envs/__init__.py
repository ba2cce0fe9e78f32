"""Environments and rewards: tasks in (domain, effort) cells, verifiers, a code sandbox,
and reward models. Pure Python (grain only as the consumer of the sources); no jax import.

    from opd_jax import envs
    src = envs.TaskSource("arithmetic", size=100, seed=0, difficulty=2, effort="low")
    task = src[0]
    env = envs.make_env(task); prompt = env.reset(task)     # "<|low|><|user|>..."
    env.step("<think>...</think>42")                       # StepResult(..., done=True)
"""
from opd_jax.envs.base import (CHAT_EFFORT, DEFAULT_EFFORTS, DOMAINS, KNOWN_EFFORTS, PER_TURN_EFFORTS,
                               SPLITS, THINKING_MODES, EffortSpec,
                               cell_name, cell_of, chatml, Environment,
                               RewardResult, SingleTurnEnv, StepResult, Task, TaskFamily,
                               effort_spec, get_family, list_families, make_env,
                               register_env, register_family, render_prompt, score,
                               turn_control, turn_mode, turn_modes)
from opd_jax.envs.data import (EVAL_BUCKETS, SCHEDULE_TURNS, JsonlSource, MixtureSource,
                               TaskSource, check_family_domain, draw_turn_modes, grid_source, load_jsonl,
                               save_jsonl, split_of)
from opd_jax.envs.parsing import count_tokens, parse_response
from opd_jax.envs.rewards import (CompositeReward, GenerativeRewardModel, LengthReward,
                                  format_reward, score_batch, step_many,
                                  task_reward)
from opd_jax.envs import agent, coding, general  # noqa: F401  (register built-in families)
from opd_jax.envs.chat import check_chat_template

__all__ = [
    "CHAT_EFFORT", "DEFAULT_EFFORTS", "DOMAINS", "KNOWN_EFFORTS", "PER_TURN_EFFORTS", "SPLITS",
    "THINKING_MODES", "cell_name", "cell_of", "chatml", "EffortSpec", "Environment", "RewardResult",
    "SingleTurnEnv", "StepResult", "Task", "TaskFamily", "effort_spec", "get_family",
    "list_families", "make_env", "register_env", "register_family", "render_prompt", "score",
    "turn_control", "turn_mode", "turn_modes",
    "EVAL_BUCKETS", "SCHEDULE_TURNS", "JsonlSource", "MixtureSource", "TaskSource", "check_family_domain",
    "draw_turn_modes", "grid_source", "load_jsonl", "save_jsonl", "split_of",
    "check_chat_template", "count_tokens", "parse_response", "CompositeReward", "GenerativeRewardModel",
    "LengthReward", "format_reward", "score_batch", "step_many", "task_reward",
]
