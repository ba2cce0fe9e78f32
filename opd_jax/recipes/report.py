"""Evaluation of experiment stages, results tables (JSON and markdown) and plots.

`report` is every recipe's report; a recipe module supplies the recipe-specific parts:

* ``build(c, seed) -> [Stage]``: the stages of one seed;
* ``collect(c, workdir, seeds, tokenizer) -> results``: evaluates the stages
  (`evaluate_stage`) into the results dict (no claims, no provenance). Its key order is
  results.json's; "claims" and "provenance" follow unless it holds a ``"provenance": None``
  placeholder where results.json keeps it;
* ``claims(results) -> [claim]``: the claims, from the results dict alone;
* ``write_markdown(path, results)``: results.md, from the results dict alone;
* ``plot(c, workdir, results)``: its PNG figures.

Each evaluated (stage, cells, difficulty, problems, sampling) is cached in the stage folder
as ``eval_<tag>.json``, so re-running a finished experiment only rebuilds its report; the
tag names everything the rows depend on, so another ``eval.n`` or sampling setting
evaluates again instead of reading rows of other problems.
The plots (``plot_curves``, ``plot_bars``) are :mod:`opd_jax.plotting.recipes`'.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence

import numpy as np

from opd_jax import envs
from opd_jax.episodes import SamplingConfig
from opd_jax.models import ModelRef
from opd_jax.plotting.recipes import plot_bars, plot_curves  # noqa: F401  (rp.plot_*)
from opd_jax.recipes.pipeline import Stage, code_commit, read_done, stage_dir
from opd_jax.trainers import compute as compute_lib
from opd_jax.trainers.evaluate import evaluate_tasks, heldout_tasks
from opd_jax.trainers.metrics import read_metrics


def report(recipe, c, workdir: str, seeds: Sequence[int], tokenizer) -> dict:
    """Evaluate every seed's stages and write results.json, results.md and the plots of
    `recipe` (a recipe module: the protocol above); returns the results dict.

    Every model is evaluated greedily on the same held-out problems (the eval split, drawn
    by ``c.eval.seed``), so differences are paired per problem; the claims are computed by
    ``recipe.claims`` from what goes into results.json."""
    EVAL_SECONDS.clear()
    seeds = list(seeds)
    results = recipe.collect(c, workdir, seeds, tokenizer)
    stage_names = [s.name for s in recipe.build(c, seeds[0]) if s.kind != "merge"]
    results["claims"] = recipe.claims(results)
    timed = [t for t in EVAL_SECONDS.values() if t is not None]
    untimed = len(EVAL_SECONDS) - len(timed)
    results["provenance"] = (provenance(workdir, seeds, stage_names)
                             | {"eval_wall_s": round(sum(timed), 1)}
                             | ({"eval_untimed": untimed} if untimed else {}))
    write_json(os.path.join(workdir, "results.json"), results)
    recipe.write_markdown(os.path.join(workdir, "results.md"), results)
    recipe.plot(c, workdir, results)
    return results


# The evaluations a report used, fresh or cached: file -> its seconds (None: cached before
# evaluations recorded their time). `report` clears it and sums it into the provenance.
EVAL_SECONDS: dict[str, float | None] = {}


def evaluate_stage(workdir: str, name: str, cells: Sequence[tuple[str, str, str]], ev, *,
                   tokenizer, difficulty: int, tag: str = "", path: str | None = None,
                   split: str = "eval", seed: int | None = None,
                   n: int | None = None) -> dict[str, dict]:
    """{cell: row} of stage `name` on `cells` ((domain, family, effort) triples), cached in
    the stage's folder (``eval_<tag>.json``; the default tag names the difficulty, cells,
    split, seed, n and a hash of the sampling and batch settings).

    path: the model when it is no stage's output (the untouched start; its results are
    cached under ``<workdir>/<name>``). split / seed / n: the problems, ``ev.seed`` and
    ``ev.n`` unless given (a recipe draws other problems per seed, and a validation set
    from the train split)."""
    seed = ev.seed if seed is None else int(seed)
    n = ev.n if n is None else int(n)
    settings = json.dumps({"sampling": dict(ev.sampling), "batch_size": ev.batch_size},
                          sort_keys=True, default=list)
    tag = tag or (f"d{difficulty}_" + "_".join(f"{d}-{e}" for d, _, e in cells)
                  + f"_{split}_s{seed}_n{n}_" + hashlib.sha1(settings.encode()).hexdigest()[:8])
    path_out = os.path.join(stage_dir(workdir, name), f"eval_{tag}.json")
    if os.path.isfile(path_out):
        with open(path_out, encoding="utf-8") as f:
            out = json.load(f)
        EVAL_SECONDS[path_out] = _seconds(out)
        return out
    t0 = time.time()
    tasks: list[envs.Task] = []
    for domain, fam, effort in cells:
        tasks += heldout_tasks({domain: fam}, (effort,), n=n, seed=seed,
                               difficulty=difficulty, split=split)
    model = ModelRef(path or stage_dir(workdir, name)).load()
    rows = evaluate_tasks(model, tokenizer, tasks, SamplingConfig(**dict(ev.sampling)),
                          seed=seed, batch_size=ev.batch_size)
    wall = (time.time() - t0) / max(len(rows), 1)
    out = {r["cell"]: r | {"eval_s": round(wall, 2)} for r in rows}
    os.makedirs(os.path.dirname(path_out), exist_ok=True)
    write_json(path_out, out)
    EVAL_SECONDS[path_out] = _seconds(out)
    return out


def _seconds(rows: dict) -> float | None:
    """An evaluation's seconds from its rows (None when it predates ``eval_s``)."""
    if all("eval_s" in r for r in rows.values()):
        return sum(r["eval_s"] for r in rows.values())
    return None


def ratio(num: float, den: float) -> float:
    """num / den; NaN when den is 0 (a retention of a teacher that scores 0 is undefined)."""
    return float(num) / float(den) if den > 0 else float("nan")


def finite_mean(values: Sequence[float]) -> float:
    """Mean of the finite values; NaN (without numpy's empty-slice warning) when none is."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else float("nan")


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(values, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def fmt(values: Sequence[float], pct: bool = False) -> str:
    """"0.812 ± 0.020" over seeds ("0.812" for one seed); pct: "81.2% ± 2.0"."""
    if not len(values):
        return "-"
    m, s = mean_std(values)
    k = 100.0 if pct else 1.0
    body = f"{m * k:.1f}%" if pct else f"{m:.3f}"
    return body + (f" ± {s * k:.{1 if pct else 3}f}" if len(values) > 1 else "")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean and standard error of a - b over paired values (the same held-out problems):
    {"diff", "se", "n"}; se is 0 for fewer than two pairs."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
    return {"diff": float(d.mean()) if len(d) else float("nan"), "se": se, "n": int(len(d))}


def stage_cost(workdir: str, stage: Stage) -> dict:
    """What a finished stage cost: wall seconds, optimizer steps, rollouts and FLOPs (total
    and per part; `trainers.compute`), from its done.json. A merge computes nothing worth
    counting (0 FLOPs)."""
    done = read_done(workdir, stage.name)
    rec = done.get("compute")
    if rec is None and stage.kind != "merge":
        raise ValueError(f"stage {stage.name!r} in {workdir!r} has no compute record "
                         f"(compute.json): it finished before compute was counted; re-run it")
    flops = rec["flops"] if rec else {"total": 0.0}
    return {"kind": stage.kind, "wall_s": float(done["wall_s"]),
            "optimizer_steps": int(done["optimizer_steps"]),
            "iterations": int(done.get("iterations", done["optimizer_steps"])),
            "rollouts": int(rec["tokens"].get("rollouts", 0)) if rec else 0,
            "flops": float(flops["total"]), "flops_parts": flops}


def cost_table(costs: dict[str, dict]) -> str:
    """The per-stage compute table of `stage_cost` records (name -> record; the mean over
    seeds when each value is a list of seeds' records)."""
    rows, tot = [], {"wall_s": 0.0, "flops": 0.0}
    for name, recs in costs.items():
        recs = recs if isinstance(recs, list) else [recs]
        m = {k: float(np.mean([r[k] for r in recs]))
             for k in ("wall_s", "optimizer_steps", "rollouts", "flops")}
        part = lambda k: float(np.mean([r["flops_parts"].get(k, 0.0) for r in recs]))
        tot["wall_s"] += m["wall_s"]
        tot["flops"] += m["flops"]
        rows.append([name, recs[0]["kind"], f"{m['optimizer_steps']:.0f}",
                     f"{m['rollouts']:.0f}", f"{m['wall_s']:.0f}",
                     compute_lib.format_flops(m["flops"]),
                     " / ".join(compute_lib.format_flops(part(k))
                                for k in ("rollout", "teacher", "forward", "train"))])
    rows.append(["total", "", "", "", f"{tot['wall_s']:.0f}",
                 compute_lib.format_flops(tot["flops"]), ""])
    return markdown_table(["stage", "kind", "optimizer steps", "rollouts", "wall s", "FLOPs",
                           "rollout / teacher / extra forward / train FLOPs"], rows)


def write_provenance(workdir: str, command: str) -> None:
    """Record the command and commit of an experiment invocation (`provenance`)."""
    write_json(os.path.join(workdir, "provenance.json"), {"command": command,
                                                          "commit": code_commit()})


def provenance(workdir: str, seeds: Sequence[int], stage_names: Sequence[str]) -> dict:
    """Command, commit and wall time of an experiment: the last invocation's command and
    commit (``provenance.json``, written by `run_experiment`) and the summed wall seconds of
    its stages over seeds (each stage's ``done.json``: a resumed run counts each stage once);
    ``stage_commits`` when the stages recorded commits other than the invocation's."""
    path = os.path.join(workdir, "provenance.json")
    meta = {"command": "unknown", "commit": "unknown"}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            meta |= json.load(f)
    done = [read_done(os.path.join(workdir, f"seed{s}"), n) for s in seeds for n in stage_names]
    wall = sum(d.get("wall_s", 0.0) for d in done)
    commits = sorted({d["commit"] for d in done if "commit" in d})
    return meta | {"stages_wall_s": round(float(wall), 1)} | (
        {"stage_commits": commits} if commits and commits != [meta["commit"]] else {})


def provenance_line(meta: dict) -> str:
    """The results.md line of a `provenance` dict (with the report's ``eval_wall_s``)."""
    line = (f"Command `{meta['command']}`; commit {meta['commit']}; stages "
            f"{meta['stages_wall_s']:.0f} s + evaluation {meta['eval_wall_s']:.0f} s of wall "
            f"time (summed over seeds).")
    if meta.get("stage_commits"):
        line += f" The stages ran at commit {', '.join(meta['stage_commits'])}."
    if meta.get("eval_untimed"):
        line += (f" {meta['eval_untimed']} evaluations were read from an earlier invocation's "
                 f"cache that did not record their time; they are not in the evaluation time.")
    return line


def eval_meta(ev) -> dict:
    """What results.json records of an evaluation config: difficulty, problems per cell, seed."""
    return {"difficulty": ev.difficulty, "n": ev.n, "seed": ev.seed}


def beats(p: dict, d: float, k: float) -> bool:
    """"Beats by d beyond k se" for a `paired` difference p: p["diff"] >= d and > k se."""
    return p["diff"] >= d and p["diff"] > k * p["se"]


def paired_list(ps: dict) -> str:
    """"name +0.123 (se 0.045), ..." of `paired` results by name."""
    return ", ".join(f"{k} {p['diff']:+.3f} (se {p['se']:.3f})" for k, p in ps.items())


def claim_lines(claims: Sequence[dict]) -> list[str]:
    """results.md's "- **PASS** claim: measured" lines."""
    return [f"- **{verdict(cl)}** {cl['claim']}: {cl['measured']}" for cl in claims]


def verdict(claim: dict) -> str:
    """PASS, FAIL, or NOT JUDGED for a claim a failed precondition leaves without meaning
    (``"judged": False``; its numbers are still printed); a claim judged on part of its
    cells (``"scope"``) says on which."""
    if not claim.get("judged", True):
        return "NOT JUDGED (precondition failed)"
    word = "PASS" if claim["pass"] else "FAIL"
    return f"{word} on {claim['scope']}" if claim.get("scope") else word


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=float)
    os.replace(tmp, path)


def pooled_curve(curves) -> tuple[list[int], list[float]]:
    """The mean over seeds of in-run curves ((iterations, values) per seed) at the
    iterations every seed evaluated."""
    points = [dict(zip(*c)) for c in curves]
    its = sorted(set.intersection(*(set(p) for p in points))) if points else []
    return its, [float(np.mean([p[i] for p in points])) for i in its]


def curve(workdir: str, stage: str, key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of a logged metric of a stage (held-out rewards are sparse)."""
    pts = {}
    for m in read_metrics(stage_dir(workdir, stage)):
        if key in m:
            pts[m["step"]] = m[key]          # a resumed run may log a step twice: last wins
    steps = sorted(pts)
    return steps, [pts[s] for s in steps]
