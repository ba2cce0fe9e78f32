"""Play tasks with a policy model: the one episode runner of training, evaluation and recipes.

Each task becomes one episode: its rendered prompt (student or teacher role), then turns of
sampled tokens and environment observations until the environment says done or
`max_turns` is reached. The result keeps, per episode, the prompt ids, the response ids
(sampled tokens and observation tokens interleaved), a response mask (1 on sampled tokens,
0 on observations and on tokens the sampler forced, so losses never train on them), the
sampler's log-prob of each sampled token, the reward and the environment's info.

It runs on the rollout engine (`opd_jax.rollout.engine`) with one KV cache for the whole
episode: the prompts are prefilled once, each decode turn samples every live row in one
`while_loop`, and an observation is appended to the cache (only its tokens are forwarded;
the history is never re-prefilled). When the cache's shared slots would run out, the
histories are re-prefilled into a larger cache (exact: positions are per row, and the
token at position p of row r always draws the uniform of (seed, r, p)).

Thinking budgets: with `use_think_budget`, the sampler forces </think> once a think span
reaches the budget of the mode the row's turn obeys (`envs.turn_mode`): the task's effort,
or for a per-turn task (effort think_mixed) its schedule's mode of that turn, so a think_off
turn can open no thinking (budget 0) and a think_on turn gets think_on's budget. The
budgets are set per row at the start of every turn.

With `wal_path`, every `steps_per_call` decode steps the new tokens are appended to a
token write-ahead log (`opd_jax.episodes.wal`), with each row's turn end and each
environment step. A killed job called again with the same arguments replays the log:
finished turns are re-stepped through fresh environments (they are deterministic), the
history and the unfinished turn are teacher-forced into the cache, and sampling goes on
from the next position. No logged token is generated again and the episodes equal an
uninterrupted run's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from opd_jax import envs
from opd_jax import sharding as sh
from opd_jax.distributed import fetch
from opd_jax.episodes import wal
from opd_jax.episodes.episode import Episode, SamplingConfig, encode, prompt_ids
from opd_jax.rollout import engine
from opd_jax.rollout.api import ALL_STEPS, FINISH_NAMES, check_prompts, stop_sequences, think_ids
from opd_jax.rollout.sampling import NO_BUDGET, NO_TOKEN, FinishReason, SamplingParams
from opd_jax.shapes import bucket


def play(model, tokenizer, tasks: Sequence[envs.Task], sampling: SamplingConfig, *,
         seed: int, role: str = "student", mesh=None, wal_path: str | None = None,
         steps_per_call: int = 16, identity: dict | None = None,
         stats: dict | None = None) -> list[Episode]:
    """Run every task to completion; rows of all episodes decode together.

    mesh: shard the rows and KV cache over it (the model must be placed on the same mesh);
    without it the engine runs replicated. wal_path: log tokens every `steps_per_call`
    decode steps and resume from the log if it holds this job's records (`identity`, e.g.
    the training iteration, is part of the job's identity with the tasks and sampling).
    stats: a dict to fill with "resumed_tokens" (tokens restored from the log, not
    generated again) and "cache_reloads" (re-prefills into a larger cache).
    """
    if wal_path is not None and mesh is not None:
        raise ValueError("play(mesh=..., wal_path=...) is not supported: the token log is "
                         "written by one process; pass wal_path=None on a mesh")
    if steps_per_call < 1:
        raise ValueError(f"steps_per_call={steps_per_call}: expected >= 1")
    runner = _Play(model, tokenizer, list(tasks), sampling, seed=seed, role=role, mesh=mesh)
    episodes = runner.run(wal_path, steps_per_call, identity or {})
    if stats is not None:
        stats.update(runner.stats)
    return episodes


class _Play:
    def __init__(self, model, tokenizer, tasks, sampling: SamplingConfig, *, seed, role, mesh):
        if not tasks:
            raise ValueError("play() got no tasks; expected at least one")
        self.model, self.tok, self.sampling, self.seed, self.mesh = (model, tokenizer,
                                                                      sampling, seed, mesh)
        self.tasks, self.role, self.B = tasks, role, len(tasks)
        self.envs = [envs.make_env(t) for t in tasks]
        self.eps = [Episode(t, prompt_ids(tokenizer, e.reset(t, role=role)))
                    for t, e in zip(tasks, self.envs)]
        check_prompts([ep.prompt_ids for ep in self.eps], model.config.vocab_size)
        self.max_pos = getattr(model.config, "max_position_embeddings", None)
        for b, ep in enumerate(self.eps):
            if self.max_pos and len(ep.prompt_ids) + sampling.max_new_tokens > self.max_pos:
                raise ValueError(f"prompt {b} ({len(ep.prompt_ids)} tokens) + max_new_tokens="
                                 f"{sampling.max_new_tokens} exceeds the model's "
                                 f"max_position_embeddings={self.max_pos}; expected at most "
                                 f"{self.max_pos} positions")
        stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
        strings = sorted({s for e in self.envs for s in getattr(e, "stop_strings", ())})
        self.schedules = [envs.turn_modes(t) for t in tasks]   # per-turn tasks' modes
        for t, modes in zip(tasks, self.schedules):
            if modes is not None and len(modes) < sampling.max_turns:
                raise ValueError(f"task {t.id!r}: its thinking schedule meta['turn_modes'] "
                                 f"has {len(modes)} turns but max_turns={sampling.max_turns}; "
                                 f"expected a mode for every turn (at least "
                                 f"{sampling.max_turns})")
        budgets = [self.turn_budget(b, 0) for b in range(self.B)]
        has_budget = any(b is not None for b in budgets)
        self.params = SamplingParams.create(
            self.B, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, stop_token_ids=stop_ids,
            stop_sequences=stop_sequences(tokenizer, strings),
            think_ids=think_ids(tokenizer) if has_budget else (NO_TOKEN, NO_TOKEN))
        self.budget_B = np.array([NO_BUDGET if b is None else b for b in budgets], np.int32)
        self.budget0_B = self.budget_B.copy()    # the first turn's, part of the job identity
        # the turn in progress, per row: tokens, sampler log-probs, forced flags
        self.cur = [[] for _ in range(self.B)]
        self.cur_lp = [[] for _ in range(self.B)]
        self.cur_forced = [[] for _ in range(self.B)]
        self.turn_end = [None] * self.B     # finish reason of the current turn, once known
        self.obs = [[] for _ in range(self.B)]   # observation not yet in the cache
        self.state, self.log = None, None
        self.stats = {"resumed_tokens": 0, "cache_reloads": -1}   # the first load is no reload

    # -- bookkeeping on the host ---------------------------------------------------------
    def turn_budget(self, b: int, turn: int) -> int | None:
        """Row b's think budget in turn `turn`: its mode's (None without use_think_budget)."""
        if not self.sampling.use_think_budget:
            return None
        return envs.turn_mode(self.tasks[b], turn).think_budget

    def set_turn_budgets(self, live, turn: int) -> None:
        """Per-turn tasks: each live row's forced-</think> budget becomes its turn's mode's
        (in the host copy the next cache load uses, and in the live engine state)."""
        if not self.sampling.use_think_budget or all(m is None for m in self.schedules):
            return
        new_B = self.budget_B.copy()
        for b in live:
            new_B[b] = self.turn_budget(b, turn)
        if np.array_equal(new_B, self.budget_B):
            return
        self.budget_B = new_B
        if self.state is not None:
            self.state = self.state.replace(
                think_budget_B=sh.put(new_B, self.state.think_budget_B.sharding))

    def context_len(self, b: int) -> int:
        ep = self.eps[b]
        return len(ep.prompt_ids) + len(ep.response_ids) + len(self.cur[b])

    def room(self, b: int, turn: int) -> int:
        """Tokens row b may sample this turn (turn 0: max_new_tokens, checked up front)."""
        room = self.sampling.max_new_tokens
        if self.max_pos and turn > 0:
            ep = self.eps[b]
            room = min(room, self.max_pos - len(ep.prompt_ids) - len(ep.response_ids))
        return room

    def header(self, identity: dict) -> dict:
        h = hashlib.sha256()
        for ep in self.eps:
            h.update(np.asarray(ep.prompt_ids, np.int64).tobytes() + b"|")
        h.update(self.budget0_B.tobytes())
        if any(m is not None for m in self.schedules):
            h.update(json.dumps(self.schedules).encode())
        h.update(json.dumps([dataclasses.asdict(self.sampling), self.role, int(self.seed),
                             identity], sort_keys=True, default=str).encode())
        return dict(version=2, kind="episodes", batch=self.B, seed=int(self.seed),
                    identity=identity, digest=h.hexdigest())

    # -- engine --------------------------------------------------------------------------
    def load(self, live, turn: int, extra: int) -> None:
        """A fresh cache holding every row's history (+ the turn in progress); rows in
        `live` whose turn has not ended continue it. `extra`: slots to leave for decoding."""
        B = self.B
        hist = [ep.prompt_ids + ep.response_ids for ep in self.eps]
        W = bucket(max(len(h) + len(c) for h, c in zip(hist, self.cur)), 64)
        chunk, mask = np.zeros((B, W), np.int32), np.zeros((B, W), bool)
        resp, forced = np.zeros((B, W), bool), np.zeros((B, W), bool)
        logp = np.zeros((B, W), np.float32)
        for b in range(B):
            row, n = hist[b] + self.cur[b], len(self.cur[b])
            chunk[b, W - len(row):], mask[b, W - len(row):] = row, True
            if n:   # the turn in progress counts toward its max_new_tokens
                resp[b, W - n:], logp[b, W - n:] = True, self.cur_lp[b]
                forced[b, W - n:] = self.cur_forced[b]
        starting = np.array([b in live and self.turn_end[b] is None for b in range(B)])
        room_B = np.array([self.room(b, turn) if starting[b] else 0 for b in range(B)],
                          np.int32)
        S = bucket(W + extra + 1, 128)
        self.stats["cache_reloads"] += 1
        state = engine.init_state(self.model, B, S, self.seed,
                                  think_budget_B=self.budget_B,
                                  window=self.params.stop_seqs_QxM.shape[1])
        if self.mesh is not None:
            state = engine.shard_state(state, self.mesh)
        self.state = engine.extend(self.model, state, jnp.asarray(chunk), jnp.asarray(mask),
                                   start_turn_B=jnp.asarray(starting),
                                   max_new_B=jnp.asarray(room_B), response_BxW=jnp.asarray(resp),
                                   logp_BxW=jnp.asarray(logp), forced_BxW=jnp.asarray(forced),
                                   think_ids_2=self.params.think_ids_2)

    def begin_turn(self, live, turn: int) -> None:
        """Append the pending observations and start the turn of every live row."""
        extra = max(self.room(b, turn) for b in live)
        W = bucket(max(1, max(len(self.obs[b]) for b in live)), 64)
        if self.state is None or int(self.state.cache.index) + W + extra + 1 > self.state.max_len:
            # out of slots (or the first turn): prefill the histories (observations
            # included) into a cache with room for this turn, and for about one more turn
            # when one may follow
            self.obs = [[] for _ in range(self.B)]
            more = extra + W if turn + 1 < self.sampling.max_turns else 0
            self.load(set(live), turn, extra + more)
            return
        B = self.B
        chunk, mask = np.zeros((B, W), np.int32), np.zeros((B, W), bool)
        start, room_B = np.zeros(B, bool), np.zeros(B, np.int32)
        for b in live:
            o = self.obs[b]
            if o:
                chunk[b, W - len(o):], mask[b, W - len(o):] = o, True
            start[b], room_B[b] = True, self.room(b, turn)
        self.obs = [[] for _ in range(B)]
        self.state = engine.extend(self.model, self.state, jnp.asarray(chunk),
                                   jnp.asarray(mask), start_turn_B=jnp.asarray(start),
                                   max_new_B=jnp.asarray(room_B),
                                   think_ids_2=self.params.think_ids_2)

    def decode(self, live: list[int], steps_per_call: int) -> None:
        """Decode until every row's turn ends; collect the new tokens (and log them)."""
        steps = steps_per_call if self.log is not None else ALL_STEPS
        while True:
            before = int(self.state.cache.index)
            self.state = engine.decode(self.model, self.state, self.params,
                                       jnp.asarray(steps, jnp.int32))
            after = int(self.state.cache.index)
            s = self.state
            tok, smp, frc, lp, finish, active = fetch((
                s.tokens_BxS, s.sampled_BxS, s.forced_BxS, s.logp_BxS, s.finish_B,
                s.active_B))
            for b in range(self.B):
                new = np.flatnonzero(smp[b, before + 1:after + 1] | frc[b, before + 1:after + 1])
                for j in new + before + 1:
                    if self.log is not None:
                        self.log.append_token(b, self.context_len(b), int(tok[b, j]),
                                              float(lp[b, j]), bool(frc[b, j]))
                    self.cur[b].append(int(tok[b, j]))
                    self.cur_lp[b].append(float(lp[b, j]) if smp[b, j] else 0.0)
                    self.cur_forced[b].append(bool(frc[b, j]))
            ended = [b for b in live if not active[b] and self.turn_end[b] is None
                     and finish[b] != FinishReason.RUNNING]
            for b in ended:
                self.turn_end[b] = FINISH_NAMES[int(finish[b])]
                if self.log is not None:
                    self.log.append_finish(b, int(finish[b]))
            if self.log is not None:
                self.log.commit()
            if not active.any() or after + 1 >= s.max_len:
                return

    def finish_turn(self, rows: list[int], turn: int) -> None:
        """Step the environments of `rows` on their turn's text; update the episodes."""
        eos = self.tok.eos_token or "\0"
        texts = [self.tok.decode(self.cur[b], skip_special_tokens=False).replace(eos, "")
                 for b in rows]
        # One call per turn: single-turn rewards are scored together (code: parallel sandboxes).
        steps = envs.step_many([self.envs[b] for b in rows], texts)
        for b, text, step in zip(rows, texts, steps):
            ep = self.eps[b]
            ep.response_ids += self.cur[b]
            # Tokens the sampler forced (</think> at the budget) were not sampled: no loss.
            ep.response_mask += [0 if f else 1 for f in self.cur_forced[b]]
            ep.sampler_logp += self.cur_lp[b]
            ep.finish = self.turn_end[b] or "budget"
            ep.text += text
            ep.turns += 1
            ep.reward, ep.info = float(step.reward), dict(step.info)
            self.cur[b], self.cur_lp[b], self.cur_forced[b] = [], [], []
            self.turn_end[b] = None
            if self.log is not None:
                self.log.append_turn(b, turn)
            if step.done or turn == self.sampling.max_turns - 1:
                ep.done = True
            elif step.observation:
                obs = encode(self.tok, step.observation)
                if self.max_pos and self.context_len(b) + len(obs) >= self.max_pos:
                    ep.done, ep.finish = True, "context_full"   # no room for the next turn
                    continue
                ep.response_ids += obs
                ep.response_mask += [0] * len(obs)
                ep.sampler_logp += [0.0] * len(obs)
                self.obs[b] = obs
        if self.log is not None:
            self.log.commit()

    def live_rows(self, turn: int) -> list[int]:
        """Rows that take this turn; a row with no room left ends ("context_full")."""
        live = []
        for b, ep in enumerate(self.eps):
            if ep.done:
                continue
            if self.room(b, turn) < 1:
                ep.done, ep.finish = True, "context_full"
                continue
            live.append(b)
        return live

    # -- the loop ------------------------------------------------------------------------
    def run(self, wal_path, steps_per_call: int, identity: dict) -> list[Episode]:
        first, header, truncate_at = 0, self.header(identity), None
        if wal_path is not None:
            if os.path.exists(wal_path) and os.path.getsize(wal_path) > 0:
                old, records, truncate_at = wal.read_log(wal_path)
                if old is not None and old != header:
                    raise ValueError(f"token log {wal_path} belongs to another job "
                                     f"({old}); expected {header}")
                if old is None:
                    truncate_at = 0
                first = self.replay(records, wal_path)
            self.log = wal.TokenLog(wal_path, header, truncate_at=truncate_at)
        try:
            for turn in range(first, self.sampling.max_turns):
                live = self.live_rows(turn)
                if not live:
                    break
                self.set_turn_budgets(live, turn)
                if self.state is None and any(self.cur[b] or self.turn_end[b] for b in live):
                    # resumed inside this turn: history and logged tokens into the cache
                    self.load(set(live), turn, max(0, max(self.room(b, turn) - len(self.cur[b])
                                                          for b in live)))
                else:
                    self.begin_turn(live, turn)
                if any(self.turn_end[b] is None for b in live):
                    self.decode(live, steps_per_call)
                self.finish_turn(live, turn)
        finally:
            if self.log is not None:
                self.log.close()
        return self.eps

    def replay(self, records: list[tuple], path) -> int:
        """Re-apply a log's committed records; the turn to continue from."""
        turn, stepped = 0, []
        for kind, row, *rest in records:
            if not 0 <= row < self.B:
                raise ValueError(f"token log {path}: row {row} outside the batch of {self.B}")
            if kind != wal.TURN and stepped:   # the next turn's records: step the last one
                self.finish_turn_replayed(stepped, turn)
                stepped, turn = [], turn + 1
            if kind == wal.TOKEN:
                pos, token, lp, forced = rest
                if pos != self.context_len(row):
                    raise ValueError(f"token log {path}: row {row} has a token at position "
                                     f"{pos}, expected {self.context_len(row)} (a log of "
                                     f"other environments or another job)")
                self.cur[row].append(token)
                self.stats["resumed_tokens"] += 1
                self.cur_lp[row].append(0.0 if forced else lp)
                self.cur_forced[row].append(bool(forced))
            elif kind == wal.FINISH:
                self.turn_end[row] = FINISH_NAMES[rest[0]]
            elif kind == wal.TURN:
                if rest[0] != turn:   # all rows of a turn step together, in one commit
                    raise ValueError(f"token log {path}: row {row} stepped turn {rest[0]} "
                                     f"while turn {turn} is being replayed")
                stepped.append(row)
        if stepped:
            self.finish_turn_replayed(stepped, turn)
            turn += 1
        return turn

    def finish_turn_replayed(self, rows: list[int], turn: int) -> None:
        expected = self.live_rows(turn)
        if sorted(rows) != expected:
            raise ValueError(f"token log: turn {turn} stepped rows {sorted(rows)}, expected "
                             f"the live rows {expected}")
        self.finish_turn(rows, turn)
