"""Play tasks with a policy model: batched sampling turns and environment steps.

Each task becomes one episode: its rendered prompt (student or teacher role), then turns of
sampled tokens and environment observations until the environment says done or
`max_turns` is reached. The result keeps, per episode, the prompt ids, the response ids
(sampled tokens and observation tokens interleaved), a response mask (1 on sampled tokens,
0 on observations and on tokens the sampler forced, so losses never train on them), the sampler's log-prob of
each sampled token, the reward and the environment's info.

Each turn re-prefills the episode's context (simple and exact); the rollout engine's
`opd_jax.rollout.multiturn` keeps the KV cache across turns and is the faster path.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from opd_jax import envs


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
    return list(tokenizer.encode(text, add_special_tokens=False))


def play(model, tokenizer, tasks: Sequence[envs.Task], sampling: SamplingConfig, *,
         seed: int, role: str = "student", mesh=None) -> list[Episode]:
    """Run every task to completion; sampling is batched across the episodes of a turn.

    mesh: shard the rows and KV cache of each turn's sampling over it (`generate(mesh=)`;
    the model must be placed on the same mesh). Without it the sampler runs replicated.
    """
    from opd_jax.rollout import generate
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    environments = [envs.make_env(t) for t in tasks]
    episodes = [Episode(t, bos + encode(tokenizer, e.reset(t, role=role)))
                for t, e in zip(tasks, environments)]
    stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    stop_strings = sorted({s for e in environments for s in getattr(e, "stop_strings", ())})
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    for turn in range(sampling.max_turns):
        # After the first turn a long multi-turn context may outgrow the model's positions:
        # each turn samples at most the room left, and an episode with no room ends there
        # (finish "context_full"; its reward is the last step's), as does one whose next
        # observation would leave no room to answer. The first turn's prompt
        # must fit with max_new_tokens (generate raises, naming it).
        new_tokens = {}
        for i, ep in enumerate(episodes):
            if ep.done:
                continue
            room = sampling.max_new_tokens
            if max_pos and turn > 0:
                room = min(room, max_pos - len(ep.prompt_ids) - len(ep.response_ids))
                if room < 1:
                    ep.done, ep.finish = True, "context_full"
                    continue
            new_tokens[i] = room
        live = list(new_tokens)
        if not live:
            break
        budgets = [envs.effort_spec(episodes[i].task).think_budget
                   if sampling.use_think_budget else None for i in live]
        res = generate(model, [episodes[i].prompt_ids + episodes[i].response_ids for i in live],
                       max_new_tokens=[new_tokens[i] for i in live],
                       temperature=sampling.temperature, top_k=sampling.top_k,
                       top_p=sampling.top_p, stop_token_ids=stop_ids,
                       stop_strings=stop_strings, tokenizer=tokenizer, think_budget=budgets,
                       seed=seed * 1000 + turn, row_ids=np.asarray(live, np.int32), mesh=mesh)
        forced = _forced_flags(res)
        texts = [tokenizer.decode(toks, skip_special_tokens=False).replace(
                 tokenizer.eos_token or "\0", "") for toks in res.tokens]
        # One call per turn: single-turn rewards are scored together (code: parallel sandboxes).
        steps = envs.step_many([environments[i] for i in live], texts)
        for j, (i, step) in enumerate(zip(live, steps)):
            ep = episodes[i]
            toks, lps = res.tokens[j], res.logprobs[j]
            ep.response_ids += toks
            # Tokens the sampler forced (</think> at the budget) were not sampled: no loss.
            ep.response_mask += [0 if f else 1 for f in forced[j]]
            ep.sampler_logp += [float(x) for x in lps]
            ep.finish = res.finish_reasons[j]
            ep.text += texts[j]
            ep.turns += 1
            ep.reward, ep.info = float(step.reward), dict(step.info)
            if step.done or turn == sampling.max_turns - 1:
                ep.done = True
            elif step.observation:
                obs = encode(tokenizer, step.observation)
                if max_pos and len(ep.prompt_ids) + len(ep.response_ids) + len(obs) >= max_pos:
                    ep.done, ep.finish = True, "context_full"   # no room for the next turn
                    continue
                ep.response_ids += obs
                ep.response_mask += [0] * len(obs)
                ep.sampler_logp += [0.0] * len(obs)
    return episodes


def _forced_flags(res) -> list[list[bool]]:
    """Per returned token, whether the sampler forced it (aligned with `res.tokens`)."""
    from opd_jax.distributed import fetch      # rows may live on several processes (mesh=)
    forced, lens = fetch((res.batch.forced_mask_BxL, res.batch.lengths_B))
    return [forced[b, lens[b] - len(t):lens[b]].astype(bool).tolist()
            for b, t in enumerate(res.tokens)]


def cell_of(task: envs.Task) -> str:
    return f"{task.domain}/{task.effort}"
