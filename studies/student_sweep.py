"""Why does the kimi_k3 student keep so little of its teachers' gains? Student variants on a
finished run's teachers.

For each seed of a finished ``kimi_k3`` run, each variant re-trains the student stage from
that stage's own config (same start, teachers, cells, seed) with a patch: the objective, the
learning rate, the iterations, the rollouts per optimizer step, the rollout temperature.
Every variant is evaluated greedily on the run's own held-out problems of that seed (the
report's draw), so its rows are paired per problem with the run's start, teachers and
validation-tuned merge. The table gives, per variant, the pass rate and the share of the
teacher's gain kept per cell, the mean and worst share, student - merge, and what the
variant cost (optimizer steps, rollouts, FLOPs, wall seconds).

    opd-jax experiment --config experiments/kimi_k3/config.py:reduced --workdir runs/kimi_k3
    python -m studies.student_sweep --workdir runs/kimi_k3 --seeds 0 \
        --variants preset,full_vocab,seq_mean,one_minibatch,lr_2e-4,temp_0.7

A variant trains into ``<workdir>/seed<s>/sweep_<name>`` (resumes from its checkpoints;
finished evaluations are cached there). Results: ``<workdir>/student_sweep/results.json``
(every per-problem pass, with seeds, commit, command, wall time) and ``results.md`` (its
tables, written from it by this module); the committed copy is
``experiments/kimi_k3/student_sweep/``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import ml_collections
import numpy as np

from opd_jax import envs
from opd_jax.checkpoint import step_dirs
from opd_jax.config import load_config
from opd_jax.models import ModelRef, build_tokenizer, save_pretrained
from opd_jax.recipes import kimi_k3
from opd_jax.recipes.kimi_k3 import MERGE_K
from opd_jax.recipes import report as rp
from opd_jax.recipes.pipeline import Stage, run_stage, stage_dir
from opd_jax.teachers import merge_models
from opd_jax.trainers import compute as compute_lib
from opd_jax.trainers import config_schema

# name -> (what it changes, a nested patch of the student stage's config; a key written
# "=key" replaces that section whole instead of updating it). "preset" is the run's own
# student stage, not re-trained.
VARIANTS: dict[str, tuple[str, dict | None]] = {
    "preset": ("the preset's student (the run's own stage)", None),
    "full_vocab": ("full-vocabulary reverse KL (deepseek_full_vocab objective, routed per "
                   "cell), lr 3e-4 with cosine decay (the notebook-era setting)",
                   {"=objective": {"name": "deepseek_full_vocab", "options": {}},
                    "optim": {"lr": 3e-4, "schedule": "cosine"}}),
    "seq_mean": ("every sequence weighted equally (aggregation seq_mean), not every token",
                 {"objective": {"options": {"aggregation": "seq_mean"}}}),
    "one_minibatch": ("one optimizer step per iteration on all 64 rollouts, 60 iterations "
                      "(60 steps of 64 rollouts against 120 of 16)",
                      {"rl": {"minibatches": 1}, "train": {"steps": 60}}),
    "lr_2e-4": ("lr 2e-4", {"optim": {"lr": 2e-4}}),
    "temp_0.7": ("rollouts sampled at temperature 0.7 (the loss still compares the T = 1 "
                 "student with the teacher)",
                 {"rollout": {"sampling": {"temperature": 0.7}}}),
    "full_vocab_1e-3": ("full_vocab at lr 1e-3 with cosine decay (the specialists' SFT lr)",
                        {"=objective": {"name": "deepseek_full_vocab", "options": {}},
                         "optim": {"lr": 1e-3, "schedule": "cosine"}}),
    "full_vocab_60": ("full_vocab for 60 iterations",
                      {"=objective": {"name": "deepseek_full_vocab", "options": {}},
                       "optim": {"lr": 3e-4, "schedule": "cosine"}, "train": {"steps": 60}}),
    "iters_60": ("the preset for 60 iterations", {"train": {"steps": 60}}),
    "lr_5e-5_iters_60": ("the preset for 60 iterations at lr 5e-5 (the preset's summed lr in "
                         "twice the steps)", {"optim": {"lr": 5e-5}, "train": {"steps": 60}}),
    # "@init": where the student starts ("merge": the seed's validation-tuned merge of the
    # teachers, which the student is then compared with; "start": the shared start).
    "from_merge": ("the preset started from the validation-tuned merge", {"@init": "merge"}),
    "from_start": ("the preset started from the shared start (the presets before the "
                   "student started from the merge)", {"@init": "start"}),
    "from_merge_full_vocab": ("full_vocab started from the validation-tuned merge",
                              {"@init": "merge",
                               "=objective": {"name": "deepseek_full_vocab", "options": {}},
                               "optim": {"lr": 3e-4, "schedule": "cosine"}}),
    # The student from the merge wanders at its plateau at a constant lr (its in-run curves
    # rise by iteration 10, then move by more than their se between evaluations): does a
    # decaying lr, or larger batches per optimizer step, hold more of the gains?
    "merge_cosine": ("the preset (from the merge) with the lr decayed by cosine to 0.1x",
                     {"optim": {"schedule": "cosine"}}),
    "merge_cosine_iters_60": ("merge_cosine for 60 iterations (240 optimizer steps)",
                              {"optim": {"schedule": "cosine"}, "train": {"steps": 60}}),
    "merge_batch_2x_cosine": ("from the merge, 60 iterations of 64 prompts in 2 minibatches "
                              "(120 optimizer steps of 32 rollouts, twice the preset's), "
                              "lr 2e-4 decayed by cosine to 0.1x",
                              {"optim": {"schedule": "cosine", "lr": 2e-4},
                               "rl": {"minibatches": 2}, "train": {"steps": 60}}),
    "merge_batch_4x_cosine": ("from the merge, 60 iterations of 128 prompts in 2 minibatches "
                              "(120 optimizer steps of 64 rollouts, 4x the preset's), lr 2e-4 "
                              "decayed by cosine to 0.1x",
                              {"optim": {"schedule": "cosine", "lr": 2e-4},
                               "rollout": {"prompts_per_step": 128},
                               "rl": {"minibatches": 2}, "train": {"steps": 60}}),
    # Round 2 (seed 0 at 512 problems per cell: the cosine variants with 2x the preset's
    # compute kept 82% against the preset's 70%): more steps, or a larger lr.
    "merge_cosine_iters_120": ("merge_cosine for 120 iterations (480 optimizer steps of 16 "
                               "rollouts)", {"optim": {"schedule": "cosine"},
                                             "train": {"steps": 120}}),
    "merge_batch_2x_cosine_iters_120": ("merge_batch_2x_cosine for 120 iterations (240 "
                                        "optimizer steps of 32 rollouts)",
                                        {"optim": {"schedule": "cosine", "lr": 2e-4},
                                         "rl": {"minibatches": 2}, "train": {"steps": 120}}),
    "merge_batch_2x_cosine_3e-4": ("merge_batch_2x_cosine at lr 3e-4",
                                   {"optim": {"schedule": "cosine", "lr": 3e-4},
                                    "rl": {"minibatches": 2}, "train": {"steps": 60}}),
    # Round 3 (today's preset, 3 seeds: coding/low kept 63%, its in-run reverse KL to its
    # teacher barely falls while the other cells' does): a stronger or better-spread signal
    # on the few tokens that decide a problem, at the preset's cost.
    "r_max_10": ("the preset with the log-ratio clipped at 10 nats (preset 5)",
                 {"objective": {"options": {"r_max": 10.0}}}),
    # Round 5: a tighter clip. benchmarks/opd_gradient_snr.py at this student's start (seed 0's
    # merge and teachers, 64-rollout minibatches) measured the sampled-token gradient's cosine
    # with the exact one rising as the clip tightens: 0.36 at r_max 5, 0.40 at 2, 0.44 at 1.
    "r_max_1": ("the preset with the log-ratio clipped at 1 nat (preset 5)",
                {"objective": {"options": {"r_max": 1.0}}}),
    "r_max_0.5": ("the preset with the log-ratio clipped at 0.5 nats (preset 5)",
                  {"objective": {"options": {"r_max": 0.5}}}),
    "r_max_0.5_lr_2e-4": ("r_max_0.5 at lr 2e-4 (a better-aimed step may stand a larger one)",
                          {"objective": {"options": {"r_max": 0.5}}, "optim": {"lr": 2e-4}}),
    "group_4": ("the preset with 4 samples per prompt (16 prompts x 4 = the same 64 rollouts "
                "per iteration)", {"rollout": {"group_size": 4, "prompts_per_step": 16}}),
    "min_lr_0": ("the preset with the lr decayed by cosine to 0 (preset: to 0.1x)",
                 {"optim": {"min_lr_ratio": 0.0}}),
    "dense_ckpts": ("the preset with a checkpoint every 2 iterations, the last 16 kept "
                    "(the same training: for averaging the last iterates)",
                    {"train": {"ckpt_every": 2, "keep_checkpoints": 16}}),
    # A student that samples its own mode almost always (entropy ~0.07 nats/token) rarely
    # visits the token its teacher prefers where it is confidently wrong: rollouts at a
    # higher temperature expose it. The loss is unchanged (the T = 1 student against the
    # teacher); the mismatch correction is off, since IcePop would mask the very tokens the
    # temperature makes likelier (their T = 1 / sampler ratio falls below its 0.5 bound).
    "temp_1.3": ("the preset with rollouts sampled at temperature 1.3, no mismatch "
                 "correction", {"rollout": {"sampling": {"temperature": 1.3}},
                                "objective": {"options": {"correction": {"kind": None}}}}),
    "no_correction": ("the preset without the mismatch correction (temp_1.3's control)",
                      {"objective": {"options": {"correction": {"kind": None}}}}),
    "full_vocab_preset": ("full-vocabulary reverse KL at the preset's schedule and cost (a "
                          "row beside the Kimi student, never in its place)",
                          {"=objective": {"name": "deepseek_full_vocab", "options": {}}}),
    # Round 4 (for deepseek_v4's student, the full-vocabulary loss at the preset's cost kept
    # 87.1%, worst 76.9%): does the exact gradient go further with a larger lr or more steps?
    "full_vocab_2e-4": ("full_vocab_preset at lr 2e-4 (decayed by cosine to 0.1x)",
                        {"=objective": {"name": "deepseek_full_vocab", "options": {}},
                         "optim": {"lr": 2e-4}}),
    "full_vocab_3e-4": ("full_vocab_preset at lr 3e-4 (the notebook-era lr)",
                        {"=objective": {"name": "deepseek_full_vocab", "options": {}},
                         "optim": {"lr": 3e-4}}),
    "full_vocab_iters_120": ("full_vocab_preset for 120 iterations (480 optimizer steps)",
                             {"=objective": {"name": "deepseek_full_vocab", "options": {}},
                              "train": {"steps": 120}}),
    # Adam's second moment at b2 = 0.95 follows the sampled-token gradient's noise within
    # ~20 steps; a longer memory steadies the per-parameter step size.
    "b2_0.999": ("the preset with Adam b2 = 0.999 (preset 0.95)", {"optim": {"b2": 0.999}}),
    "lr_5e-5_iters_120": ("the preset at lr 5e-5 for 120 iterations (the preset's summed lr "
                          "in twice the steps)", {"optim": {"lr": 5e-5},
                                                  "train": {"steps": 120}}),
    # Not trained: is the plateau the last iterate's noise? The uniform average of the last
    # k checkpoints of dense_ckpts (which keeps one every 2 iterations).
    "dense_ckpts_avg_8": ("not trained: the uniform average of dense_ckpts' last 8 "
                          "checkpoints (iterations 46-60)", {"@average": ["dense_ckpts", 8]}),
    "dense_ckpts_avg_16": ("not trained: the uniform average of dense_ckpts' last 16 "
                           "checkpoints (iterations 30-60)", {"@average": ["dense_ckpts", 16]}),
    # Not a student: can one model of this size hold both specialists at all? SFT of the
    # start on the union of the specialists' demos (every domain, every effort) with their
    # summed steps; no RL, so the teachers' ladder gains on top of their SFT are not in it.
    "joint_sft": ("not OPD: SFT of the start on the union of the specialists' SFT data "
                  "(both domains), their summed steps, the specialists' lr",
                  {"@stage": "joint_sft"}),
}

# Variants the preset has since adopted (patches of today's preset that change nothing; their
# committed rows were measured against the preset of their commit).
ADOPTED = ("iters_60", "merge_cosine", "merge_cosine_iters_60")


def patched(cfg: dict, patch: dict) -> dict:
    """`cfg` updated by `patch` (nested update; a key "=k" replaces section k whole)."""
    out = json.loads(json.dumps(cfg))     # a deep copy, tuples as lists (config.json's form)
    for key, value in patch.items():
        if key.startswith("="):
            out[key[1:]] = value
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = patched(out[key], value)
        else:
            out[key] = value
    return out


def stage_name(variant: str) -> str:
    return "student" if variant == "preset" else f"sweep_{variant}"


def variant_stage(c: ml_collections.ConfigDict, seed: int, variant: str,
                  merge: str | None = None) -> Stage:
    """The seed's student stage with the variant's patch (the preset: the stage itself);
    its config checked before any work. `merge`: the seed's validation-tuned merge stage
    (for variants that start from it, "@init": "merge")."""
    if variant not in VARIANTS:
        raise KeyError(f"variant {variant!r}: expected one of {sorted(VARIANTS)}")
    student = next(s for s in kimi_k3.build(c, seed) if s.name == "student")
    patch = VARIANTS[variant][1]
    if patch is None:
        return student
    patch = dict(patch)
    if "@average" in patch:
        raise ValueError(f"variant {variant!r} averages another variant's checkpoints; it is "
                         f"no stage (train_variant writes it)")
    if patch.pop("@stage", None) == "joint_sft":      # the mixed-data baseline's SFT
        return Stage(stage_name(variant), "sft", kimi_k3.mixed_sft_config(c, seed),
                     init_from="sft" if c.sft.train.steps else None)
    init = patch.pop("@init", None)
    if init not in (None, "merge", "start"):
        raise ValueError(f"variant {variant!r}: @init={init!r}, expected 'merge' or 'start'")
    if init == "merge" and merge is None:
        raise ValueError(f"variant {variant!r} starts from the validation-tuned merge; "
                         f"give the seed's merge stage")
    cfg = ml_collections.ConfigDict(patched(student.config.to_dict(), patch))
    config_schema.validate(cfg, where=f"student_sweep variant {variant!r}")
    init_from = {"merge": merge, "start": "sft" if c.sft.train.steps else None,
                 None: student.init_from}[init]
    return dataclasses.replace(student, name=stage_name(variant), config=cfg,
                               init_from=init_from)


def average_checkpoints(stage_folder: str, k: int, out: str) -> None:
    """Write the uniform average of the last `k` checkpoints of a finished stage as an HF
    folder `out` (written beside it, then renamed: a killed write leaves no half model)."""
    dirs = step_dirs(stage_folder)
    if len(dirs) < k:
        raise ValueError(f"{stage_folder}: {len(dirs)} checkpoints kept, {k} to average "
                         f"(expected train.keep_checkpoints >= {k})")
    avg = merge_models([ModelRef(d).load() for d in dirs[-k:]], method="average")
    spec, fingerprint = ModelRef(stage_folder).tokenizer_identity()
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(avg, tmp, tokenizer={"spec": spec, "fingerprint": fingerprint})
    os.replace(tmp, out)


def train_variant(c: ml_collections.ConfigDict, sw: str, seed: int, variant: str,
                  merge: str | None = None) -> dict:
    """Train (or resume, or find done: the pipeline's `run_stage`, which refuses a finished
    folder run with other settings) a variant in seed folder `sw`; its cost record (an
    "@average" variant: its source's, after writing the average once)."""
    patch = VARIANTS[variant][1] or {}
    if "@average" in patch:
        source, k = patch["@average"]
        cost = train_variant(c, sw, seed, source, merge)
        out = stage_dir(sw, stage_name(variant))
        if not os.path.isfile(os.path.join(out, "model.safetensors")):
            average_checkpoints(stage_dir(sw, stage_name(source)), int(k), out)
        return cost
    rec = run_stage(variant_stage(c, seed, variant, merge), sw)
    comp = rec.get("compute") or {}
    return {"wall_s": rec["wall_s"], "optimizer_steps": rec["optimizer_steps"],
            "rollouts": comp.get("tokens", {}).get("rollouts", 0),
            "flops": comp.get("flops", {}).get("total", float("nan"))}


def run(c: ml_collections.ConfigDict, workdir: str, seeds, variants) -> dict:
    """Every variant of every seed, trained and evaluated: results.json's dict."""
    t0 = time.time()
    tok = build_tokenizer(c.tokenizer)
    cells = [(d, fam, e) for d, fam in dict(c.domains).items() for e in c.efforts]
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        if not os.path.isfile(os.path.join(stage_dir(sw, "student"), "done.json")):
            raise FileNotFoundError(f"{sw}: no finished kimi_k3 student stage; run the "
                                    f"experiment for seed {seed} first")
        stages = kimi_k3.build(c, seed)
        routed = kimi_k3.routed_teachers(stages)
        es = kimi_k3.eval_seed(c, seed)

        def evs(stage, cs, path=None):
            return rp.evaluate_stage(sw, stage, cs, c.eval, tokenizer=tok,
                                     difficulty=c.eval.difficulty, seed=es, n=c.eval.n,
                                     path=path)
        val = kimi_k3.merge_validation(c, sw, stages, seed, tok)
        merge = max(val, key=val.get)
        keep = lambda rows: {k: r["passes"] for k, r in rows.items()}
        models = {"start": keep(evs("start", cells, path=kimi_k3.start_path(c))),
                  "teacher": {envs.cell_name(d, e): evs(routed[envs.cell_name(d, e)],
                                                        [(d, fam, e)])[envs.cell_name(d, e)]
                              ["passes"] for d, fam, e in cells},
                  "merge": keep(evs(merge, cells))}
        costs = {}
        for v in variants:
            costs[v] = train_variant(c, sw, seed, v, merge)
            models[v] = keep(evs(stage_name(v), cells))
        per_seed.append({"seed": seed, "eval_seed": es, "merge_chosen": merge,
                         "models": models, "cost": costs})
    return {"seeds": list(seeds), "variants": {v: VARIANTS[v][0] for v in variants},
            "eval": rp.eval_meta(c.eval) | {"per_seed_problems": True},
            "per_seed": per_seed, "wall_s": round(time.time() - t0, 1)}


def summarize(results: dict) -> dict:
    """Per variant: pass, gain kept and student - merge per cell (pooled over seeds, paired
    per problem), the mean and worst gain kept, the mean cost per seed."""
    ps = results["per_seed"]
    cells = list(ps[0]["models"]["start"])
    pooled = lambda who, cell: [x for s in ps for x in s["models"][who][cell]]
    out = {}
    for v in results["variants"]:
        rows = {}
        for cell in cells:
            st, te, me, me_v = (pooled("start", cell), pooled("teacher", cell),
                                pooled("merge", cell), pooled(v, cell))
            gain = float(np.mean(te) - np.mean(st))
            rows[cell] = {"pass": float(np.mean(me_v)),
                          "kept": rp.ratio(float(np.mean(me_v) - np.mean(st)), gain)
                          if gain > 0 else float("nan"),
                          "vs_merge": rp.paired(me_v, me)}
        kept = [r["kept"] for r in rows.values()]
        beats = sum(rp.beats(r["vs_merge"], 0.0, MERGE_K) for r in rows.values())
        cost = {k: float(np.mean([s["cost"][v][k] for s in ps]))
                for k in ("wall_s", "optimizer_steps", "rollouts", "flops")}
        out[v] = {"cells": rows, "mean_kept": rp.finite_mean(kept), "beats_merge": int(beats),
                  "worst_kept": min((k for k in kept if np.isfinite(k)), default=float("nan")),
                  "cost": cost}
    ref = {m: {cell: float(np.mean(pooled(m, cell))) for cell in cells}
           for m in ("start", "teacher", "merge")}
    return {"variants": out, "reference": ref, "cells": cells}


def report_md(results: dict) -> str:
    s = summarize(results)
    cells, ref = s["cells"], s["reference"]
    n = results["eval"]["n"] * len(results["seeds"])
    lines = [f"# kimi_k3 student sweep (seeds {results['seeds']})", "",
             f"Command `{results['command']}`; commit {results['commit']}; wall "
             f"{results['wall_s']:.0f} s (this invocation; training seconds per variant "
             f"below). Pass rate on the run's held-out problems ({n} per cell, greedy, "
             f"difficulty {results['eval']['difficulty']}), paired per problem with the "
             f"run's start, teachers and validation-tuned merge; gain kept = (variant - "
             f"start) / (teacher - start).", "",
             rp.markdown_table(["model", *cells], [[m, *[f"{ref[m][c]:.3f}" for c in cells]]
                                                   for m in ("start", "teacher", "merge")]),
             "", "Pass rate / gain kept per cell:", ""]
    rows = [[v, *[f"{r['cells'][c]['pass']:.3f} / {r['cells'][c]['kept']:.0%}" for c in cells],
             f"{r['mean_kept']:.1%}", f"{r['worst_kept']:.1%}",
             f"{r['beats_merge']} of {len(cells)}"]
            for v, r in s["variants"].items()]
    lines += [rp.markdown_table(["variant", *cells, "mean kept", "worst kept",
                                 f"cells beating the merge beyond {MERGE_K:g} se"], rows), "",
              "Variant - merge (se) per cell, and cost per seed:", ""]
    rows = [[v, *[f"{r['cells'][c]['vs_merge']['diff']:+.3f} ({r['cells'][c]['vs_merge']['se']:.3f})"
                  for c in cells], f"{r['cost']['optimizer_steps']:.0f}",
             f"{r['cost']['rollouts']:.0f}", compute_lib.format_flops(r['cost']['flops']),
             f"{r['cost']['wall_s']:.0f}"] for v, r in s["variants"].items()]
    lines += [rp.markdown_table(["variant", *cells, "optimizer steps", "rollouts", "FLOPs",
                                 "wall s"], rows), "", "Variants:", ""]
    lines += [f"- `{v}`: {d}" for v, d in results["variants"].items()]
    return "\n".join(lines) + "\n"


def write_results(workdir: str, results: dict, command: str) -> str:
    out = os.path.join(workdir, "student_sweep")
    os.makedirs(out, exist_ok=True)
    results = {**results, "command": command, "commit": rp.code_commit()}
    rp.write_json(os.path.join(out, "results.json"), results)
    md = report_md(results)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(md)
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/kimi_k3")
    p.add_argument("--config", default="experiments/kimi_k3/config.py:reduced",
                   help="the kimi_k3 config (file:preset) the run used")
    p.add_argument("--seeds", default="0")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--eval-n", type=int, default=0,
                   help="held-out problems per cell and seed (0: the config's eval.n); more "
                        "than the run's own narrows the per-cell standard errors")
    args = p.parse_args(argv)
    seeds = tuple(int(x) for x in args.seeds.split(","))
    variants = tuple(args.variants.split(","))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; expected some of {sorted(VARIANTS)}")
    c = load_config(args.config)
    if args.eval_n < 0:
        raise SystemExit(f"--eval-n={args.eval_n}: expected >= 0 (0: the config's eval.n)")
    if args.eval_n:
        c.eval.n = args.eval_n
    results = run(c, args.workdir, seeds, variants)
    print(write_results(args.workdir, results,
                        "python -m studies.student_sweep " + " ".join(argv or sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
