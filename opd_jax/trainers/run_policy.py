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

import os

import jax
import numpy as np
import ml_collections

from opd_jax import sharding as sh
from opd_jax.trainers import builders, compute, evaluate
from opd_jax.trainers.builders import task_cells
from opd_jax.trainers.objectives import check_needs, make_objective
from opd_jax.trainers.phases import (Batcher, Judge, OldLogprobs, Rollout, Teachers, Timer,
                                     Updater, student, task_dataset)
from opd_jax.trainers.run import Run, Setup


def _plan(cfg: ml_collections.ConfigDict):
    """Everything checked before any weights are built or anything written: the setup, the
    objective (its Needs and its own config rules; placed on the run's mesh), the rows per
    optimizer step (the scoring passes run one such minibatch at a time too), the cells and
    the teachers (routing and every teacher's config and tokenizer)."""
    setup = Setup.of(cfg)
    objective = make_objective(cfg.objective.name, sampling=cfg.rollout.sampling,
                               **dict(cfg.objective.options))
    needs = type(objective).needs
    if hasattr(objective, "check_config"):     # an objective's own config rules
        objective.check_config(cfg)
    check_needs(cfg.objective.name, cfg)
    objective = needs.on_mesh(objective, setup.mesh, setup.rules, setup.model_config.vocab_size)
    rows = (builders.policy_rows(cfg, sh.batch_shards(setup.mesh, setup.rules))
            // cfg.rl.minibatches)
    cells = task_cells(cfg.tasks)
    teachers = Teachers(cfg.get("teachers"), needs, cells, setup,
                        builders.tokenizer_spec(cfg), rows, cfg.rollout.sampling.max_new_tokens,
                        scoring=needs.scoring_kw(objective))
    return setup, objective, needs, rows, cells, teachers


def train_policy(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
                 resume_with_changes: bool = False) -> dict:
    setup, objective, needs, rows, cells, teachers = _plan(cfg)
    task_iter = iter(task_dataset(cfg.tasks, cfg.rollout.prompts_per_step))
    steps, per_iter = cfg.train.steps, cfg.rl.ppo_epochs * cfg.rl.minibatches
    run = Run.open(cfg, workdir, kind=cfg.objective.name, setup=setup, iterator=task_iter,
                   optimizer_steps=steps * per_iter, steps_per_unit=per_iter,
                   resume_with_changes=resume_with_changes, guard_unit="optimizer step",
                   keep_initial_params=needs.wants_reference(objective))
    try:
        judge = Judge(cfg, setup.tokenizer)
        batcher = Batcher(cfg, setup.model_config, row_len=run.resumed.get("row_len", 0))
        old_logprobs = OldLogprobs(run, objective, rows, run.initial_params)
        update = Updater(run, objective, rows)
        heldout = evaluate.HeldOut(cfg, cells, setup.tokenizer, teachers.cell_weights)
        rollout = Rollout(cfg.rollout, setup.tokenizer, setup.mesh, seed=cfg.seed,
                          workdir=workdir, start=run.start, reset=resume_with_changes)
        history, eval_rows = [], None
        counts = compute.Compute.from_dict(run.resumed.get("compute"))
        forward_passes = int(needs.old_logp) + int(run.initial_params is not None)
        bar = run.progress(steps, desc=cfg.objective.name, enabled=progress)
        for it in bar:
            timer, done = Timer(), it + 1
            with timer("rollout"):
                episodes, m_rollout = rollout(student(run), next(task_iter), it, run.step)
            with timer("judge", record=judge.enabled):
                judge_B, m_judge = judge(episodes)
            seqs, batch, metrics = batcher(episodes, judge_B)
            metrics |= m_judge | m_rollout
            with timer("teachers"):
                scores, m = teachers.score(episodes, seqs)
            batch = batch | scores.fields
            if "teacher_valid" in batch:      # served teachers' missing log-probs: masked
                batch["mask"] = batch["mask"] * np.asarray(batch.pop("teacher_valid"))
            batch = setup.layout.shard_batch(batch)                   # once an iteration
            with timer("old_logp"):
                if needs.old_logp:
                    batch, m_old = old_logprobs(run.state, batch)
                    m |= m_old
            with timer("update"):
                m |= update(batch, scores, it)
            sampled = sum(e.sampled_tokens for e in episodes)
            metrics |= m | {"tokens_per_s": sampled / max(timer.elapsed(), 1e-9)}
            counts.add_iteration([len(e.prompt_ids) + len(e.response_ids) for e in episodes],
                                 sampled, forward_passes=forward_passes,
                                 epochs=cfg.rl.ppo_epochs,
                                 teacher_rows=teachers.scored_rows(episodes))
            with timer("eval"):
                if heldout.due(done, steps):
                    eval_rows, m = heldout(student(run))
                    metrics |= m
            metrics |= timer.times | {"time/iteration": timer.elapsed()}
            history.append({"step": done, **metrics})
            if run.due(done, cfg.train.log_every, steps):
                run.writer.write(done, metrics)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            if run.due(done, cfg.train.ckpt_every, steps):
                run.save(run.step, iteration=done, compute=counts.to_dict(),
                         row_len=batcher.row_len)
                rollout.log.checkpointed(done)
    finally:
        run.close()
    if eval_rows is not None and jax.process_index() == 0:
        evaluate.write_rows(eval_rows, os.path.join(workdir, "eval"))
    teachers.save_stats(workdir)
    if jax.process_index() == 0:
        compute.write(workdir, counts, setup.model_config.num_params(), teachers.params())
    return {"history": history, "checkpoint": run.ckpt.directory, "eval": eval_rows,
            "teacher_cache": teachers.bank.stats if teachers.bank else None}
