"""Is OPD cheaper than the RL that made its teacher? Compute to 50 / 75 / 90% of a GRPO
teacher's gain, GRPO against full-vocabulary and sampled-token OPD, each at 3 learning rates.

From one start (the shipped base, ``builtin:base``) on one competing pair of cells (general/max:
chain, coding/max: code_trace, at the testbed's difficulty 3; kimi_k3 measured that each
domain's specialist loses on the other), per seed:

1. **The teacher**: GRPO on both cells from the start at each of GRPO_LRS (GRPO_ITERS
   iterations of 16 prompts x 4 samples, one optimizer step each, warmup 0), evaluated every
   EVAL_EVERY iterations on EVAL_N held-out problems per cell. The teacher is the run with the
   best pass rate on a validation draw of train-split problems (VAL_N per cell).
2. **The students**: from the same start, full-vocabulary OPD (``deepseek_full_vocab``) and the
   clipped sampled-token signal (``kimi_mopd``) distil that teacher on both cells, each at
   each of OPD_LRS (OPD_ITERS iterations of 64 rollouts, one optimizer step each, warmup 0),
   evaluated like the teacher on the same problems.

Every run's in-run curve is read against the teacher's gain on the same problems (the start
evaluated on them, the teacher's last evaluation); curves are pooled over seeds (mean pass
rate), the gain too. For every run and cell: the FLOPs (`opd_jax.trainers.compute`: 2N per
sampled token, 2N_T per teacher-scored token, 6N per trained token), rollouts and optimizer
steps by the first evaluation at 50 / 75 / 90% of the gain; the summed lr; for the teachers,
the distance travelled from the start (||theta_T - theta_0||) against the path length (the
summed per-step ``update_norm``). The claim (issue 32; the recipes' reports carry the same
claim for their students): each OPD objective, at its best lr, holds 90% of the teacher's gain
on every cell having spent <= 1/5 of the FLOPs of the teacher's whole GRPO run.

    python -m studies.speed_study --workdir runs/speed --seeds 0,1,2

Runs resume (each is a pipeline stage under ``<workdir>/seed<s>/``); a seed whose runs are
not all finished is left out of the report, so a partial run still reports the seeds it has.
Writes ``<workdir>/speed_study/{results.json,results.md,pass_vs_flops.png}``; the committed
copy is ``experiments/speed_study/``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import ml_collections
import numpy as np
from flax import nnx

from opd_jax import envs
from opd_jax.config import load_config
from opd_jax.models import ModelRef, build_tokenizer
from opd_jax.recipes import kimi_k3
from opd_jax.recipes import report as rp
from opd_jax.recipes import trainer_config
from opd_jax.recipes.pipeline import Stage, is_done, run_stage, stage_dir
from opd_jax.trainers.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The testbed's GRPO and OPD stage settings (token budgets, sampling, rollout sizes): kimi_k3's.
CONFIG = os.path.join(ROOT, "experiments", "kimi_k3", "config.py") + ":reduced"
DOMAINS = {"general": "chain", "coding": "code_trace"}
EFFORT = "max"
CELLS = [(d, fam, EFFORT) for d, fam in DOMAINS.items()]
NAMES = [envs.cell_name(d, e) for d, _, e in CELLS]
GRPO_LRS = (5e-5, 1e-4, 2e-4)
OPD_LRS = {"deepseek_full_vocab": (5e-5, 1e-4, 2e-4), "kimi_mopd": (5e-5, 1e-4, 2e-4)}
GRPO_ITERS, OPD_ITERS = 60, 40
EVAL_EVERY, EVAL_N, VAL_N = 2, 128, 64
SHARES = (0.5, 0.75, 0.9)
CLAIM_SHARE, CLAIM_RATIO = 0.9, 5.0


def run_name(method: str, lr: float) -> str:
    return f"{method}_{lr:g}"


def _policy(section: ml_collections.ConfigDict, seed: int, lr: float,
            iterations: int) -> ml_collections.ConfigDict:
    cfg = kimi_k3.stage_config(section, seed, DOMAINS, (EFFORT,))
    cfg.train.update(dict(steps=iterations, ckpt_every=10))
    cfg.optim.update(dict(lr=lr, warmup_steps=0, schedule="constant"))
    cfg.rl.minibatches = 1
    cfg.eval.update(dict(every=EVAL_EVERY, n=EVAL_N))
    return cfg


def grpo_stage(c: ml_collections.ConfigDict, seed: int, lr: float) -> Stage:
    return Stage(run_name("grpo", lr), "grpo", _policy(c.teacher, seed, lr, GRPO_ITERS))


def opd_stage(c: ml_collections.ConfigDict, seed: int, objective: str, lr: float,
              teacher: str) -> Stage:
    if objective not in OPD_LRS:
        raise ValueError(f"objective {objective!r}: expected one of {sorted(OPD_LRS)}")
    cfg = _policy(c.student, seed, lr, OPD_ITERS)
    cfg.objective = trainer_config(f"opd.py:{objective}").objective
    cfg.teachers.routing = "cell"
    return Stage(run_name(objective, lr), "opd", cfg,
                 teachers={cell: teacher for cell in NAMES})


def _evaluate(c, sw: str, name: str, tokenizer, *, path=None, split="eval", n=EVAL_N,
              seed: int) -> dict:
    """{cell: row} of a run (or the start, `path`) on the in-run problems of `seed` (the
    problems its training evaluated: eval split, tasks.seed + eval.seed = seed) or on a
    validation draw (`split="train"`)."""
    ev = ml_collections.ConfigDict(c.teacher.eval.to_dict())
    return rp.evaluate_stage(sw, name, CELLS, ev, tokenizer=tokenizer,
                             difficulty=c.eval.difficulty, path=path, split=split,
                             seed=seed, n=n)


def choose_teacher(c, sw: str, seed: int, tokenizer) -> tuple[str, dict]:
    """The GRPO run with the best mean pass rate on the seed's validation draw (train split,
    disjoint from the evaluation problems), and every run's score."""
    val = {run_name("grpo", lr): float(np.mean([r["pass_rate"] for r in _evaluate(
        c, sw, run_name("grpo", lr), tokenizer, split="train", n=VAL_N,
        seed=kimi_k3.validation_seed(c, seed)).values()])) for lr in GRPO_LRS}
    return max(val, key=val.get), val


def params_distance(a: str, b: str) -> float:
    """||theta_a - theta_b|| over every parameter of two checkpoints (paths or builtin:)."""
    pa, pb = (nnx.state(ModelRef(p).load(), nnx.Param) for p in (a, b))
    sq = jax.tree.map(lambda x, y: float(np.sum((np.asarray(x, np.float64)
                                                 - np.asarray(y, np.float64)) ** 2)), pa, pb)
    return float(np.sqrt(sum(jax.tree.leaves(sq))))


def run_record(sw: str, stage: Stage) -> dict:
    """A finished run: its cost, its in-run pass-rate curves, the summed lr and path length."""
    cost = rp.stage_cost(sw, stage)
    metrics = read_metrics(stage_dir(sw, stage.name))
    per_step = {m["step"]: m for m in metrics}
    steps_per_iter = cost["optimizer_steps"] / cost["iterations"]
    return {"stage": stage.name, "kind": stage.kind, "lr": float(stage.config.optim.lr),
            "cost": cost, "rollouts_per_iteration": int(stage.config.rollout.prompts_per_step
                                                        * stage.config.rollout.group_size),
            "optimizer_steps_per_iteration": steps_per_iter,
            # constant lr, no warmup (`_policy`): lr x optimizer steps
            "summed_lr": float(stage.config.optim.lr) * cost["optimizer_steps"],
            "path_length": float(sum(m.get("update_norm", float("nan"))
                                     for m in per_step.values()) * steps_per_iter),
            "curves": {cell: rp.curve(sw, stage.name, f"heldout/{cell}/pass_rate")
                       for cell in NAMES}}


def seed_plan(c, seed: int, teacher: str | None) -> list[Stage]:
    """The seed's runs: the GRPO teachers, then (once the teacher is chosen) the students."""
    out = [grpo_stage(c, seed, lr) for lr in GRPO_LRS]
    if teacher is not None:
        out += [opd_stage(c, seed, obj, lr, teacher) for obj, lrs in OPD_LRS.items()
                for lr in lrs]
    return out


def run_seed(c, workdir: str, seed: int, tokenizer, *, progress: bool = True) -> None:
    sw = os.path.join(workdir, f"seed{seed}")
    for stage in seed_plan(c, seed, None):
        print(f"seed {seed}: {stage.name}", flush=True)
        run_stage(stage, sw, progress=progress)
    teacher, val = choose_teacher(c, sw, seed, tokenizer)
    print(f"seed {seed}: teacher {teacher} (validation pass {val})", flush=True)
    for stage in seed_plan(c, seed, teacher)[len(GRPO_LRS):]:
        print(f"seed {seed}: {stage.name}", flush=True)
        run_stage(stage, sw, progress=progress)


def collect(c, workdir: str, seeds, tokenizer) -> dict:
    """Every finished seed's runs into results.json's dict (seeds with an unfinished run are
    listed under ``incomplete``)."""
    per_seed, incomplete = [], []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        grpo = seed_plan(c, seed, None)
        if not all(is_done(sw, s.name) for s in grpo):
            incomplete.append(seed)
            continue
        teacher, val = choose_teacher(c, sw, seed, tokenizer)
        plan = seed_plan(c, seed, teacher)
        if not all(is_done(sw, s.name) for s in plan):
            incomplete.append(seed)
            continue
        start = _evaluate(c, sw, "start", tokenizer, path=kimi_k3.start_path(c), seed=seed)
        runs = {s.name: run_record(sw, s) for s in plan}
        t = runs[teacher]
        t["distance"] = params_distance(stage_dir(sw, teacher), kimi_k3.start_path(c))
        per_seed.append({"seed": seed, "teacher": teacher, "validation": val,
                         "start": {cell: start[cell]["pass_rate"] for cell in NAMES},
                         "runs": runs})
    return {"study": "speed_study", "seeds": [s["seed"] for s in per_seed],
            "incomplete": incomplete, "cells": NAMES, "shares": list(SHARES),
            "eval": {"n": EVAL_N, "every": EVAL_EVERY, "difficulty": c.eval.difficulty},
            "per_seed": per_seed}


# -- the table and the claim, from results.json alone --------------------------------------
def methods(results: dict) -> dict[str, list[str]]:
    """method -> its runs' names (one per lr), in order."""
    names = list(results["per_seed"][0]["runs"])
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(n.rsplit("_", 1)[0], []).append(n)
    return out


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def gains(results: dict) -> dict[str, dict]:
    """Per cell: the start and each seed's teacher (its last evaluation), pooled."""
    out = {}
    for cell in results["cells"]:
        start = _mean([s["start"][cell] for s in results["per_seed"]])
        teacher = _mean([s["runs"][s["teacher"]]["curves"][cell][1][-1]
                         for s in results["per_seed"]])
        out[cell] = {"start": start, "teacher": teacher, "gain": teacher - start}
    return out


def reach(results: dict, run: str) -> dict[str, dict]:
    """Per cell: the pooled curve of `run` as shares of the teacher's gain and, per share of
    SHARES, the first evaluated iteration there with the FLOPs, rollouts and optimizer steps
    spent by then (means over seeds; None: never reached)."""
    seeds, g = results["per_seed"], gains(results)
    recs = [s["runs"][run] for s in seeds]
    flops_it = _mean([r["cost"]["flops"] / r["cost"]["iterations"] for r in recs])
    out = {}
    for cell in results["cells"]:
        its, mean = rp.pooled_curve([r["curves"][cell] for r in recs])
        gain = g[cell]["gain"]
        share = [(m - g[cell]["start"]) / gain if gain > 0 else float("nan") for m in mean]
        row = {"iterations": its, "pass": mean, "share": share,
               "flops_per_iteration": flops_it}
        for q in results["shares"]:
            it = next((i for i, s in zip(its, share) if s >= q), None)
            row[f"{q:g}"] = None if it is None else {
                "iteration": it, "flops": flops_it * it,
                "rollouts": recs[0]["rollouts_per_iteration"] * it,
                "optimizer_steps": recs[0]["optimizer_steps_per_iteration"] * it}
        out[cell] = row
    return out


def teacher_flops(results: dict) -> float:
    """The FLOPs of the teachers' whole GRPO runs, mean over seeds."""
    return _mean([s["runs"][s["teacher"]]["cost"]["flops"] for s in results["per_seed"]])


def best_run(results: dict, method: str) -> str:
    """A method's best lr: the fewest FLOPs to CLAIM_SHARE on its slower cell; when no lr
    gets there on every cell, the best worst-cell share at the end."""
    def key(run):
        r = reach(results, run)
        hits = [r[cell][f"{CLAIM_SHARE:g}"] for cell in results["cells"]]
        if all(hits):
            return (0, max(h["flops"] for h in hits))
        return (1, -min(r[cell]["share"][-1] for cell in results["cells"]))
    return min(methods(results)[method], key=key)


def claims(results: dict) -> list[dict]:
    out = []
    budget = teacher_flops(results) / CLAIM_RATIO
    for method in methods(results):
        if method == "grpo":
            continue
        run = best_run(results, method)
        r = reach(results, run)
        hits = {cell: r[cell][f"{CLAIM_SHARE:g}"] for cell in results["cells"]}
        said = "; ".join(
            f"{cell} never in {r[cell]['iterations'][-1]} iterations (best share "
            f"{max(r[cell]['share']):.0%})" if h is None else
            f"{cell} at iteration {h['iteration']}: {h['flops']:.2e} FLOPs "
            f"({h['flops'] / teacher_flops(results):.2f} of the teacher's)"
            for cell, h in hits.items())
        out.append({"claim": f"{method} at its best lr ({run}) holds {CLAIM_SHARE:.0%} of the "
                             f"teacher's gain on every cell within 1/{CLAIM_RATIO:g} of the "
                             f"FLOPs of the teacher's GRPO run",
                    "pass": all(h is not None and h["flops"] <= budget for h in hits.values()),
                    "measured": said + f"; the teacher's run {teacher_flops(results):.2e}"})
    return out


def write_markdown(path: str, results: dict) -> None:
    seeds, g = results["seeds"], gains(results)
    cells = results["cells"]
    teacher = teacher_flops(results)
    head = ["run", "lr", "summed lr"] + [f"{cell}: {q:.0%} at (FLOPs / rollouts / steps)"
                                         for cell in cells for q in results["shares"]] \
        + [f"{cell} final share" for cell in cells]
    rows = []
    for method, runs in methods(results).items():
        for run in runs:
            rec = [s["runs"][run] for s in results["per_seed"]]
            r = reach(results, run)
            cols = []
            for cell in cells:
                for q in results["shares"]:
                    h = r[cell][f"{q:g}"]
                    cols.append("never" if h is None else
                                f"{h['flops']:.1e} ({h['flops'] / teacher:.2f}x) / "
                                f"{h['rollouts']:.0f} / {h['optimizer_steps']:.0f}")
            rows.append([run, f"{rec[0]['lr']:g}", f"{_mean([x['summed_lr'] for x in rec]):.2e}",
                         *cols, *[f"{r[cell]['share'][-1]:.0%}" for cell in cells]])
    tchr = []
    for s in results["per_seed"]:
        t = s["runs"][s["teacher"]]
        tchr.append([s["seed"], s["teacher"],
                     ", ".join(f"{k} {v:.3f}" for k, v in s["validation"].items()),
                     f"{t['distance']:.2f}", f"{t['path_length']:.2f}",
                     # NaN for a teacher that never moved (every group's rewards tied)
                     f"{rp.ratio(t['distance'], t['path_length']):.2f}"])
    md = [f"# speed_study ({len(seeds)} seed(s): {seeds}"
          + (f"; unfinished: {results['incomplete']}" if results["incomplete"] else "") + ")",
          "", rp.provenance_line(results["provenance"]), "",
          f"From `builtin:base` on {', '.join(cells)} (difficulty "
          f"{results['eval']['difficulty']}). "
          f"Pass rate on {results['eval']['n']} held-out problems per cell and seed (each seed its "
          f"own), evaluated every {results['eval']['every']} iterations; curves and gains pooled "
          f"over seeds. Start and teacher (its last evaluation) on the same problems:", "",
          rp.markdown_table(["cell", "start", "teacher", "gain"],
                            [[cell, f"{v['start']:.3f}", f"{v['teacher']:.3f}",
                              f"{v['gain']:+.3f}"] for cell, v in g.items()]), "",
          f"Every run: the first evaluation at 50 / 75 / 90% of the teacher's gain, with the "
          f"FLOPs spent by then (and as a multiple of the teacher's whole GRPO run, "
          f"{teacher:.2e} FLOPs), the rollouts and the optimizer steps. One optimizer step "
          f"per iteration, warmup 0, constant lr.", "",
          rp.markdown_table(head, rows), "",
          "## The teachers", "",
          rp.markdown_table(["seed", "teacher", "validation pass rate (train split)",
                             "distance from the start", "path length", "distance / path"],
                            tchr), "",
          "Distance: ||theta_T - theta_0|| over every parameter; path length: the summed norm "
          "of the optimizer's updates.", "", "## Claims", ""]
    md += rp.claim_lines(results["claims"])
    md += ["", "![pass rate against FLOPs](pass_vs_flops.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))


def plot(out_dir: str, results: dict) -> None:
    """pass_vs_flops.png: per cell, pooled pass rate against FLOPs spent, for the teachers'
    GRPO runs and each OPD objective at its best lr."""
    g = gains(results)
    panels = {}
    for cell in results["cells"]:
        lines = []
        for method, runs in methods(results).items():
            for run in (runs if method == "grpo" else [best_run(results, method)]):
                r = reach(results, run)[cell]
                lines.append({"x": [i * r["flops_per_iteration"] for i in r["iterations"]],
                              "y": r["pass"], "label": run})
        lines += [{"y": g[cell]["teacher"], "label": "teacher", "color": "k"},
                  {"y": g[cell]["start"], "label": "start", "color": "gray"},
                  {"y": g[cell]["start"] + CLAIM_SHARE * g[cell]["gain"],
                   "label": f"{CLAIM_SHARE:.0%} of the gain", "color": "r"}]
        panels[cell] = lines
    rp.plot_curves(os.path.join(out_dir, "pass_vs_flops.png"), panels,
                   title="speed_study: held-out pass rate against compute (mean over seeds)",
                   ylabel="held-out pass rate", xlabel="FLOPs", xscale="log")


def report(c, workdir: str, seeds, tokenizer, command: str) -> dict:
    t0 = time.time()
    results = collect(c, workdir, seeds, tokenizer)
    if not results["per_seed"]:
        raise RuntimeError(f"no seed of {list(seeds)} has finished every run in {workdir}")
    results["claims"] = claims(results)
    results["provenance"] = {"command": command, "commit": rp.code_commit(),
                             "stages_wall_s": round(sum(
                                 r["cost"]["wall_s"] for s in results["per_seed"]
                                 for r in s["runs"].values()), 1),
                             "eval_wall_s": round(time.time() - t0, 1)}
    out = os.path.join(workdir, "speed_study")
    os.makedirs(out, exist_ok=True)
    rp.write_json(os.path.join(out, "results.json"), results)
    write_markdown(os.path.join(out, "results.md"), results)
    plot(out, results)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/speed_study")
    p.add_argument("--config", default=CONFIG,
                   help="the experiment config whose teacher and student sections set the "
                        "runs' testbed settings")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--report-only", action="store_true",
                   help="only rebuild the report from finished runs")
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    c = ml_collections.ConfigDict(load_config(a.config).to_dict())
    tokenizer = build_tokenizer(c.tokenizer)
    command = "python -m studies.speed_study " + " ".join(sys.argv[1:] if argv is None else argv)
    if not a.report_only:
        for seed in seeds:
            run_seed(c, a.workdir, seed, tokenizer)
    results = report(c, a.workdir, seeds, tokenizer, command)
    print("\n".join(rp.claim_lines(results["claims"])))
    print(f"wrote {os.path.join(a.workdir, 'speed_study', 'results.md')}")


if __name__ == "__main__":
    main()
