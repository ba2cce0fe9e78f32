"""Text-level episodes and the effort x difficulty table, for any policy.

A policy is `policy(contexts: list[str], stop_strings: list[tuple[str, ...]]) -> list[str]`:
each context is everything so far (rendered prompt, earlier turns, observations) and the
policy returns the next assistant turn for each. The rollout engine drives token-level
generation itself; this reference loop is what evaluations and tests use on top of any
generator.

    rows = effort_table(policy, {"general": "arithmetic"}, difficulties=(1, 5), n=64)
    print(format_table(rows))
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from opd_jax.envs.base import Task, make_env
from opd_jax.envs.data import TaskSource
from opd_jax.envs.rewards import step_many

Policy = Callable[[list[str], list[tuple]], list[str]]


@dataclasses.dataclass
class Episode:
    task: Task
    prompt: str
    transcript: str = ""  # everything after the prompt: turns and observations
    reward: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)
    turns: int = 0
    done: bool = False


def run_episodes(tasks: Sequence[Task], policy: Policy, *, role: str = "student",
                 max_turns: int = 16) -> list[Episode]:
    """Step every task's environment in lockstep, one batched policy call per round."""
    envs = [make_env(t) for t in tasks]
    eps = [Episode(t, e.reset(t, role)) for t, e in zip(tasks, envs)]
    for _ in range(max_turns):
        live = [i for i, ep in enumerate(eps) if not ep.done]
        if not live:
            break
        texts = policy([eps[i].prompt + eps[i].transcript for i in live],
                       [envs[i].stop_strings for i in live])
        if len(texts) != len(live):
            raise ValueError(f"policy returned {len(texts)} texts for {len(live)} contexts")
        for i, text, res in zip(live, texts, step_many([envs[i] for i in live], texts)):
            ep = eps[i]
            ep.transcript += text + res.observation
            ep.turns += 1
            ep.reward, ep.info, ep.done = res.reward, res.info, res.done
    for ep in eps:
        if not ep.done:
            ep.reward, ep.info = 0.0, {"error": f"not done after {max_turns} turns"}
    return eps


def effort_table(policy: Policy, families: dict[str, str], *,
                 efforts: Sequence[str] = ("low", "high", "max"),
                 difficulties: Sequence[int] = (1, 3, 5), n: int = 32, seed: int = 0
                 ) -> list[dict]:
    """Mean reward and accuracy per (domain, difficulty, effort) on n eval-split tasks each.

    The same n tasks are used for every effort of a (domain, difficulty), so columns
    differ only by effort.
    """
    rows = []
    for domain, fam in families.items():
        for d in difficulties:
            for e in efforts:
                tasks = list(TaskSource(fam, size=n, seed=seed, difficulty=d, effort=e,
                                        split="eval"))
                eps = run_episodes(tasks, policy)
                acc = sum(ep.info.get("correct", 0.0) for ep in eps) / n
                rows.append({"domain": domain, "family": fam, "difficulty": d, "effort": e,
                             "reward": sum(ep.reward for ep in eps) / n, "accuracy": acc})
    return rows


def format_table(rows: list[dict], metric: str = "accuracy") -> str:
    """Markdown table: one row per (domain, difficulty), one column per effort."""
    efforts = list(dict.fromkeys(r["effort"] for r in rows))
    keys = list(dict.fromkeys((r["domain"], r["difficulty"]) for r in rows))
    cell = {(r["domain"], r["difficulty"], r["effort"]): r[metric] for r in rows}
    lines = [f"| domain | difficulty | {' | '.join(efforts)} |",
             "|---|---|" + "---|" * len(efforts)]
    for dom, d in keys:
        vals = " | ".join(f"{cell.get((dom, d, e), float('nan')):.3f}" for e in efforts)
        lines.append(f"| {dom} | {d} | {vals} |")
    return "\n".join(lines)
