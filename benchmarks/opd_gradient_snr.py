"""How good is one minibatch's OPD gradient? Cosine with the exact big-batch gradient.

    PYTHONPATH=. python benchmarks/opd_gradient_snr.py --workdir runs/kimi_k3/seed0

At the kimi_k3 student's start (a finished kimi_k3 seed workdir: the task-arithmetic merge
``merge_1`` and the six cell teachers ``rl_<domain>_<effort>``, on the dosed base), the
student samples --rollouts episodes on train-split prompts of every cell (temperature 1, the
preset's student sampling and think budgets), each scored with full logits by its cell's
teacher, and the reference direction is the exact gradient of the full-vocabulary reverse KL
over all of them (token mean). For minibatches of --minibatch rollouts it prints the mean
cosine (± standard error over --draws random minibatches) of each estimator with that
direction:

* ``full``: the full-vocabulary reverse KL on the minibatch (its noise is only which
  prompts and prefixes were drawn);
* ``r<R>``: the sampled-token signal (Kimi, Eq. 15): -sg(clip(lp_T - lp, -R, R)) * lp at the
  sampled tokens; ``rinf`` unclipped (GLM's advantage at group size 1); ``+b``: minus the
  minibatch-mean signal (a constant baseline, unbiased).

A cosine half as large means about four times the rollouts per step for the same
signal-to-noise.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax import envs
from opd_jax.config import load_config
from opd_jax.episodes import SamplingConfig, play
from opd_jax.episodes.sequences import build_sequences
from opd_jax.models import ModelRef, build_tokenizer
from opd_jax.recipes import recipe_module
from opd_jax.recipes.pipeline import stage_dir
from opd_jax.trainers.evaluate import heldout_tasks

R_MAX = (5.0, 2.0, 1.0, 0.5, None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a finished kimi_k3 seed workdir")
    p.add_argument("--config", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "experiments", "kimi_k3", "config.py") + ":reduced")
    p.add_argument("--seed", type=int, default=0, help="the workdir's seed (its stage plan)")
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--minibatch", type=int, nargs="+", default=[16, 64])
    p.add_argument("--draws", type=int, default=8)
    a = p.parse_args(argv)
    c = load_config(a.config)
    plan = {s.name: s for s in recipe_module(c.recipe).build(c, a.seed)}["student"]
    missing = [n for n in (plan.init_from, *plan.teachers.values())
               if not os.path.isdir(stage_dir(a.workdir, n))]
    if missing:
        raise FileNotFoundError(f"--workdir {a.workdir!r} lacks the stages {missing}: expected "
                                f"a finished {c.recipe} seed workdir")
    tok = build_tokenizer(c.tokenizer)
    student = ModelRef(stage_dir(a.workdir, plan.init_from)).load()
    teachers = {cell: ModelRef(stage_dir(a.workdir, n)).load() for cell, n in plan.teachers.items()}
    tc = plan.config.tasks
    per_cell = a.rollouts // len(teachers)
    tasks = [t for d, fam in dict(tc.families).items() for e in tc.efforts
             for t in heldout_tasks({d: fam}, (e,), n=per_cell, seed=a.seed,
                                    difficulty=tc.difficulty, split="train")]
    eps = play(student, tok, tasks, SamplingConfig(**dict(plan.config.rollout.sampling)),
               seed=1)
    b = build_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps],
                        response_masks=[e.response_mask for e in eps])
    inputs, targets = jnp.asarray(b["inputs"]), jnp.asarray(b["targets"])
    seg, mask = jnp.asarray(b["segment_ids"]), jnp.asarray(b["mask"], jnp.float32)
    cell = np.asarray([envs.cell_of(e.task) for e in eps])
    teacher_lp = None
    for name, t in teachers.items():
        lp = jax.nn.log_softmax(t(inputs, segment_ids_BxT=seg), -1)
        rows = jnp.asarray(cell == name)[:, None, None]
        teacher_lp = jnp.where(rows, lp, 0.0 if teacher_lp is None else teacher_lp)
    print(f"{len(eps)} rollouts ({per_cell} per cell), {int(mask.sum())} sampled tokens, "
          f"on-policy pass rate {np.mean([float(e.info.get('correct', 0.0)) for e in eps]):.3f}")

    graphdef, params, rest = nnx.split(student, nnx.Param, ...)

    def logp(p_, idx):
        model = nnx.merge(graphdef, p_, rest)
        return jax.nn.log_softmax(model(inputs[idx], segment_ids_BxT=seg[idx]), -1)

    def full_vocab(p_, idx):
        lp, m = logp(p_, idx), mask[idx]
        kl = jnp.sum(jnp.exp(lp) * (lp - teacher_lp[idx]), -1)
        return jnp.sum(kl * m) / jnp.sum(m)

    def sampled(p_, idx, r_max, baseline):
        lp, m, y = logp(p_, idx), mask[idx], targets[idx][..., None]
        lp_y = jnp.take_along_axis(lp, y, -1)[..., 0]
        r = jax.lax.stop_gradient(jnp.take_along_axis(teacher_lp[idx], y, -1)[..., 0] - lp_y)
        if r_max is not None:
            r = jnp.clip(r, -r_max, r_max)
        if baseline:
            r = r - jnp.sum(r * m) / jnp.sum(m)
        return -jnp.sum(r * lp_y * m) / jnp.sum(m)

    def flat(g):
        return jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])

    exact = flat(jax.jit(jax.grad(full_vocab))(params, jnp.arange(len(eps))))
    grads = {"full": jax.jit(jax.grad(full_vocab))}
    for r_max in R_MAX:
        for baseline in (False, True):
            name = "r" + ("inf" if r_max is None else f"{r_max:g}") + ("+b" if baseline else "")
            grads[name] = jax.jit(jax.grad(lambda p_, i, r=r_max, bl=baseline:
                                           sampled(p_, i, r, bl)))
    rng = np.random.default_rng(0)
    print("| estimator | " + " | ".join(f"cosine, {m} rollouts" for m in a.minibatch) + " |")
    print("|---|" + "---:|" * len(a.minibatch))
    draws = {m: [jnp.asarray(rng.choice(len(eps), m, replace=False)) for _ in range(a.draws)]
             for m in a.minibatch}
    for name, fn in grads.items():
        cells = []
        for m in a.minibatch:
            cos = [float(jnp.vdot(g, exact) / (jnp.linalg.norm(g) * jnp.linalg.norm(exact)))
                   for g in (flat(fn(params, idx)) for idx in draws[m])]
            cells.append(f"{np.mean(cos):.3f} ± {np.std(cos, ddof=1) / np.sqrt(len(cos)):.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
