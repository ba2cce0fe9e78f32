"""The phases of a policy iteration (`run_policy.train_policy`), each built from its own
config section: rollout (`rollout`), judge (`rewards.judge`), batch (`rl`, `rollout`),
teachers (`teachers`), old log-probs, update (`rl`) and the held-out evaluation
(`trainers.evaluate.HeldOut`, `eval`)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import warnings
from collections import defaultdict

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from opd_jax import losses
from opd_jax.distributed import settle
from opd_jax.envs import cell_of
from opd_jax.episodes import SamplingConfig, build_sequences, play
from opd_jax.episodes.sequences import ROW_MULTIPLE
from opd_jax.models import build_tokenizer
from opd_jax.shapes import bucket
from opd_jax.teachers import (TeacherBank, TeacherScorer, TeacherScores, check_routing,
                              in_row_chunks, teacher_fields)
from opd_jax.teachers.scoring import MODEL_INPUTS, to_host, zeros_like
from opd_jax.trainers import builders
from opd_jax.trainers.judge import JudgeReward, mix_judge
from opd_jax.trainers.needs import PolicyBatch
from opd_jax.trainers.objectives import PER_TEACHER
from opd_jax.trainers.policy import batch_logprobs, policy_step
from opd_jax.trainers.rollout_log import RolloutLog


def task_dataset(t: ml_collections.ConfigDict, batch: int) -> grain.IterDataset:
    """Batches of `batch` train-split tasks, shuffled and repeated (checkpointable).

    Repeated a finite number of epochs that no run reaches (grain's endless repeat has
    length sys.maxsize, and batching it by 1 overflowed: prompts_per_step=1 crashed)."""
    src = builders.train_source(t)
    epochs = max(1, (sys.maxsize // 4) // max(1, len(src)))
    return grain.MapDataset.source(src).shuffle(seed=t.seed).repeat(epochs).batch(
        batch, batch_fn=list).to_iter_dataset()


class Timer:
    """Wall seconds per phase: ``with timer("rollout"): ...`` adds metric time/rollout."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str, record: bool = True):
        """Time the block as `phase` (`record` False: a phase this run does not have)."""
        t0 = time.perf_counter()
        yield
        if record:
            self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + (
                time.perf_counter() - t0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def block(tree):
    """Wait for the device work behind `tree` (so a phase's time is its own)."""
    jax.block_until_ready([x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)])
    return tree


class Rollout:
    """The rollout phase (`rollout` section): `group_size` episodes for each task with the
    current student, its tokens logged (`rollout.wal_every`) so a killed run resumes it."""

    def __init__(self, r: ml_collections.ConfigDict, tokenizer, mesh, *, seed: int,
                 workdir: str, start: int, reset: bool):
        self.group_size, self.tokenizer, self.seed = r.group_size, tokenizer, seed
        self.sampling = SamplingConfig(**dict(r.sampling))
        self.multi = jax.process_count() > 1     # rollout rows split over processes
        self.mesh = mesh if self.multi else None
        self.log = RolloutLog(workdir, r.get("wal_every", 0), start=start,
                              enabled=not self.multi, reset=reset)

    def __call__(self, student, tasks, it: int, step: int) -> tuple[list, dict]:
        episodes = play(student, self.tokenizer, [t for t in tasks for _ in range(
            self.group_size)], self.sampling, seed=self.seed * 100_003 + it, mesh=self.mesh,
            **self.log.kwargs(it, step))
        return episodes, {f"rollout/{k}": float(v) for k, v in self.log.stats.items()}


class Judge:
    """The judge phase (`rewards.judge`): a generative reward model's score per episode, or
    nothing when the run has none."""

    def __init__(self, cfg: ml_collections.ConfigDict, tokenizer):
        self.judge = (JudgeReward.from_config(cfg.rewards.judge, tokenizer)
                      if "rewards" in cfg else None)
        self.enabled = self.judge is not None

    def __call__(self, episodes) -> tuple[np.ndarray | None, dict]:
        return (None, {}) if self.judge is None else self.judge(episodes)


def _check_top_k(scoring: dict, vocab: int, whose: str, note: str = "") -> None:
    """ValueError when the objective's top_k exceeds `vocab` (`whose`: which vocabulary)."""
    if scoring.get("top_k", 0) > vocab:
        raise ValueError(f"objective option top_k={scoring['top_k']}: expected at most "
                         f"{whose} {vocab}{note}")


class Teachers:
    """The OPD side of a run (`teachers` section), from the objective's Needs: the bank, the
    per-cell weights (checked against the bank before any work) and the scorer. `enabled` is
    False for objectives without a teacher (then nothing is loaded or scored)."""

    def __init__(self, t: ml_collections.ConfigDict, needs, cells, setup, tokenizer_spec: str,
                 chunk_rows: int, max_new_tokens: int | None = None, scoring: dict | None = None):
        self.needs, self.enabled = needs, needs.teacher != "none"
        self.bank, self.cell_weights, self.scorer, self.configs = None, {}, None, {}
        if not self.enabled:
            return
        scoring = dict(scoring or {})
        _check_top_k(scoring, setup.model_config.vocab_size, "the vocabulary size")
        self.bank = TeacherBank(dict(t.paths), max_loaded=t.max_loaded or None,
                                mesh=setup.mesh, rules=setup.rules)
        self.cell_weights = check_routing([(d, e) for d, _, e in cells], self.bank.keys(),
                                          t.routing, table=dict(t.table),
                                          weights=t.weights.to_dict(),
                                          single_teacher=not needs.mixture)
        # Confidence weighting: per token, from each teacher's entropy at the objective's
        # temperature (the scorer returns the entropies with the hidden states).
        self.confidence = (float(t.confidence_temperature)
                           if t.get("weighting", "static") == "confidence" else None)
        # Teachers with their own tokenizer (`teachers.tokenizers`: key -> tokenizer spec).
        own = {k: (build_tokenizer(str(v)), str(v))
               for k, v in dict(t.get("tokenizers", {})).items()}
        unknown = sorted(set(own) - set(self.bank.keys()))
        if unknown:
            raise KeyError(f"teachers.tokenizers names {unknown}, not in teachers.paths "
                           f"({sorted(self.bank.keys())})")
        self.configs = self.bank.validate(setup.model_config.vocab_size, setup.tokenizer,
                                          tokenizer_spec, own_tokenizers=own)
        for key in own:     # a teacher with its own tokenizer: top-k within ITS vocabulary
            _check_top_k(scoring, self.configs[key].vocab_size,
                         f"teacher {key!r}'s vocabulary size", " (its own tokenizer, "
                         "teachers.tokenizers)")
        # served teachers: checked by their probe
        for key, tc in self.configs.items():    # the student's own check, for each teacher
            if max_new_tokens is not None and max_new_tokens >= tc.max_position_embeddings:
                raise ValueError(f"rollout.sampling.max_new_tokens={max_new_tokens}: expected "
                                 f"fewer than teacher {key!r}'s max_position_embeddings="
                                 f"{tc.max_position_embeddings} (it scores every sampled "
                                 f"token)")
        used = sorted({k for w in self.cell_weights.values() for k, v in w.items() if v > 0})
        self.bank.open_all(used)  # a corrupt teacher fails now, before any rollout
        # One slot per teacher the routing uses, every iteration: the batch's teacher
        # fields keep their shapes, so the train step compiles once whatever the mix.
        self.slots, self._unembeddings = used, {}
        if self.confidence is not None:
            scoring["entropy"] = True
        served_opts = t.served.to_dict() if "served" in t else {}
        self.scorer = TeacherScorer(self.bank, setup.tokenizer, needs.teacher,
                                    role=t.prompt_role, chunk_rows=chunk_rows,
                                    served=served_opts,
                                    tokenizers={k: tok for k, (tok, _) in own.items()},
                                    **scoring)
        self.served_params = dict(served_opts.get("params", {}))
        for key in used:            # served teachers: probed now, before any rollout
            if self.bank.is_served(key):
                self.scorer.served(key)

    def score(self, episodes, seqs) -> tuple[TeacherScores, dict]:
        """(the iteration's teacher scores, metrics); empty scores without a teacher."""
        if not self.enabled:
            return TeacherScores([], {}), {}
        weights = [self.cell_weights[cell_of(e.task)] for e in episodes]
        for key, rows in self.scored_rows(episodes).items():
            # (a teacher with its own tokenizer: its rows are counted in its tokens, and
            # its scorer masks what does not fit its context)
            if key in self.configs and key not in self.scorer.tokenizers:
                builders.check_positions(max(rows), self.configs[key],
                                         f"episodes scored by teacher {key!r}")
        scored = self.scorer(episodes, weights, seqs)
        scores = teacher_fields(scored, weights, self.needs.teacher, slots=self.slots,
                                absent=self._absent(scored), confidence=self.confidence)
        metrics = {"teachers_loaded": float(len(self.bank.loaded()))}
        if self.scorer.invalid:
            # Response tokens a served or cross-tokenizer teacher gave no value for: masked
            # out of the loss (`teacher_valid` multiplies the batch mask).
            invalid = sum(to_host(v) for v in self.scorer.invalid.values())
            scores.fields["teacher_valid"] = (invalid == 0).astype(np.int32)
            m = np.asarray(seqs["mask"]) > 0
            metrics["teachers/missing_frac"] = float((invalid > 0)[m].mean()) if m.any() else 0.0
        cross = self.scorer.cross_stats
        if cross["tokens"]:     # teachers with another tokenizer: the exactly scored share
            metrics["teachers/cross_exact_frac"] = cross["exact"] / cross["tokens"]
        block(scores.fields)
        return scores, metrics

    def scored_rows(self, episodes) -> dict[str, list[int]]:
        """{teacher key: the tokens (prompt + response) of each row it scores}."""
        out: dict[str, list[int]] = {}
        if not self.enabled:
            return out
        for e in episodes:
            for key, w in self.cell_weights[cell_of(e.task)].items():
                if w > 0:
                    out.setdefault(key, []).append(len(e.prompt_ids) + len(e.response_ids))
        return out

    def params(self) -> dict[str, int]:
        """{teacher key: its parameter count} of the teachers the routing uses."""
        if not self.enabled:
            return {}
        # A served teacher's size is not known here: `teachers.served.params[key]`, or 0
        # (its FLOPs are then not counted).
        return {key: self.configs[key].num_params() if key in self.configs
                else int(self.served_params.get(key, 0)) for key in self.slots}

    def _absent(self, scored: dict) -> dict:
        """For the hidden-state signal: (hidden zeros, unembedding) of each slot whose
        teacher scored no row this iteration (its unembedding kept from its last scoring,
        or read from the bank once)."""
        if self.needs.teacher != "hidden":
            return {}
        for key, (_, _, w) in scored.items():
            self._unembeddings[key] = w
        first = next(iter(scored.values()))[1]     # every row is routed to some teacher
        first = first[0] if isinstance(first, tuple) else first   # (hidden, entropy)
        B, T = first.shape[:2]
        out = {}
        for key in self.slots:
            if key in scored:
                continue
            if key not in self._unembeddings:
                self._unembeddings[key] = settle(self.bank.get(key).unembedding())
            out[key] = (zeros_like(first, (B, T, self.configs[key].hidden_size)),
                        self._unembeddings[key])
        return out

    def save_stats(self, workdir: str) -> None:
        if self.bank is not None and jax.process_index() == 0:
            with open(os.path.join(workdir, "teacher_cache.json"), "w", encoding="utf-8") as f:
                json.dump({"stats": self.bank.stats, "events": self.bank.events}, f, indent=2)


def advantages(rewards_B: np.ndarray, G: int, adv_scale) -> np.ndarray:
    if G > 1:
        return np.asarray(losses.group_advantages(
            jnp.asarray(rewards_B.reshape(-1, G)), scale=adv_scale)).reshape(-1)
    return rewards_B - rewards_B.mean()   # group size 1 (OPD): a batch-mean baseline


class Batcher:
    """The batch phase (`rl` and `rollout` sections): sequences, group advantages (std or
    Dr.GRPO; a batch-mean baseline at group size 1) of the task reward plus weight x the
    judge's score, DAPO's soft overlong penalty and dynamic sampling (groups of equal
    rewards get mask 0).

    Row length: ``rollout.seq_len``, or else the run's longest bucketed row so far
    (`row_len`, grow-only: a batch of shorter rows is padded to it). Every program of an
    iteration (teacher scoring, old log-probs, the train step) compiles once per row length,
    so a run compiles again only when a batch outgrows every earlier one, not each time
    its longest row lands in another bucket. The run keeps `row_len` in its checkpoints,
    so a resumed run builds the same shapes."""

    def __init__(self, cfg: ml_collections.ConfigDict, model_config, row_len: int = 0):
        self.rl, self.model_config = cfg.rl, model_config
        self.G, self.seq_len = cfg.rollout.group_size, cfg.rollout.seq_len or None
        self.row_len = int(row_len)
        self.judge_weight = cfg.rewards.judge.weight if "rewards" in cfg else 0.0
        self.overlong = (int(cfg.rl.get("overlong_buffer", 0)),
                         builders.overlong_max_len(cfg))
        self.flat_iterations = 0     # consecutive iterations whose groups all tied

    FLAT_WARN_AFTER = 3

    def watch_flat(self, rewards_B: np.ndarray) -> None:
        """Warn (once) when group-relative advantages have been all zero for
        FLAT_WARN_AFTER iterations in a row: every group's rewards tied, so GRPO learns
        nothing (its loss is 0) until some rollout scores differently."""
        if self.G < 2:
            return
        groups = rewards_B.reshape(-1, self.G)
        tied = bool(np.all(groups.max(axis=1) == groups.min(axis=1)))
        self.flat_iterations = self.flat_iterations + 1 if tied else 0
        if self.flat_iterations == self.FLAT_WARN_AFTER:
            values = sorted({float(x) for x in np.unique(rewards_B)})[:4]
            warnings.warn(f"the rewards of every group of {self.G} rollouts tied for "
                          f"{self.FLAT_WARN_AFTER} iterations in a row (values {values}): "
                          f"every advantage is 0, so the policy loss is 0 and nothing is "
                          f"learned; the tasks are too hard or too easy for this model "
                          f"(see reward/mean), or the reward cannot tell rollouts apart",
                          RuntimeWarning, stacklevel=2)

    def __call__(self, episodes, judge_B=None) -> tuple[dict, PolicyBatch, dict]:
        """(the student's sequences, the batch without teacher fields, metrics)."""
        longest = max(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
        seq_len = self.seq_len
        if seq_len is None:
            self.row_len = seq_len = max(self.row_len, bucket(longest - 1, ROW_MULTIPLE))
        seqs = build_sequences([e.prompt_ids for e in episodes],
                               [e.response_ids for e in episodes],
                               response_masks=[e.response_mask for e in episodes],
                               sampler_logps=[e.sampler_logp for e in episodes],
                               seq_len=seq_len)
        builders.check_positions(longest, self.model_config, "rollout episodes")
        metrics = reward_metrics(episodes)
        batch = {k: v for k, v in seqs.items() if k not in ("prompt_len", "response_len")}
        rewards_B = np.asarray([e.reward for e in episodes], np.float32)
        if judge_B is not None:
            rewards_B = mix_judge(rewards_B, judge_B, self.judge_weight)
        buffer, longest = self.overlong
        if buffer:   # DAPO soft overlong punishment, in tokens
            penalty_B = np.asarray(losses.overlong_penalty(
                np.asarray([e.sampled_tokens for e in episodes]), longest, buffer))
            rewards_B = rewards_B + penalty_B
            metrics["overlong/penalty_mean"] = float(penalty_B.mean())
        adv_B = advantages(rewards_B, self.G, self.rl.adv_scale)
        self.watch_flat(rewards_B)
        if self.rl.dynamic_sampling:
            keep_B = np.repeat(np.asarray(losses.dapo_group_filter(
                jnp.asarray(rewards_B.reshape(-1, self.G)))), self.G).astype(np.int32)
            batch["mask"] = batch["mask"] * keep_B[:, None]
            metrics["dynamic_sampling/kept_frac"] = float(keep_B.mean())
        batch["adv"] = adv_B.astype(np.float32)
        return seqs, batch, metrics


class OldLogprobs:
    """Old (and reference) log-probs under the rollout sampler's distribution (IcePop, TIS,
    PPO ratio; plain T = 1 ones for the OPD teacher comparison), one minibatch of rows at a
    time (memory bounded like the train step's), jitted with the run's shardings: the
    parameters as the state holds them, rows gathered on device in the batch sharding.
    `ref_params`: the frozen initial policy when the objective's KL option is on."""

    def __init__(self, run, objective, rows: int, ref_params=None):
        self.layout, self.rows, self.ref_params = run.setup.layout, rows, ref_params
        rows_s = self.layout.batch(2)
        self.fn = jax.jit(functools.partial(batch_logprobs, graphdef=run.graphdef,
                                            behaviour=getattr(objective, "behaviour", None)),
                          in_shardings=(run.shardings.params, run.shardings.rest, rows_s),
                          out_shardings=rows_s)

    def _score(self, params, rest, batch):
        return in_row_chunks(lambda sub: self.fn(params, rest, sub),
                             {k: batch[k] for k in MODEL_INPUTS}, self.rows,
                             take=self.layout.take_rows)

    def __call__(self, state, batch) -> tuple[dict, dict]:
        lp = self._score(state.params, state.rest, batch)
        batch = batch | {"old_logp": lp["logp"],
                         "old_logp_plain": lp["logp_plain"]}   # T = 1: the teacher comparison
        metrics = {"entropy": float(losses.masked_mean(lp["entropy"], batch["mask"]))}
        if self.ref_params is not None:
            batch["ref_logp"] = self._score(self.ref_params, state.rest, batch)["logp"]
        return block(batch), metrics


class Updater:
    """The update phase (`rl` section): `ppo_epochs x minibatches` optimizer steps on one
    iteration's batch, rows shuffled per epoch (seeded by (seed, iteration)); one compile
    (the teacher slots are fixed for the run: `Teachers.slots`). Teacher unembeddings
    enter the step as the objective's Needs say (sharded over V for a vocab-parallel
    objective). The divergence check reads each step's metrics one step late
    (`Run.check_late`), so the host never waits on the step it just dispatched."""

    def __init__(self, run, objective, rows: int):
        self.run, self.objective, self.rows = run, objective, rows
        self.rl, self.seed = run.cfg.rl, run.cfg.seed
        self._fns = {}

    def _step_fn(self, n_teachers):
        if n_teachers not in self._fns:
            needs, mesh = type(self.objective).needs, self.run.setup.mesh
            self._fns[n_teachers] = self.run.compile(
                functools.partial(policy_step, graphdef=self.run.graphdef, tx=self.run.tx,
                                  objective=self.objective),
                extra_shardings=((needs.unembedding_sharding(self.objective, mesh),)
                                 * n_teachers,))
        return self._fns[n_teachers]

    def __call__(self, batch, scores: TeacherScores, it: int) -> dict:
        run, layout = self.run, self.run.setup.layout
        rng = np.random.default_rng(self.seed * 7919 + it)
        B, mb, steps = len(batch["adv"]), self.rows, []
        for _ in range(self.rl.ppo_epochs):
            perm = rng.permutation(B)
            for k in range(self.rl.minibatches):
                idx = np.sort(perm[k * mb:(k + 1) * mb])
                sub = layout.take_rows(batch, idx)     # on device, in the batch sharding
                run.state, m = self._step_fn(len(scores.unembeddings))(
                    run.state, sub, scores.unembeddings)
                run.step += 1                          # = state.step, without a host sync
                run.check_late(run.step, m)
                steps.append(m)
        run.check_now()
        return mean_step_metrics([named_metrics(m, scores.order)
                                  for m in jax.device_get(steps)])


def mean_step_metrics(steps: list[dict]) -> dict:
    """An iteration's step metrics: the mean over its optimizer steps (min / max for
    `*_min` / `*_max`), plus loss/last_minibatch. A per-teacher metric counts only the
    steps whose minibatch held rows of that teacher (NaN elsewhere); a teacher with none in
    the whole iteration is left out."""
    out = {}
    for k in steps[0]:
        vals = [m[k] for m in steps
                if not (k.startswith(PER_TEACHER) and np.isnan(m[k]))]   # a loss stays NaN
        if not vals:
            continue
        fn = min if k.endswith("_min") else max if k.endswith("_max") else None
        out[k] = float(fn(vals)) if fn else float(np.mean(vals))
    out["loss/last_minibatch"] = float(steps[-1]["loss"])
    return out


def named_metrics(metrics: dict, order: list[str]) -> dict[str, float]:
    """A step's metrics as floats; a per-teacher array "teacher/kl" [S] becomes one metric
    per teacher, "teacher/<key of slot s>/kl" (slot order: the run's teacher slots), NaN
    for a slot that scored no token of this minibatch ("teacher/tokens" 0)."""
    out = {}
    tokens = np.asarray(metrics.get(f"{PER_TEACHER}tokens", np.ones(len(order))))
    for k, v in metrics.items():
        v = np.asarray(v)
        if k.startswith(PER_TEACHER) and v.ndim == 1:
            name = k[len(PER_TEACHER):]
            out |= {f"{PER_TEACHER}{order[s]}/{name}":
                    float(x) if name == "tokens" or tokens[s] > 0 else float("nan")
                    for s, x in enumerate(v)}
        else:
            out[k] = float(v)
    return out


def reward_metrics(episodes) -> dict:
    by_cell = defaultdict(list)
    for e in episodes:
        by_cell[cell_of(e.task)].append(e.reward)
    out = {"reward/mean": float(np.mean([e.reward for e in episodes])),
           "response_len": float(np.mean([e.sampled_tokens for e in episodes])),
           "prompt_len": float(np.mean([len(e.prompt_ids) for e in episodes]))}
    out |= {f"reward/{c}": float(np.mean(v)) for c, v in by_cell.items()}
    return out


def student(run):
    """The current student as a module (shares the state's arrays)."""
    return nnx.merge(run.graphdef, run.state.params, run.state.rest)
