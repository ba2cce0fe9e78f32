"""How good is one minibatch's OPD gradient? Cosine with the exact big-batch gradient.

    PYTHONPATH=. python benchmarks/opd_gradient_snr.py --workdir runs/learning_check

On the `learning_check` toy (its student and two specialists, built in --workdir unless
already there), the student samples --rollouts episodes (temperature 1, both cells), the
routed teacher scores them with full logits, and the reference direction is the exact
gradient of the full-vocabulary reverse KL over all of them (token mean). For minibatches of
--minibatch rollouts it prints the mean cosine (± standard error over --draws random
minibatches) of each estimator with that direction:

* ``full``: the full-vocabulary reverse KL on the minibatch (its noise is only which
  prompts and prefixes were drawn);
* ``r<R>``: the sampled-token signal (Kimi, Eq. 15): -sg(clip(lp_T - lp, -R, R)) * lp at the
  sampled tokens; ``rinf`` unclipped (GLM's advantage at group size 1); ``+b``: minus the
  minibatch-mean signal (a constant baseline, unbiased).

A cosine half as large means about four times the rollouts per step for the same
signal-to-noise; this is why `learning_check.SETTINGS` give the sampled-token objectives
four times the full-vocabulary objective's prompts.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

R_MAX = (5.0, 2.0, 1.0, 0.5, None)


def main(argv=None) -> None:
    from opd_jax import envs
    from opd_jax.models import synthetic_tokenizer
    from studies import learning_check as lc
    from opd_jax.models import ModelRef
    from opd_jax.episodes import SamplingConfig, play
    from opd_jax.episodes.sequences import build_sequences

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--minibatch", type=int, nargs="+", default=[16, 64])
    p.add_argument("--draws", type=int, default=8)
    a = p.parse_args(argv)
    saved = os.path.join(a.workdir, "models.json")
    if os.path.exists(saved):
        with open(saved, encoding="utf-8") as f:
            models = json.load(f)
    else:
        models = lc.setup(a.workdir)
        with open(saved, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in models.items() if k != "student_rewards"}, f)

    tok = synthetic_tokenizer()
    student = ModelRef(models["student"]).load()
    teachers = {d: ModelRef(path).load() for d, path in models["teachers"].items()}
    tasks = [t for fam in lc.FAMILIES.values()
             for t in envs.TaskSource(fam, size=a.rollouts // len(lc.FAMILIES), seed=0,
                                      effort="high", difficulty=lc.DIFFICULTY)]
    eps = play(student, tok, tasks, SamplingConfig(max_new_tokens=lc.MAX_NEW_TOKENS, max_turns=1), seed=1)
    b = build_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps],
                        response_masks=[e.response_mask for e in eps])
    inputs, targets = jnp.asarray(b["inputs"]), jnp.asarray(b["targets"])
    seg, mask = jnp.asarray(b["segment_ids"]), jnp.asarray(b["mask"], jnp.float32)
    domain = np.asarray([e.task.domain for e in eps])
    teacher_lp = None
    for d, t in teachers.items():
        lp = jax.nn.log_softmax(t(inputs, segment_ids_BxT=seg), -1)
        rows = jnp.asarray(domain == d)[:, None, None]
        teacher_lp = jnp.where(rows, lp, 0.0 if teacher_lp is None else teacher_lp)
    print(f"{len(eps)} rollouts, {int(mask.sum())} sampled tokens, on-policy reward "
          f"{np.mean([e.reward for e in eps]):.3f}")

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
