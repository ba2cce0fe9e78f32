"""The policy-trainer driver: GRPO specialists and OPD students, from one config.

Each iteration: take `prompts_per_step` tasks, play `group_size` episodes per task with the
current student (rollout engine + environments), score them, then
* grpo: group advantages (std or Dr.GRPO), optional DAPO dynamic sampling (groups with equal
  rewards get zero mask) and overlong penalty;
* OPD objectives: route each episode to its teacher by (domain, effort) (or a fixed map),
  score the same tokens with the teacher (log-probs, or cached last-layer hidden states for
  the full-vocab objective), grouped so each teacher runs once per iteration;
recompute old log-probs with the training forward (IcePop/TIS compare them with the
sampler's), then take `ppo_epochs x minibatches` optimizer steps. Checkpoints hold the
train state and the task iterator; rollout seeds derive from (seed, iteration), so a
resumed run replays the same samples.
"""
from __future__ import annotations

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
from opd_jax.teachers import TeacherBank, check_routing, teacher_weights
from opd_jax.trainers import builders, evaluate
from opd_jax.trainers.episodes import SamplingConfig, cell_of, encode, play
from opd_jax.trainers.metrics import DivergenceGuard, MetricsWriter
from opd_jax.trainers.objectives import make_objective
from opd_jax.trainers.policy import batch_logprobs, policy_step, teacher_outputs
from opd_jax.trainers.run_sft import open_workdir
from opd_jax.trainers.sequences import align_to_student, bucket, build_sequences
from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state


def task_cells(t: ml_collections.ConfigDict) -> list[tuple[str, str, str]]:
    """(domain, family, effort) cells of a run: families x efforts, or only `t.cells`."""
    grid = [(d, fam, e) for d, fam in t.families.items() for e in t.efforts]
    only = tuple(t.get("cells", ()) or ())
    if not only:
        return grid
    names = {f"{d}/{e}": (d, fam, e) for d, fam, e in grid}
    unknown = [c for c in only if c not in names]
    if unknown:
        raise ValueError(f"tasks.cells {unknown} are not in the families x efforts grid "
                         f"{sorted(names)}")
    return [names[c] for c in only]


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


# What a scoring forward reads from a sequence batch.
MODEL_INPUTS = ("inputs", "targets", "segment_ids")


def in_row_chunks(fn, batch: dict, rows: int):
    """``fn`` on consecutive `rows`-row slices of `batch`, outputs concatenated along rows.

    The no-grad scoring passes (old / reference log-probs, teachers) run one training
    minibatch of rows at a time, so their [rows, T, V] logits never exceed what the train
    step itself holds. Slices keep the global row order (as the minibatch split does).
    """
    B = jax.tree.leaves(batch)[0].shape[0]
    if rows <= 0 or B % rows:
        raise ValueError(f"scoring chunk of {rows} rows for a batch of {B}: expected a "
                         f"positive divisor of {B}")
    outs = [fn(jax.tree.map(lambda x: x[i:i + rows], batch)) for i in range(0, B, rows)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs) if len(outs) > 1 else outs[0]


class _TeacherScorer:
    """Scores episodes with their teachers: each teacher runs once per iteration on the rows
    routed to it, in chunks of `chunk_rows` (the last chunk padded by repeating a row)."""

    def __init__(self, bank: TeacherBank, tokenizer, kind: str, role: str = "student",
                 chunk_rows: int = 0):
        self.bank, self.tokenizer, self.kind, self.role = bank, tokenizer, kind, role
        self.chunk_rows = chunk_rows
        self._fns = {}

    def _fn(self, graphdef):
        if graphdef not in self._fns:
            self._fns[graphdef] = jax.jit(functools.partial(teacher_outputs, graphdef=graphdef,
                                                            kind=self.kind))
        return self._fns[graphdef]

    def __call__(self, episodes, weights, student_seqs):
        """Per teacher key: (rows with weight > 0, values aligned to student targets for all
        B rows, zeros on the rows it does not score, W_t)."""
        B, T = student_seqs["targets"].shape
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        out = {}
        # Teachers already in the cache first: with a cache smaller than the bank, a fixed
        # order would evict each teacher just before it is needed again (every access a miss).
        loaded = set(self.bank.loaded())
        for key in sorted({k for w in weights for k in w}, key=lambda k: (k not in loaded, k)):
            rows = [b for b, w in enumerate(weights) if w.get(key, 0.0) > 0]
            teacher = self.bank.get(key)
            graphdef, params, rest = nnx.split(teacher, nnx.Param, ...)
            chunk = min(self.chunk_rows or len(rows), len(rows))
            padded = rows + rows[:1] * (-len(rows) % chunk)
            prompts = [bos + encode(self.tokenizer, envs.render_prompt(episodes[b].task,
                                                                        role=self.role))
                       for b in padded]
            responses = [episodes[b].response_ids for b in padded]
            # Row length bucketed (one compile per teacher shape and bucket).
            tseq = build_sequences(prompts, responses, seq_len=bucket(
                max(len(p) + len(r) for p, r in zip(prompts, responses)) - 1))
            vals = in_row_chunks(lambda sub: self._fn(graphdef)(params, rest, sub),
                                 {k: tseq[k] for k in MODEL_INPUTS}, chunk)
            aligned = align_to_student(vals, jnp.asarray(tseq["prompt_len"]),
                                       jnp.asarray(student_seqs["prompt_len"][padded]), T)
            full = jnp.zeros((B,) + aligned.shape[1:], aligned.dtype)
            full = full.at[np.asarray(rows)].set(aligned[:len(rows)])
            out[key] = (rows, full, teacher.unembedding() if self.kind == "hidden" else None)
        return out


def train_policy(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
                 resume_with_changes: bool = False) -> dict:
    # Everything that needs no weights is checked before anything is built or written.
    mesh, rules, tokenizer, model_config = builders.setup(cfg)
    objective = make_objective(cfg.objective.name, sampling=cfg.rollout.sampling,
                               **dict(cfg.objective.options))
    builders.policy_rows(cfg, sh.batch_shards(mesh, rules))
    is_opd = cfg.objective.name != "grpo"
    bank = None
    cells = [(d, e) for d, _, e in task_cells(cfg.tasks)]
    cell_weights = {}
    if is_opd:
        bank = TeacherBank(dict(cfg.teachers.paths), max_loaded=cfg.teachers.max_loaded or None)
        cell_weights = check_routing(cells, bank.keys(), cfg.teachers.routing,
                                     table=dict(cfg.teachers.table),
                                     weights=cfg.teachers.weights.to_dict(),
                                     single_teacher=cfg.objective.name != "deepseek_full_vocab")
        bank.validate(model_config.vocab_size, tokenizer, cfg.tokenizer)
    model_meta = model_config.to_dict()
    ckpt = open_workdir(workdir, cfg, model_meta, resume_with_changes=resume_with_changes)
    model = builders.build_model(cfg.model, mesh, rules, seed=cfg.seed)

    tasks_ds = task_dataset(cfg.tasks, cfg.rollout.prompts_per_step)
    task_iter = iter(tasks_ds)
    steps = cfg.train.steps
    n_updates = steps * cfg.rl.ppo_epochs * cfg.rl.minibatches
    tx = make_optimizer(cfg.optim, n_updates)
    graphdef, state = create_state(model, tx)
    state, shardings = place_state(state, mesh, rules)
    ref_params = None
    if not is_opd and cfg.objective.options.get("kl_beta", 0.0) > 0:
        ref_params = jax.tree.map(jnp.copy, state.params)
    start = 0
    if ckpt.latest_step() is not None:
        state, _ = ckpt.restore(None, abstract_like(state), task_iter)
        start = int(state.step) // (cfg.rl.ppo_epochs * cfg.rl.minibatches)
    guard = DivergenceGuard(cfg.train.get("max_bad_steps", 0), unit="optimizer step",
                            lr=cfg.optim.lr)

    rep = sh.replicated(mesh)
    multi = jax.process_count() > 1     # rollout rows split over processes
    step_fns = {}

    def step_fn(n_teachers):
        if n_teachers not in step_fns:
            step_fns[n_teachers] = compile_step(
                functools.partial(policy_step, graphdef=graphdef, tx=tx, objective=objective),
                shardings, mesh, extra_shardings=((rep,) * n_teachers,),
                skip_nonfinite=guard.max_bad_steps > 0)
        return step_fns[n_teachers]

    # Old / reference log-probs under the rollout sampler's distribution (IcePop, TIS, PPO).
    logp_fn = jax.jit(functools.partial(batch_logprobs, graphdef=graphdef,
                                        behaviour=getattr(objective, "behaviour", None)))
    # Rows per optimizer step; the scoring passes run one such minibatch at a time too
    # (memory bounded like the step's).
    minibatch_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.rl.minibatches

    def score(params, rest, batch):
        return in_row_chunks(lambda sub: logp_fn(params, rest, sh.shard_batch(sub, mesh, rules)),
                             {k: batch[k] for k in MODEL_INPUTS}, minibatch_rows)
    scorer = _TeacherScorer(bank, tokenizer, "hidden" if cfg.objective.name ==
                            "deepseek_full_vocab" else "logp",
                            role=cfg.teachers.prompt_role,
                            chunk_rows=minibatch_rows) if is_opd else None
    heldout = [t for d, fam, e in task_cells(cfg.tasks)
               for t in evaluate.heldout_tasks({d: fam}, (e,), n=cfg.eval.n,
                                               seed=cfg.tasks.seed + cfg.eval.seed,
                                               difficulty=cfg.tasks.difficulty)]
    eval_sampling = SamplingConfig(**dict(cfg.eval.sampling))
    # A cell's held-out reward is reported under the teacher with the largest weight there.
    cell_keys = {c: max(w, key=w.get) for c, w in cell_weights.items()}

    def run_eval(state) -> tuple[list, dict]:
        model = nnx.merge(graphdef, state.params, state.rest)
        rows = evaluate.evaluate_tasks(model, tokenizer, heldout, eval_sampling,
                                       seed=cfg.eval.seed, batch_size=cfg.eval.batch_size)
        return rows, heldout_metrics(rows, cell_keys)
    sampling = SamplingConfig(**dict(cfg.rollout.sampling))
    writer = MetricsWriter(workdir, resume_step=start)   # iterations done
    meta = {"model": model_meta, "kind": cfg.objective.name,
            "tokenizer": builders.tokenizer_meta(cfg.tokenizer, tokenizer)}
    history, eval_rows = [], None
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=cfg.objective.name,
               disable=not progress or jax.process_index() != 0, dynamic_ncols=True)
    try:
        for it in bar:
            t0 = time.time()
            tasks = next(task_iter)
            G = cfg.rollout.group_size
            group_tasks = [t for t in tasks for _ in range(G)]
            student = nnx.merge(graphdef, state.params, state.rest)
            episodes = play(student, tokenizer, group_tasks, sampling,
                            seed=cfg.seed * 100_003 + it, mesh=mesh if multi else None)
            rewards_B = np.asarray([e.reward for e in episodes], np.float32)
            seqs = build_sequences([e.prompt_ids for e in episodes],
                                   [e.response_ids for e in episodes],
                                   response_masks=[e.response_mask for e in episodes],
                                   sampler_logps=[e.sampler_logp for e in episodes],
                                   seq_len=cfg.rollout.seq_len or None)
            builders.check_positions(max(len(e.prompt_ids) + len(e.response_ids)
                                         for e in episodes), model_config, "rollout episodes")
            metrics = _reward_metrics(episodes)
            batch = {k: v for k, v in seqs.items() if k not in ("prompt_len", "response_len")}
            rewards_BxG = rewards_B.reshape(-1, G)
            if G > 1:
                adv_B = np.asarray(losses.group_advantages(
                    jnp.asarray(rewards_BxG), scale=cfg.rl.adv_scale)).reshape(-1)
            else:   # group size 1 (OPD): a batch-mean baseline for any task-reward mix
                adv_B = rewards_B - rewards_B.mean()
            if cfg.rl.dynamic_sampling:
                keep_B = np.repeat(np.asarray(losses.dapo_group_filter(
                    jnp.asarray(rewards_BxG))), G).astype(np.int32)
                batch["mask"] = batch["mask"] * keep_B[:, None]
                metrics["dynamic_sampling/kept_frac"] = float(keep_B.mean())
            batch["adv"] = adv_B.astype(np.float32)
            teachers_W = ()
            if is_opd:
                weights = [cell_weights[cell_of(e.task)] for e in episodes]
                scored = scorer(episodes, weights, seqs)
                order = sorted(scored)
                onehot = np.asarray([[w.get(k, 0.0) for k in order] for w in weights],
                                    np.float32)     # [B, S]: one-hot unless routing=mixture
                batch["teacher_onehot"] = onehot
                if scorer.kind == "logp":
                    tl = np.zeros(batch["mask"].shape, np.float32)
                    for key in order:
                        rows, vals, _ = scored[key]
                        tl[rows] = np.asarray(vals)[rows]
                    batch["teacher_logp"] = tl
                else:
                    # Rows a teacher does not score hold zeros (the scorer's; masked out in
                    # the loss).
                    batch["teacher_hidden"] = tuple(scored[k][1] for k in order)
                    batch["teacher_weights"] = onehot
                    teachers_W = tuple(scored[k][2] for k in order)
                metrics["teachers_loaded"] = float(len(bank.loaded()))
            batch = sh.shard_batch(batch, mesh, rules)
            lp = score(state.params, state.rest, batch)
            batch["old_logp"] = lp["logp"]
            batch["old_logp_plain"] = lp["logp_plain"]    # T = 1: the OPD teacher comparison
            metrics["entropy"] = float(losses.masked_mean(lp["entropy"], batch["mask"]))
            if ref_params is not None:
                batch["ref_logp"] = score(ref_params, state.rest, batch)["logp"]
            mb = minibatch_rows
            rng = np.random.default_rng(cfg.seed * 7919 + it)
            for _ in range(cfg.rl.ppo_epochs):
                perm = rng.permutation(len(episodes))
                for k in range(cfg.rl.minibatches):
                    idx = np.sort(perm[k * mb:(k + 1) * mb])
                    sub = sh.shard_batch(jax.tree.map(lambda x: x[idx], batch), mesh, rules)
                    state, m = step_fn(len(teachers_W))(state, sub, teachers_W)
                    guard.check(int(state.step), m, last_checkpoint=ckpt.latest_step())
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            if is_opd:   # slot s of this iteration -> the teacher's key, stable across steps
                m = {_teacher_name(k, order): v for k, v in m.items()}
            metrics |= m
            n_tok = sum(e.sampled_tokens for e in episodes)
            metrics["tokens_per_s"] = n_tok / max(time.time() - t0, 1e-9)
            done = it + 1
            if (cfg.eval.every and done % cfg.eval.every == 0) or done == steps:
                eval_rows, em = run_eval(state)
                metrics |= em
            history.append({"step": done, **metrics})
            if done % cfg.train.log_every == 0 or done == steps:
                writer.write(done, metrics)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            if done % cfg.train.ckpt_every == 0 or done == steps:
                ckpt.save(int(state.step), state, task_iter, meta | {"iteration": done})
    finally:
        ckpt.close()
        writer.close()
    if eval_rows is not None and jax.process_index() == 0:
        evaluate.write_rows(eval_rows, os.path.join(workdir, "eval"))
    if bank is not None and jax.process_index() == 0:
        with open(os.path.join(workdir, "teacher_cache.json"), "w", encoding="utf-8") as f:
            json.dump({"stats": bank.stats, "events": bank.events}, f, indent=2)
    return {"history": history, "checkpoint": ckpt.directory, "eval": eval_rows,
            "teacher_cache": bank.stats if bank else None}


def _teacher_name(metric: str, order: list[str]) -> str:
    """"teacher1/kl" -> "teacher/<key of slot 1>/kl"; other metrics unchanged."""
    head, _, rest = metric.partition("/")
    if head.startswith("teacher") and head[7:].isdigit() and rest:
        return f"teacher/{order[int(head[7:])]}/{rest}"
    return metric


def heldout_metrics(rows: list[dict], cell_keys: dict[str, str]) -> dict:
    """heldout/<cell>/{reward,pass_rate,length}, heldout/reward, teacher/<key>/heldout_reward."""
    out = {"heldout/reward": float(np.mean([r["reward"] for r in rows]))}
    by_key = defaultdict(list)
    for r in rows:
        for k in ("reward", "pass_rate", "length"):
            out[f"heldout/{r['cell']}/{k}"] = r[k]
        if r["cell"] in cell_keys:
            by_key[cell_keys[r["cell"]]].append(r["reward"])
    out |= {f"teacher/{k}/heldout_reward": float(np.mean(v)) for k, v in by_key.items()}
    return out


def _reward_metrics(episodes) -> dict:
    by_cell = defaultdict(list)
    for e in episodes:
        by_cell[cell_of(e.task)].append(e.reward)
    out = {"reward/mean": float(np.mean([e.reward for e in episodes])),
           "response_len": float(np.mean([e.sampled_tokens for e in episodes]))}
    out |= {f"reward/{c}": float(np.mean(v)) for c, v in by_cell.items()}
    return out
