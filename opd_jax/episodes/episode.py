"""An episode's record and how a task's prompt becomes token ids (the one BOS rule).

The rollout (student prompts), teacher scoring (teacher prompts) and the judge all build
their prompts through `prompt_ids`, which starts them by the one BOS rule
(`models.bos_ids`, which SFT data follows too), so the student and its teachers see the
same framing.
"""
from __future__ import annotations

import dataclasses

from opd_jax import envs
from opd_jax.models import bos_ids


@dataclasses.dataclass
class Episode:
    task: envs.Task
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    response_mask: list[int] = dataclasses.field(default_factory=list)
    sampler_logp: list[float] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)
    done: bool = False
    turns: int = 0
    finish: str = ""
    text: str = ""

    @property
    def sampled_tokens(self) -> int:
        return int(sum(self.response_mask))


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_turns: int = 4
    use_think_budget: bool = True    # force </think> at the effort's thinking budget


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, without special tokens (observations, answers, stop strings)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A rendered prompt's ids: the tokenizer's BOS token (when it has one), then `text`."""
    return bos_ids(tokenizer) + encode(tokenizer, text)
