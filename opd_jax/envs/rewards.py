"""Reward functions beyond the verifiers: rule-based (format, length), a generative judge,
and weighted composition. Every reward is `(task, response) -> RewardResult`; ones with a
`batch(tasks, responses)` method are scored in one call by `score_batch`.

    judge = GenerativeRewardModel(generate_fn, rubric="Is the answer polite?")
    reward = CompositeReward({"task": score, "format": format_reward, "judge": judge},
                             weights={"task": 1.0, "format": 0.1, "judge": 0.5})
    reward(task, "<think>..</think>42").score        # 1.0*task + 0.1*format + 0.5*judge
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Sequence

from opd_jax.envs import parsing
from opd_jax.envs.base import (RewardFn, RewardResult, SingleTurnEnv, StepResult, Task,
                               get_family, score)

# Special tokens that never belong in a final answer.
_ANSWER_FORBIDDEN = tuple(t for t in parsing.SPECIAL_TOKENS if t not in ("<eos>", "<pad>"))


def format_reward(task: Task, response: str) -> RewardResult:
    """1.0 when the response is "[<think>...</think>]ANSWER" with a non-empty, clean answer.

    Fails (0.0, with the reason) on: unbalanced/nested think, text before the think span,
    an empty answer, or special tokens inside the answer.
    """
    p = parsing.parse_response(response)
    if p.error:
        return RewardResult(0.0, {"format_error": p.error})
    if p.stray_text or p.n_think_blocks > 1:
        return RewardResult(0.0, {"format_error": "text outside a single leading think"})
    if not p.answer:
        return RewardResult(0.0, {"format_error": "empty answer"})
    bad = [t for t in _ANSWER_FORBIDDEN if t in p.answer]
    if bad:
        return RewardResult(0.0, {"format_error": f"special tokens in answer: {bad}"})
    return RewardResult(1.0, {})


@dataclasses.dataclass(frozen=True)
class LengthReward:
    """1 up to `free_tokens` response tokens, then linearly down to 0 at `max_tokens`.

    length_reward = LengthReward(free_tokens=64, max_tokens=256)
    """
    free_tokens: int = 64
    max_tokens: int = 256
    count_fn: Callable[[str], int] = parsing.count_tokens

    def __post_init__(self):
        if not 0 <= self.free_tokens < self.max_tokens:
            raise ValueError(f"LengthReward: need 0 <= free_tokens ({self.free_tokens}) < "
                             f"max_tokens ({self.max_tokens})")

    def __call__(self, task: Task, response: str) -> RewardResult:
        n = self.count_fn(response)
        over = max(0, n - self.free_tokens) / (self.max_tokens - self.free_tokens)
        return RewardResult(max(0.0, 1.0 - over), {"tokens": n})


DEFAULT_RUBRIC = "Score 10 if the response answers the task correctly and concisely, 0 if not."
DEFAULT_TEMPLATE = ("<|user|>Rubric: {rubric}\nTask: {prompt}\n{reference}Response: {response}\n"
                    "Reply with Score: N (0-{max_score}).<|assistant|>")
_SCORE_RE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


@dataclasses.dataclass
class GenerativeRewardModel:
    """A judge policy prompted with a rubric; works with any `generate_fn(prompts)->texts`.

    Score = (number after "Score:", else the last number in the judge's text) / max_score,
    clipped to [0, 1]; unparseable judgements get `fallback_score` and details["error"].
    The judge's thinking (<think>...</think>) is dropped before parsing. Calls are batched
    `batch_size` prompts at a time.
    """
    generate_fn: Callable[[list[str]], list[str]]
    rubric: str = DEFAULT_RUBRIC
    template: str = DEFAULT_TEMPLATE
    max_score: float = 10.0
    batch_size: int = 32
    include_reference: bool = False
    fallback_score: float = 0.0

    def __post_init__(self):
        if self.max_score <= 0 or self.batch_size <= 0:
            raise ValueError(f"GenerativeRewardModel: max_score={self.max_score} and "
                             f"batch_size={self.batch_size} must be > 0")

    def render(self, task: Task, response: str) -> str:
        ref = (f"Reference: {task.reference.get('answer', '')}\n"
               if self.include_reference else "")
        response = parsing.parse_response(response).answer or response
        return self.template.format(rubric=self.rubric, prompt=task.prompt, reference=ref,
                                    response=response, max_score=int(self.max_score))

    def parse(self, judgement: str) -> RewardResult:
        text = re.sub(r"<think>.*?(</think>|$)", "", judgement, flags=re.DOTALL)
        m = _SCORE_RE.search(text)
        nums = [m.group(1)] if m else _NUM_RE.findall(text)
        if not nums:
            return RewardResult(self.fallback_score, {"error": "no score in judgement",
                                                      "judgement": judgement[:200]})
        raw = float(nums[-1])
        return RewardResult(min(1.0, max(0.0, raw / self.max_score)), {"raw_score": raw})

    def batch(self, tasks: Sequence[Task], responses: Sequence[str]) -> list[RewardResult]:
        if len(tasks) != len(responses):
            raise ValueError(f"len(tasks)={len(tasks)} != len(responses)={len(responses)}")
        prompts = [self.render(t, r) for t, r in zip(tasks, responses)]
        out: list[RewardResult] = []
        for i in range(0, len(prompts), self.batch_size):
            chunk = prompts[i:i + self.batch_size]
            texts = list(self.generate_fn(chunk))
            if len(texts) != len(chunk):
                raise ValueError(f"generate_fn returned {len(texts)} texts for "
                                 f"{len(chunk)} prompts")
            out.extend(self.parse(t) for t in texts)
        return out

    def __call__(self, task: Task, response: str) -> RewardResult:
        return self.batch([task], [response])[0]


def score_batch(reward: RewardFn, tasks: Sequence[Task], responses: Sequence[str]
                ) -> list[RewardResult]:
    """Score many responses: uses `reward.batch` when present, else calls it per item."""
    if len(tasks) != len(responses):
        raise ValueError(f"len(tasks)={len(tasks)} != len(responses)={len(responses)}")
    if hasattr(reward, "batch"):
        return list(reward.batch(list(tasks), list(responses)))
    return [reward(t, r) for t, r in zip(tasks, responses)]


class TaskReward:
    """Each task's own family verifier (effort-adjusted); batches per family."""

    def __call__(self, task: Task, response: str) -> RewardResult:
        return score(task, response)

    def batch(self, tasks: Sequence[Task], responses: Sequence[str]) -> list[RewardResult]:
        out: list[RewardResult | None] = [None] * len(tasks)
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(tasks):
            groups.setdefault(t.family, []).append(i)
        for fam_name, idx in groups.items():
            fam = get_family(fam_name)
            ts, rs = [tasks[i] for i in idx], [responses[i] for i in idx]
            res = (fam.reward_batch(ts, rs) if fam.reward_batch
                   else [fam.reward(t, r) for t, r in zip(ts, rs)])
            for i, r in zip(idx, res):
                out[i] = r
        return out


task_reward = TaskReward()


def step_many(environments: Sequence, texts: Sequence[str]) -> list[StepResult]:
    """``env.step(text)`` for each pair, the same results, with single-turn episodes scored
    together per family (``TaskReward.batch``: code runs its sandboxes in parallel instead
    of one program at a time). Multi-turn environments step one by one."""
    if len(environments) != len(texts):
        raise ValueError(f"{len(environments)} environments but {len(texts)} texts")
    out: list[StepResult | None] = [None] * len(texts)
    single = [i for i, e in enumerate(environments)
              if type(e) is SingleTurnEnv and e.task is not None]
    if single:
        res = task_reward.batch([environments[i].task for i in single],
                                [texts[i] for i in single])
        for i, r in zip(single, res):
            out[i] = environments[i].finish(r)
    for i, e in enumerate(environments):
        if out[i] is None:
            out[i] = e.step(texts[i])
    return out


class CompositeReward:
    """score = sum_k w_k * score_k (divided by sum_k w_k when normalize=True).

    details["components"][k] holds each part's score and details.
    """

    def __init__(self, rewards: Mapping[str, RewardFn], weights: Mapping[str, float] | None =
                 None, normalize: bool = False):
        weights = dict(weights or {k: 1.0 for k in rewards})
        if set(weights) != set(rewards):
            raise ValueError(f"weights keys {sorted(weights)} != reward keys "
                             f"{sorted(rewards)}")
        total = sum(weights.values())
        if normalize and total == 0:
            raise ValueError("CompositeReward(normalize=True): weights sum to 0")
        self.rewards, self.weights = dict(rewards), weights
        self.norm = total if normalize else 1.0

    def batch(self, tasks: Sequence[Task], responses: Sequence[str]) -> list[RewardResult]:
        parts = {k: score_batch(fn, tasks, responses) for k, fn in self.rewards.items()}
        out = []
        for i in range(len(tasks)):
            s = sum(self.weights[k] * parts[k][i].score for k in parts) / self.norm
            comps = {k: {"score": parts[k][i].score, **parts[k][i].details} for k in parts}
            out.append(RewardResult(float(s), {"components": comps}))
        return out

    def __call__(self, task: Task, response: str) -> RewardResult:
        return self.batch([task], [response])[0]
