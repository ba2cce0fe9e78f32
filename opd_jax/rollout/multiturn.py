"""Multi-turn episodes: alternate sampling and environment steps, keeping the KV cache.

    eps = run_episodes(model, tokenizer, tasks, max_turns=6, max_new_tokens=64, seed=0)
    eps.batch.tokens_BxL, eps.batch.response_mask_BxL   # observations have mask 0
    eps.rewards, eps.done, eps.texts

Each round decodes every live row until its turn stops (a stop id such as <eos>, or one of
the environments' stop strings, e.g. "</tool_call>"), hands the turn's text to its
environment (`opd_jax.envs.base.Environment`), tokenizes the observation and appends it
with `engine.extend`: only the observation is forwarded (the history stays in the cache,
never re-prefilled). Observation tokens are present in the packed batch with response
mask 0, so no loss is taken on them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.distributed import fetch
from opd_jax.envs.rewards import step_many
from opd_jax.rollout import engine
from opd_jax.rollout.api import ALL_STEPS, bucket, stop_sequences, think_ids
from opd_jax.rollout.sampling import NO_BUDGET, NO_TOKEN, SamplingParams


@dataclasses.dataclass
class EpisodeBatch:
    """batch: packed RolloutBatch of whole episodes. rewards: last step reward per row;
    turn_rewards: every step's reward; texts: everything after each prompt."""
    batch: engine.RolloutBatch
    rewards: np.ndarray
    turn_rewards: list[list[float]]
    done: np.ndarray
    turns: np.ndarray
    texts: list[str]
    infos: list[dict]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _chunk(rows: list[list[int]], B: int, multiple: int = 64):
    """Right-aligned [B, W] chunk and mask from per-row id lists (W bucketed)."""
    W = bucket(max(1, max(len(r) for r in rows)), multiple)
    tok, mask = np.zeros((B, W), np.int32), np.zeros((B, W), bool)
    for b, r in enumerate(rows):
        if r:
            tok[b, W - len(r):], mask[b, W - len(r):] = r, True
    return tok, mask


def run_episodes(model, tokenizer, tasks: Sequence, *, envs: Sequence | None = None,
                 role: str = "student", max_turns: int = 8, max_new_tokens: int = 64,
                 max_len: int = 1024, temperature=1.0, top_k=0, top_p=1.0,
                 stop_token_ids: Sequence[int] | None = None, think_budget=None,
                 seed: int = 0, row_ids=None) -> EpisodeBatch:
    """Run one episode per task (or per given environment, reset with its task).

    stop_token_ids default to the tokenizer's eos. Stop strings are the union of the
    environments' `stop_strings` (one table for the batch). think_budget: None, an int, or
    one per task (None = none). Episodes not done after `max_turns`, or out of cache
    slots, keep done=False.
    """
    from opd_jax.envs.base import make_env
    B = len(tasks)
    envs = [make_env(t) for t in tasks] if envs is None else list(envs)
    if len(envs) != B:
        raise ValueError(f"{len(envs)} environments for {B} tasks; expected one per task")
    if stop_token_ids is None:
        stop_token_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    strings = sorted({s for e in envs for s in getattr(e, "stop_strings", ())})
    budgets = think_budget if isinstance(think_budget, (list, tuple)) else [think_budget] * B
    has_budget = any(b is not None for b in budgets)
    params = SamplingParams.create(
        B, temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids,
        stop_sequences=stop_sequences(tokenizer, strings),
        think_ids=think_ids(tokenizer) if has_budget else (NO_TOKEN, NO_TOKEN))
    prompts = [_encode(tokenizer, e.reset(t, role)) for e, t in zip(envs, tasks)]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"environment {i} reset to an empty prompt; expected text")
    budget_B = np.array([NO_BUDGET if b is None else b for b in budgets], np.int32)
    if (budget_B < 0).any():
        raise ValueError(f"think_budget={budgets}: expected ints >= 0 or None")
    state = engine.init_state(model, B, max_len, seed, row_ids_B=row_ids,
                              think_budget_B=budget_B, window=params.stop_seqs_QxM.shape[1])
    max_new_B = jnp.full((B,), max_new_tokens, jnp.int32)
    live = np.ones(B, bool)
    done = np.zeros(B, bool)
    rewards, turn_rewards = np.zeros(B), [[] for _ in range(B)]
    texts, infos, turns = [""] * B, [{} for _ in range(B)], np.zeros(B, np.int32)
    rows = prompts
    for _ in range(max_turns):
        tok_BxW, mask_BxW = _chunk(rows, B)
        if int(state.cache.index) + tok_BxW.shape[1] + 1 >= max_len:
            break  # no room for the next observation and a token: episodes stay not done
        state = engine.extend(model, state, jnp.asarray(tok_BxW), jnp.asarray(mask_BxW),
                              start_turn_B=jnp.asarray(live), max_new_B=max_new_B,
                              think_ids_2=params.think_ids_2)
        start = int(state.cache.index)
        state = engine.decode(model, state, params, jnp.asarray(ALL_STEPS, jnp.int32))
        end = int(state.cache.index)
        tok, new = fetch((state.tokens_BxS[:, start + 1:end + 1],
                          state.sampled_BxS[:, start + 1:end + 1]
                          | state.forced_BxS[:, start + 1:end + 1]))
        rows = [[] for _ in range(B)]
        stepped = np.flatnonzero(live)
        decoded = [tokenizer.decode(tok[b][new[b]].tolist(), skip_special_tokens=False)
                   for b in stepped]
        # One call per turn: single-turn rewards scored together (code: parallel sandboxes).
        for b, text, res in zip(stepped, decoded, step_many([envs[b] for b in stepped], decoded)):
            turns[b] += 1
            texts[b] += text + res.observation
            rewards[b], infos[b] = res.reward, dict(res.info)
            turn_rewards[b].append(float(res.reward))
            if res.done:
                live[b], done[b] = False, True
                continue
            rows[b] = _encode(tokenizer, res.observation)
            if not rows[b]:
                raise ValueError(f"environment {b} returned an empty observation for a "
                                 f"continuing episode; expected text to append")
        if not live.any():
            break
    # forward nothing more; pack what exists (pending tokens are already in the buffer)
    return EpisodeBatch(engine.pack(state), rewards, turn_rewards, done, turns, texts, infos)
