"""The policy-trainer driver: GRPO specialists and OPD students, from one config.

What a run builds is decided by the objective's declared `Needs`
(:mod:`opd_jax.trainers.objectives`, docs/objectives.md), checked against the config before
any work; the driver never switches on an objective's name. Each iteration runs the phases

  rollout   play `group_size` episodes for each of `prompts_per_step` tasks with the
            current student (rollout engine + environments), logging its tokens
            (`rollout.wal_every`; a killed run resumes the rollout); time/rollout
  judge     (rewards.judge.path set) a generative reward model scores each episode's
            final answer with a rubric (opd_jax/trainers/judge.py);      time/judge
  teachers  (Needs.teacher != "none") route each episode to its teacher(s) by
            (domain, effort) and score the same tokens (log-probs, or last-layer hidden
            states), each teacher once per iteration, loaded sharded on the run's mesh
            and its rows sharded like the student's batch;               time/teachers
  batch     sequences, group advantages (std or Dr.GRPO; a batch-mean baseline at group
            size 1) of the task reward plus weight x the judge's score, DAPO's soft
            overlong penalty (`rl.overlong_buffer`) and
            dynamic sampling (groups of equal rewards get mask 0: they are
            dropped, not resampled); old log-probs with the training forward
            (IcePop/TIS compare them with the sampler's) and the reference
            log-probs when the objective's KL option is on;              time/old_logp
  update    `ppo_epochs x minibatches` optimizer steps;                  time/update
  evaluate  held-out reward every `eval.every` iterations and at the end; time/eval
  log       metrics.jsonl (+ TensorBoard), checkpoint.                   time/iteration

Times are wall seconds (device work waited for). The step metrics of an iteration (loss,
grad_norm and the objective's) are means over its optimizer steps (`*_min` / `*_max`
metrics: the min / max); ``loss/last_minibatch`` is the last step's loss. Checkpoints hold
the train state and the task iterator; rollout seeds derive from (seed, iteration), so a
resumed run replays the same samples.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections import defaultdict

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from opd_jax import envs, losses
from opd_jax import sharding as sh
from opd_jax.checkpoint import abstract_like
from opd_jax.teachers import (TeacherBank, TeacherScorer, check_routing, in_row_chunks,
                              teacher_fields, teacher_weights)
from opd_jax.teachers.scoring import MODEL_INPUTS
from opd_jax.trainers import builders, evaluate
from opd_jax.trainers.builders import task_cells
from opd_jax.trainers.episodes import SamplingConfig, cell_of, play
from opd_jax.trainers.rollout_log import RolloutLog
from opd_jax.trainers.evaluate import heldout_metrics   # noqa: F401  (its old home)
from opd_jax.trainers.judge import JudgeReward, mix_judge
from opd_jax.trainers.metrics import DivergenceGuard, MetricsWriter
from opd_jax.trainers.objectives import make_objective
from opd_jax.trainers.policy import batch_logprobs, policy_step
from opd_jax.trainers.run_sft import open_workdir
from opd_jax.trainers.sequences import build_sequences

_TeacherScorer = TeacherScorer   # its old name here (tests/trainers/test_policy_parts.py)
from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state


def task_dataset(t: ml_collections.ConfigDict, batch: int) -> grain.IterDataset:
    cells = task_cells(t)
    src = envs.MixtureSource([envs.TaskSource(fam, size=t.size, seed=t.seed, effort=e,
                                              difficulty=t.difficulty, split="train")
                              for _, fam, e in cells])
    for (d, fam, _) in cells:
        if envs.get_family(fam).domain != d:
            raise ValueError(f"family {fam!r} is in domain {envs.get_family(fam).domain!r}, "
                             f"not {d!r}")
    return grain.MapDataset.source(src).shuffle(seed=t.seed).repeat(None).batch(
        batch, batch_fn=list).to_iter_dataset()


def route(task: envs.Task, routing: str, table: dict) -> str:
    """Teacher key of a task under single-teacher routing ("cell", "domain" or "table")."""
    (key,) = teacher_weights(task.domain, task.effort, routing, table=table)
    return key


class _Timer:
    """Wall seconds per phase: ``with timer("rollout"): ...`` adds metric time/rollout."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + (
            time.perf_counter() - t0)


def _block(tree):
    """Wait for the device work behind `tree` (so a phase's time is its own)."""
    jax.block_until_ready([x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)])
    return tree


class _Teachers:
    """The OPD side of a run, from the objective's Needs: the bank, the per-cell weights
    (checked against the bank before any work) and the scorer. `enabled` is False for
    objectives without a teacher (then nothing is loaded or scored)."""

    def __init__(self, cfg, needs, cells, model_config, tokenizer, chunk_rows: int, mesh,
                 rules):
        self.needs, self.enabled = needs, needs.teacher != "none"
        self.bank, self.cell_weights, self.scorer = None, {}, None
        if not self.enabled:
            return
        self.bank = TeacherBank(dict(cfg.teachers.paths),
                                max_loaded=cfg.teachers.max_loaded or None, mesh=mesh,
                                rules=rules)
        self.cell_weights = check_routing(cells, self.bank.keys(), cfg.teachers.routing,
                                          table=dict(cfg.teachers.table),
                                          weights=cfg.teachers.weights.to_dict(),
                                          single_teacher=not needs.mixture)
        self.bank.validate(model_config.vocab_size, tokenizer, cfg.tokenizer)
        self.scorer = TeacherScorer(self.bank, tokenizer, needs.teacher,
                                    role=cfg.teachers.prompt_role, chunk_rows=chunk_rows)

    def score(self, episodes, seqs) -> tuple[list[str], dict, tuple, dict]:
        """(slot order, batch fields, teacher unembeddings, metrics) of one iteration."""
        if not self.enabled:
            return [], {}, (), {}
        weights = [self.cell_weights[cell_of(e.task)] for e in episodes]
        order, fields, unemb = teacher_fields(self.scorer(episodes, weights, seqs), weights,
                                              self.needs.teacher)
        return order, _block(fields), unemb, {"teachers_loaded": float(len(self.bank.loaded()))}

    def save_stats(self, workdir: str) -> None:
        if self.bank is not None and jax.process_index() == 0:
            with open(os.path.join(workdir, "teacher_cache.json"), "w", encoding="utf-8") as f:
                json.dump({"stats": self.bank.stats, "events": self.bank.events}, f, indent=2)


def _advantages(rewards_B: np.ndarray, G: int, adv_scale) -> np.ndarray:
    if G > 1:
        return np.asarray(losses.group_advantages(
            jnp.asarray(rewards_B.reshape(-1, G)), scale=adv_scale)).reshape(-1)
    return rewards_B - rewards_B.mean()   # group size 1 (OPD): a batch-mean baseline


def _sequence_batch(cfg, episodes, model_config, judge_B=None) -> tuple[dict, dict, dict]:
    """(the student's sequences, the batch without teacher fields, metrics). judge_B: the
    judge's score per episode, mixed into the task reward (`mix_judge`)."""
    G = cfg.rollout.group_size
    seqs = build_sequences([e.prompt_ids for e in episodes], [e.response_ids for e in episodes],
                           response_masks=[e.response_mask for e in episodes],
                           sampler_logps=[e.sampler_logp for e in episodes],
                           seq_len=cfg.rollout.seq_len or None)
    builders.check_positions(max(len(e.prompt_ids) + len(e.response_ids) for e in episodes),
                             model_config, "rollout episodes")
    metrics = _reward_metrics(episodes)
    batch = {k: v for k, v in seqs.items() if k not in ("prompt_len", "response_len")}
    rewards_B = np.asarray([e.reward for e in episodes], np.float32)
    if judge_B is not None:
        rewards_B = mix_judge(rewards_B, judge_B, cfg.rewards.judge.weight)
    if cfg.rl.get("overlong_buffer", 0):   # DAPO soft overlong punishment, in tokens
        penalty_B = np.asarray(losses.overlong_penalty(
            np.asarray([e.sampled_tokens for e in episodes]), builders.overlong_max_len(cfg),
            int(cfg.rl.overlong_buffer)))
        rewards_B = rewards_B + penalty_B
        metrics["overlong/penalty_mean"] = float(penalty_B.mean())
    adv_B = _advantages(rewards_B, G, cfg.rl.adv_scale)
    if cfg.rl.dynamic_sampling:
        keep_B = np.repeat(np.asarray(losses.dapo_group_filter(
            jnp.asarray(rewards_B.reshape(-1, G)))), G).astype(np.int32)
        batch["mask"] = batch["mask"] * keep_B[:, None]
        metrics["dynamic_sampling/kept_frac"] = float(keep_B.mean())
    batch["adv"] = adv_B.astype(np.float32)
    return seqs, batch, metrics


def _mean_step_metrics(steps: list[dict]) -> dict:
    """An iteration's step metrics: the mean over its optimizer steps (min / max for
    `*_min` / `*_max`), plus loss/last_minibatch."""
    out = {}
    for k in steps[0]:
        vals = [m[k] for m in steps]
        fn = min if k.endswith("_min") else max if k.endswith("_max") else None
        out[k] = float(fn(vals)) if fn else float(np.mean(vals))
    out["loss/last_minibatch"] = float(steps[-1]["loss"])
    return out


class _Updater:
    """The update phase: `ppo_epochs x minibatches` optimizer steps on one iteration's
    batch, rows shuffled per epoch (seeded by (seed, iteration)); one compile per number of
    teacher slots. Teacher unembeddings enter the step as the objective's Needs say
    (`Needs.unembedding_sharding`: sharded over V for a vocab-parallel objective)."""

    def __init__(self, cfg, graphdef, tx, objective, shardings, mesh, rules, guard, ckpt):
        self.cfg, self.graphdef, self.tx, self.objective = cfg, graphdef, tx, objective
        self.shardings, self.mesh, self.rules, self.guard, self.ckpt = (
            shardings, mesh, rules, guard, ckpt)
        self.rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.rl.minibatches
        self._fns = {}

    def _step_fn(self, n_teachers):
        if n_teachers not in self._fns:
            self._fns[n_teachers] = compile_step(
                functools.partial(policy_step, graphdef=self.graphdef, tx=self.tx,
                                  objective=self.objective),
                self.shardings, self.mesh,
                extra_shardings=((type(self.objective).needs.unembedding_sharding(
                    self.objective, self.mesh),) * n_teachers,),
                skip_nonfinite=self.guard.max_bad_steps > 0)
        return self._fns[n_teachers]

    def __call__(self, state, batch, teachers_W, order, it):
        rng = np.random.default_rng(self.cfg.seed * 7919 + it)
        B, mb, steps = len(batch["adv"]), self.rows, []
        for _ in range(self.cfg.rl.ppo_epochs):
            perm = rng.permutation(B)
            for k in range(self.cfg.rl.minibatches):
                idx = np.sort(perm[k * mb:(k + 1) * mb])
                sub = sh.shard_batch(jax.tree.map(lambda x: x[idx], batch), self.mesh, self.rules)
                state, m = self._step_fn(len(teachers_W))(state, sub, teachers_W)
                self.guard.check(int(state.step), m, last_checkpoint=self.ckpt.latest_step())
                steps.append(m)
        # Slot s of this iteration -> its teacher's key, stable across iterations.
        steps = [{_teacher_name(k, order): float(v) for k, v in m.items()}
                 for m in jax.device_get(steps)]
        return state, _mean_step_metrics(steps)


def train_policy(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
                 resume_with_changes: bool = False) -> dict:
    # Everything that needs no weights is checked before anything is built or written.
    mesh, rules, tokenizer, model_config = builders.setup(cfg)
    objective = make_objective(cfg.objective.name, sampling=cfg.rollout.sampling,
                               **dict(cfg.objective.options))
    needs = type(objective).needs
    needs.check(cfg.objective.name, cfg)
    objective = needs.on_mesh(objective, mesh, rules, model_config.vocab_size)
    builders.policy_rows(cfg, sh.batch_shards(mesh, rules))
    cells = task_cells(cfg.tasks)
    # Rows per optimizer step; the scoring passes run one such minibatch at a time too.
    minibatch_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.rl.minibatches
    teachers = _Teachers(cfg, needs, [(d, e) for d, _, e in cells], model_config, tokenizer,
                         minibatch_rows, mesh, rules)
    model_meta = model_config.to_dict()
    ckpt = open_workdir(workdir, cfg, model_meta, resume_with_changes=resume_with_changes)
    model = builders.build_model(cfg.model, mesh, rules, seed=cfg.seed)
    judge = JudgeReward.from_config(cfg.rewards.judge, tokenizer) if "rewards" in cfg else None

    task_iter = iter(task_dataset(cfg.tasks, cfg.rollout.prompts_per_step))
    steps, per_iter = cfg.train.steps, cfg.rl.ppo_epochs * cfg.rl.minibatches
    tx = make_optimizer(cfg.optim, steps * per_iter)
    graphdef, state = create_state(model, tx)
    state, shardings = place_state(state, mesh, rules)
    ref_params = jax.tree.map(jnp.copy, state.params) if needs.wants_reference(objective) else None
    start = 0
    if ckpt.latest_step() is not None:
        state, _ = ckpt.restore(None, abstract_like(state), task_iter)
        start = int(state.step) // per_iter
    guard = DivergenceGuard(cfg.train.get("max_bad_steps", 0), unit="optimizer step",
                            lr=cfg.optim.lr)
    update = _Updater(cfg, graphdef, tx, objective, shardings, mesh, rules, guard, ckpt)
    old_logprobs = _OldLogprobs(graphdef, objective, mesh, rules, minibatch_rows)
    heldout = evaluate.HeldOut(cfg, cells, tokenizer, teachers.cell_weights)
    sampling = SamplingConfig(**dict(cfg.rollout.sampling))
    multi = jax.process_count() > 1     # rollout rows split over processes
    rollout_log = RolloutLog(workdir, cfg.rollout.get("wal_every", 0), start=start,
                             enabled=not multi, reset=resume_with_changes)
    writer = MetricsWriter(workdir, resume_step=start)   # iterations done
    meta = {"model": model_meta, "kind": cfg.objective.name,
            "tokenizer": builders.tokenizer_meta(cfg.tokenizer, tokenizer)}
    history, eval_rows = [], None
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=cfg.objective.name,
               disable=not progress or jax.process_index() != 0, dynamic_ncols=True)
    try:
        for it in bar:
            t0, timer = time.perf_counter(), _Timer()
            with timer("rollout"):
                tasks = next(task_iter)
                student = nnx.merge(graphdef, state.params, state.rest)
                episodes = play(student, tokenizer,
                                [t for t in tasks for _ in range(cfg.rollout.group_size)],
                                sampling, seed=cfg.seed * 100_003 + it,
                                mesh=mesh if multi else None,
                                **rollout_log.kwargs(it, int(state.step)))
            judge_B, judge_m = None, {}
            if judge is not None:
                with timer("judge"):
                    judge_B, judge_m = judge(episodes)
            seqs, batch, metrics = _sequence_batch(cfg, episodes, model_config, judge_B)
            metrics |= judge_m
            metrics |= {f"rollout/{k}": float(v) for k, v in rollout_log.stats.items()}
            with timer("teachers"):
                order, fields, teachers_W, m = teachers.score(episodes, seqs)
            metrics |= m
            batch = sh.shard_batch(batch | fields, mesh, rules)
            with timer("old_logp"):
                if needs.old_logp:
                    batch, m = old_logprobs(state, batch, ref_params)
                    metrics |= m
            with timer("update"):
                state, m = update(state, batch, teachers_W, order, it)
            metrics |= m
            metrics["tokens_per_s"] = (sum(e.sampled_tokens for e in episodes)
                                       / max(time.perf_counter() - t0, 1e-9))
            done = it + 1
            with timer("eval"):
                if heldout.due(done, steps):
                    eval_rows, m = heldout(nnx.merge(graphdef, state.params, state.rest))
                    metrics |= m
            metrics |= timer.times | {"time/iteration": time.perf_counter() - t0}
            history.append({"step": done, **metrics})
            if done % cfg.train.log_every == 0 or done == steps:
                writer.write(done, metrics)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            if done % cfg.train.ckpt_every == 0 or done == steps:
                ckpt.save(int(state.step), state, task_iter, meta | {"iteration": done})
                rollout_log.checkpointed(done)
    finally:
        ckpt.close()
        writer.close()
    if eval_rows is not None and jax.process_index() == 0:
        evaluate.write_rows(eval_rows, os.path.join(workdir, "eval"))
    teachers.save_stats(workdir)
    return {"history": history, "checkpoint": ckpt.directory, "eval": eval_rows,
            "teacher_cache": teachers.bank.stats if teachers.bank else None}


class _OldLogprobs:
    """Old (and reference) log-probs under the rollout sampler's distribution (IcePop, TIS,
    PPO ratio; plain T = 1 ones for the OPD teacher comparison), one minibatch of rows at a
    time (memory bounded like the train step's)."""

    def __init__(self, graphdef, objective, mesh, rules, rows: int):
        self.mesh, self.rules, self.rows = mesh, rules, rows
        self.fn = jax.jit(functools.partial(batch_logprobs, graphdef=graphdef,
                                            behaviour=getattr(objective, "behaviour", None)))

    def _score(self, params, rest, batch):
        return in_row_chunks(
            lambda sub: self.fn(params, rest, sh.shard_batch(sub, self.mesh, self.rules)),
            {k: batch[k] for k in MODEL_INPUTS}, self.rows)

    def __call__(self, state, batch, ref_params=None) -> tuple[dict, dict]:
        lp = self._score(state.params, state.rest, batch)
        batch = batch | {"old_logp": lp["logp"],
                         "old_logp_plain": lp["logp_plain"]}   # T = 1: the teacher comparison
        metrics = {"entropy": float(losses.masked_mean(lp["entropy"], batch["mask"]))}
        if ref_params is not None:
            batch["ref_logp"] = self._score(ref_params, state.rest, batch)["logp"]
        return _block(batch), metrics


def _teacher_name(metric: str, order: list[str]) -> str:
    """"teacher1/kl" -> "teacher/<key of slot 1>/kl"; other metrics unchanged."""
    head, _, rest = metric.partition("/")
    if head.startswith("teacher") and head[7:].isdigit() and rest:
        return f"teacher/{order[int(head[7:])]}/{rest}"
    return metric


def _reward_metrics(episodes) -> dict:
    by_cell = defaultdict(list)
    for e in episodes:
        by_cell[cell_of(e.task)].append(e.reward)
    out = {"reward/mean": float(np.mean([e.reward for e in episodes])),
           "response_len": float(np.mean([e.sampled_tokens for e in episodes]))}
    out |= {f"reward/{c}": float(np.mean(v)) for c, v in by_cell.items()}
    return out
