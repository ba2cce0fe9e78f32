"""The generative reward model on the training path: a policy run's `rewards.judge` section.

    rewards.judge.path = "builtin:base"     # any checkpoint (HF folder, opd_jax workdir,
                                            # builtin:NAME); "" = no judge
    rewards.judge.rubric = "Score 10 if ..."
    rewards.judge.weight = 0.2              # training reward = task + weight * judge
    rewards.judge.max_new_tokens = 16       # tokens of the judge's verdict (greedy)
    rewards.judge.include_reference = False # the judge also sees the task's reference answer
    rewards.judge.batch_size = 64           # verdicts per engine call

After each rollout the judge (loaded once at the start of the run, decoded greedily on the
rollout engine, so a verdict is a deterministic function of the episode) reads the rubric,
the task prompt and the episode's final answer (`envs.GenerativeRewardModel.render`; an
answer too long for the judge's positions is cut, and counted). Its verdict becomes a score
in [0, 1] (`GenerativeRewardModel.parse`: the number after "Score:", else the last number,
over 10; a verdict without a number scores 0 and is counted). The score is mixed into each
episode's task reward before the group advantages, ``mix_judge``:

    reward = task_reward + weight * judge_score

(`envs.CompositeReward` with weights {task: 1, judge: weight}). The held-out evaluation and
the `reward/*` metrics stay the verifier's task reward; the judge logs
``reward/judge_mean``, ``reward/judge_error_frac``, ``reward/judge_truncated_frac`` and
``time/judge``. Every value is checked before any work (`check_judge`).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from opd_jax import envs
from opd_jax.envs import parsing
from opd_jax.envs.rewards import DEFAULT_RUBRIC
from opd_jax.episodes import encode, prompt_ids
from opd_jax.models import ModelRef, check_tokenizer
from opd_jax.rollout import generate



def mix_judge(task_B: np.ndarray, judge_B: np.ndarray, weight: float) -> np.ndarray:
    """The training reward: task reward + weight * judge score, per episode."""
    return np.asarray(task_B, np.float32) + np.float32(weight) * np.asarray(judge_B, np.float32)


def _need(cond: bool, key: str, value, expected: str) -> None:
    if not cond:
        raise ValueError(f"rewards.judge.{key}={value!r}: expected {expected}")


def check_judge(j, *, vocab_size: int | None = None, tokenizer=None,
                tokenizer_spec: str = "?") -> None:
    """Raise, naming the key, unless `j` (a `rewards.judge` section, its values already
    checked against the schema: `config_schema.validate`) is usable: a weight only with a
    path, a rubric, and with a path, a checkpoint there with the run's vocabulary and
    tokenizer. Reads configs only (no weights)."""
    path, weight = j.get("path", ""), j.get("weight", 0.0)
    if not path:
        _need(weight == 0, "weight", weight, "0 while rewards.judge.path is '' (no judge); "
              "set rewards.judge.path to a checkpoint to mix its scores in")
        return
    rubric = j.get("rubric", "")
    _need(isinstance(rubric, str) and rubric.strip() != "", "rubric", rubric,
          "a non-empty instruction for the judge")
    try:
        spec = ModelRef(path)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"rewards.judge.path={path!r}: {e}") from None
    if not os.path.exists(spec.path):
        raise ValueError(f"rewards.judge.path={path!r}: no checkpoint there; expected an HF "
                         f"folder, an opd_jax workdir or builtin:NAME")
    cfg = spec.model_config()
    if vocab_size is not None and cfg.vocab_size != vocab_size:
        raise ValueError(f"rewards.judge.path={path!r}: the judge's vocabulary has "
                         f"{cfg.vocab_size} tokens, the run's model {vocab_size}; expected "
                         f"the same tokenizer for both")
    _need(j.max_new_tokens < cfg.max_position_embeddings, "max_new_tokens", j.max_new_tokens,
          f"fewer than the judge's max_position_embeddings={cfg.max_position_embeddings}")
    if tokenizer is not None:
        check_tokenizer(spec, tokenizer, tokenizer_spec, what="rewards.judge.path")


class JudgeReward:
    """A judge model on the rollout engine, scoring episodes with a rubric.

        judge = JudgeReward(model, tokenizer, rubric="...", max_new_tokens=16)
        judge_B, metrics = judge(episodes)        # scores in [0, 1], reward/judge_* metrics

    `JudgeReward.from_config(cfg.rewards.judge, tokenizer)` loads `path` (None when it is "").
    """

    def __init__(self, model, tokenizer, *, rubric: str = DEFAULT_RUBRIC,
                 max_new_tokens: int = 16, include_reference: bool = False,
                 batch_size: int = 64):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: expected an int >= 1")
        self.model, self.tok, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.rm = envs.GenerativeRewardModel(self.generate, rubric=rubric,
                                             batch_size=batch_size,
                                             include_reference=include_reference)
        self.max_pos = getattr(model.config, "max_position_embeddings", None)

    @classmethod
    def from_config(cls, j, tokenizer) -> "JudgeReward | None":
        if not j.get("path", ""):
            return None
        return cls(ModelRef(j.path).load(), tokenizer, rubric=j.rubric,
                   max_new_tokens=j.max_new_tokens, include_reference=j.include_reference,
                   batch_size=j.batch_size)

    def _ids(self, text: str) -> list[int]:
        return prompt_ids(self.tok, text)

    def generate(self, prompts: list[str]) -> list[str]:
        """The judge's greedy verdicts for rendered prompts (the rollout engine, one call)."""
        eos = self.tok.eos_token_id
        res = generate(self.model, [self._ids(p) for p in prompts],
                       max_new_tokens=self.max_new_tokens, temperature=0.0,
                       stop_token_ids=() if eos is None else (eos,), seed=0)
        eos_text = self.tok.eos_token or "\0"
        return [self.tok.decode(t, skip_special_tokens=False).replace(eos_text, "")
                for t in res.tokens]

    def fit(self, task: envs.Task, response: str) -> tuple[str, bool]:
        """(the answer the judge reads, whether it was cut to fit the judge's positions)."""
        answer = parsing.parse_response(response).answer or response
        if self.max_pos is None:
            return answer, False
        room = self.max_pos - self.max_new_tokens - len(self._ids(self.rm.render(task, "")))
        if room < 1:
            raise ValueError(f"judge prompt for task {task.id!r} (rubric, template and task "
                             f"prompt) leaves no room for the response in the judge's "
                             f"max_position_embeddings={self.max_pos} with "
                             f"rewards.judge.max_new_tokens={self.max_new_tokens}; expected "
                             f"a shorter rubric or a judge with more positions")
        ids = encode(self.tok, answer)
        if len(ids) <= room:
            return answer, False
        return self.tok.decode(ids[:room], skip_special_tokens=False), True

    def score(self, tasks: Sequence[envs.Task], responses: Sequence[str]
              ) -> list[envs.RewardResult]:
        """RewardResults of the judge for (task, response) pairs (details: raw_score, or
        error for an unparseable verdict; truncated when the answer was cut)."""
        fitted = [self.fit(t, r) for t, r in zip(tasks, responses)]
        results = self.rm.batch(list(tasks), [a for a, _ in fitted])
        return [envs.RewardResult(r.score, {**r.details, "truncated": cut})
                for r, (_, cut) in zip(results, fitted)]

    def __call__(self, episodes) -> tuple[np.ndarray, dict]:
        """(judge score per episode, metrics) for a rollout's episodes."""
        res = self.score([e.task for e in episodes], [e.text for e in episodes])
        judge_B = np.asarray([r.score for r in res], np.float32)
        return judge_B, {
            "reward/judge_mean": float(judge_B.mean()),
            "reward/judge_error_frac": float(np.mean(["error" in r.details for r in res])),
            "reward/judge_truncated_frac": float(np.mean([r.details["truncated"]
                                                          for r in res]))}
